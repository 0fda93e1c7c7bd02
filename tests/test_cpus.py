"""CPU thread groups (services/common/cpus.py): which cores a replica and its drafter worker get."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tlt.services.common.cpus import available_cpus, cgroup_cpu_limit, cpu_group, pin, replica_threads, usable_cores


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


def test_cgroup_cpu_limit_reads_v2_and_v1_quotas(tmp_path):
    """docker --cpus / a Kubernetes CPU limit show only in the cgroup: affinity still lists every host core."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(str(v2)) == pytest.approx(2.5)
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2)) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(v1)) == pytest.approx(2.0)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(str(v1)) is None
    assert cgroup_cpu_limit(str(tmp_path / "none")) is None  # no cgroup files (macOS, a bare sandbox)
    (v2 / "cpu.max").write_text("garbage\n")
    assert cgroup_cpu_limit(str(v2)) is None


def test_usable_cores_is_the_affinity_capped_by_the_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core still runs one thread
    assert usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == len(available_cpus())


def test_replicas_that_share_cores_do_not_spin():
    """Spinning OpenMP threads of two processes on the same cores wait out each other's time slices: two
    2-thread decode loops on 2 cores ran 17x slower each with GOMP_SPINCOUNT=300000 than passive
    (BENCHMARKS.md, "Session 11"). A replica spins only when its cores are its own."""
    assert replica_threads(replicas=1, threads_per_replica=0, cores=2) == (2, True)
    assert replica_threads(replicas=2, threads_per_replica=0, cores=2) == (1, True)  # one thread: no barriers
    assert replica_threads(replicas=2, threads_per_replica=2, cores=2) == (2, False)  # the groups wrap: shared
    assert replica_threads(replicas=4, threads_per_replica=0, cores=2) == (1, True)
    assert replica_threads(replicas=3, threads_per_replica=0, cores=8) == (2, True)
    assert replica_threads(replicas=1, threads_per_replica=4, cores=2) == (4, False)  # more threads than cores


def test_a_server_whose_replicas_share_cores_starts_them_without_spinning(random_model_dir):
    """The real server and replica processes: asked for 2 replicas x (all the cores) threads, the groups
    overlap, so the pool gets spin_wait off; one replica on its own cores keeps it."""
    from rollout_helpers import ServerThread

    threads = max(2, usable_cores())  # at least 2: one thread never waits at a barrier, so it may spin
    with ServerThread(random_model_dir, replicas=2, threads_per_replica=threads, spin_wait=True) as s:
        assert s.server.pool.spin_wait is False
    with ServerThread(random_model_dir, replicas=1, threads_per_replica=usable_cores(), spin_wait=True) as s:
        assert s.server.pool.spin_wait is True
