"""CPU thread groups (services/common/cpus.py): which cores a replica and its drafter worker get."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tlt.services.common.cpus import available_cpus, cpu_group, pin


def test_groups_by_hand():
    cpus = [0, 1, 2, 3, 4, 5]
    assert [cpu_group(i, 2, cpus) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert cpu_group(3, 2, cpus) == [0, 1]  # more groups than cores: wraps around
    assert cpu_group(1, 4, cpus) == [4, 5, 0, 1]
    assert cpu_group(0, 9, cpus) == cpus  # never more threads than cores
    assert cpu_group(5, 1, [2, 7]) == [7]  # only the cores this process may use


def _child(cores, q):  # noqa: ANN001
    pin(cores)
    q.put(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pin_restricts_a_process_to_its_group():
    cores = cpu_group(1, 1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(cores, q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == cores and set(got) <= set(available_cpus())


def _idle_child(q):  # noqa: ANN001
    import threading

    from tlt.services.common.cpus import run_when_idle

    started = threading.Event()
    before = threading.Thread(target=lambda: started.wait(30))  # a thread that exists before the call
    before.start()
    ok = run_when_idle()
    after_policy = []
    later = threading.Thread(target=lambda: after_policy.append(os.sched_getscheduler(0)))  # one started after
    later.start()
    later.join()
    policies = {}
    for t in os.listdir("/proc/self/task"):
        try:
            policies[int(t)] = os.sched_getscheduler(int(t))
        except ProcessLookupError:  # a thread that was ending as the folder was read (the joined one)
            pass
    started.set()
    before.join()
    q.put((ok, policies, after_policy))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_run_when_idle_puts_every_thread_of_the_process_in_sched_idle():
    """Drafter workers with worker_sched = "idle": every thread (torch's and zmq's included, started before or
    after) must be SCHED_IDLE, else the thread left normal still takes the trainer's cores."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_idle_child, args=(q,))
    p.start()
    ok, policies, after = q.get(timeout=60)
    p.join(60)
    assert ok and len(policies) >= 2
    assert set(policies.values()) == {os.SCHED_IDLE}, policies
    assert after == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the test process itself is untouched
