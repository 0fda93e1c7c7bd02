"""CPU thread groups: on a CPU-only machine a replica's "device" is a set of cores.

A rollout replica i running `threads` torch threads gets cores cpu_group(i, threads) of the cores this
process may use; the drafter worker that watches replica i trains on the same group, so training in a
replica's idle window never takes cores from another replica still decoding its tail (issue #5: nothing
trains on a busy device). Groups wrap around when replicas x threads exceeds the cores.
Linux only (os.sched_setaffinity); elsewhere pinning is a no-op and says so.
"""

from __future__ import annotations

import os


def available_cpus() -> list[int]:
    """Cores this process may run on, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_group(index: int, threads: int, cpus: list[int] | None = None) -> list[int]:
    """The `threads` cores of group `index` (replica or worker index), wrapping around the available cores."""
    cpus = available_cpus() if cpus is None else cpus
    threads = max(1, min(threads, len(cpus)))
    start = (index * threads) % len(cpus)
    return [cpus[(start + k) % len(cpus)] for k in range(threads)]


def pin(cores: list[int]) -> bool:
    """Restrict this process to `cores`; False where the platform cannot (nothing changes then)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    os.sched_setaffinity(0, set(cores))
    return True


# libgomp's own default spin before a waiting thread sleeps (about a millisecond or less on current cores).
SPIN_COUNT = "300000"


def spin_at_barriers() -> bool:
    """Let this process's OpenMP threads spin briefly at barriers (libgomp: GOMP_SPINCOUNT overrides the
    OMP_WAIT_POLICY=PASSIVE the `tlt` CLI sets for services). It only works before torch is imported,
    and a GOMP_SPINCOUNT the caller set is kept: returns whether the spin count is now in effect."""
    import sys

    if "torch" in sys.modules:
        return False
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    return True


def pin_group(index: int, threads: int) -> tuple[list[int], bool]:
    """Pin this process to group `index` of `threads` cores (a replica, or the worker watching it):
    (the group's cores, whether pinning took effect)."""
    cores = cpu_group(index, max(1, threads))
    return cores, pin(cores)


def run_when_idle() -> bool:
    """Linux SCHED_IDLE for every thread of this process (threads started later inherit it): it runs only on
    cycles no normal task wants, and a normal task that wakes preempts it at once. A nice-19 task is still
    a normal task, which may keep a core until its slice ends while a trainer thread woken at an OpenMP
    barrier waits (the likely reason for BENCHMARKS.md, "Session 7": a nice-19 drafter-sized trainer slowed
    a 2-thread policy forward/backward by 21%, a SCHED_IDLE one by nothing measurable).
    False where the platform has no SCHED_IDLE (nothing changes then)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            _sched_idle(tid)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    return True


def _sched_idle(tid: int) -> None:
    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))  # tid 0: the calling thread


def this_thread_when_idle() -> bool:
    """SCHED_IDLE for the calling thread only (Linux applies scheduling policies per thread): for one
    process's heavy background thread while its other threads keep their priority. One-way: an
    unprivileged thread cannot leave SCHED_IDLE. False where the platform has no SCHED_IDLE."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    _sched_idle(0)
    return True
