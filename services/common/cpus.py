"""CPU thread groups: on a CPU-only machine a replica's "device" is a set of cores.

A rollout replica i running `threads` torch threads gets cores cpu_group(i, threads) of the cores this
process may use; the drafter worker that watches replica i trains on the same group, so training in a
replica's idle window never takes cores from another replica still decoding its tail (issue #5: nothing
trains on a busy device). Groups wrap around when replicas x threads exceeds the cores.
Linux only (os.sched_setaffinity); elsewhere pinning is a no-op and says so.
"""

from __future__ import annotations

import os
from pathlib import Path


def available_cpus() -> list[int]:
    """Cores this process may run on, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """This process's cgroup CPU quota in cores (docker --cpus, a Kubernetes CPU limit), None when there is none
    or it cannot be read. A quota is invisible to the affinity mask, which still lists every host core, so a
    container limited to 2 CPUs on a 64-core host would otherwise start 64 threads per replica.
    cgroup v2: `cpu.max` ("quota period" or "max period"); v1: `cpu/cpu.cfs_quota_us` (-1: none) over
    `cpu/cpu.cfs_period_us`."""
    base = Path(root)
    try:
        if (base / "cpu.max").is_file():
            quota, period = (base / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (base / "cpu" / "cpu.cfs_quota_us").is_file():
            quota_us = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
            return None if quota_us <= 0 else quota_us / int((base / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):  # an unreadable or unexpected file: no limit known
        return None
    return None


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process can really keep busy: its affinity mask, capped by the cgroup quota (at least 1)."""
    cores = len(available_cpus())
    limit = cgroup_cpu_limit(cgroup_root)
    return cores if limit is None else max(1, min(cores, int(limit)))


def replica_threads(replicas: int, threads_per_replica: int, cores: int) -> tuple[int, bool]:
    """(torch threads per replica, whether its OpenMP threads may spin at barriers). 0 threads: the cores shared
    out evenly. Spinning pays only on cores a replica has to itself: where replicas x threads exceeds the cores,
    each spinning thread burns the slice its sibling on a shared core needs (BENCHMARKS.md, "Session 11": two
    2-thread decode loops on 2 cores ran 17x slower each than with passive waits). One thread never waits at a
    barrier, so it may always spin (nothing changes)."""
    threads = threads_per_replica or max(1, cores // replicas)
    return threads, threads == 1 or replicas * threads <= cores


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
