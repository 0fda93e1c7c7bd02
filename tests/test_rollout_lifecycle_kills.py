"""What the replica lifecycle (services/rollout/replica_lifecycle.py) kills, and when: cases the restart tests
(tests/test_rollout_restarts.py) did not pin, found by session 55's mutation audit.

A real rollout server (real replica processes with the native engine, real grpc.aio) on 127.0.0.1; the tests SIGSTOP a
replica by the pid the server reports (a process this test started) to make it hang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import grpc
import pytest
from rollout_helpers import ServerThread, pid_gone, tiny_checkpoint
from structlog.testing import capture_logs

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("lifecycle-model"))


def test_a_stalled_replica_that_is_not_restarted_is_killed_all_the_same(model_dir):
    """The stall watchdog SIGKILLs a hung replica itself. With a restart coming, the restart's `exit_grace_s` kill
    would hide a watchdog that only declared it dead; with max_restarts=0 nothing else kills it, and a hung process
    that keeps its memory (a GPU's, in service) for the server's lifetime is what the kill is for."""
    with ServerThread(model_dir, replicas=1, max_restarts=0, stall_timeout_s=1.5, redispatch_limit=0) as s, \
            RolloutClient(s.grpc_address, timeout_s=30) as c:
        old = s.server.replica_pids()[0]
        os.kill(old, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as err, capture_logs() as logs:
                list(c.batch_generate(["2+2="], n=2, params=rollout_pb2.SamplingParams(max_tokens=4)))
            assert "stalled" in err.value.details(), err.value
            stalled = [(e["log_level"], e["replica"], e["pid"], e["outstanding"]) for e in logs
                       if e["event"] == "replica_stalled"]
            assert stalled == [("error", 0, old, 2)], ("the kill is logged once, with what it held", stalled)
            deadline = time.monotonic() + 10
            while not pid_gone(old) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pid_gone(old), "the stalled replica's process was declared dead but left running (stopped)"
            time.sleep(0.5)  # its reader sees the pipe close: the death the watchdog already declared
            assert s.server.pool.deaths == {0: 1}, ("a replica killed as stalled counted as more than one death",
                                                    s.server.pool.deaths)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGCONT)


def test_a_push_applied_longer_than_the_stall_timeout_is_not_a_stall(model_dir):
    """A replica applying a policy push answers once done (within `update_timeout_s`) and sends nothing meanwhile, with
    its sequences still outstanding: the watchdog must not take that silence for a hang. Here the apply is held 4 s
    (SIGSTOP while the push arrives, stall_timeout_s=1.5); the push lands and the replica is never killed."""
    import threading

    import safetensors.torch

    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    changed = {"model.norm.weight": original["model.norm.weight"] * 1.25}
    long = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=5)
    with ServerThread(model_dir, replicas=1, max_restarts=0, stall_timeout_s=1.5, update_timeout_s=60,
                      redispatch_limit=0) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        pool, rep = s.server.pool, s.server.pool.replicas[0]
        outs: list = []
        gen = threading.Thread(target=lambda: outs.extend(c.batch_generate(["1+1="], n=8, params=long)), daemon=True)
        gen.start()
        deadline = time.monotonic() + 30
        while rep.outstanding == 0:
            assert time.monotonic() < deadline, "the request never reached the replica"
            time.sleep(0.01)
        os.kill(rep.process.pid, signal.SIGSTOP)
        result: list = []
        push = threading.Thread(target=lambda: result.append(c.update_weights(changed, "policy", 1)), daemon=True)
        try:
            push.start()
            while not rep.applying:
                assert time.monotonic() < deadline, "the push never reached the replica"
                time.sleep(0.01)
            time.sleep(4.0)  # > stall_timeout_s, silent, with sequences outstanding, applying the push
            assert rep.outstanding > 0, "the sequences finished before the replica was stopped: nothing was tested"
            assert rep.alive and pool.deaths == {}, ("a replica applying a push was killed as stalled", rep.error)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rep.process.pid, signal.SIGCONT)
        push.join(60)
        gen.join(60)
        assert result and result[0].ok and result[0].version == 1, result
        assert len(outs) == 8 and pool.deaths == {}, (len(outs), pool.deaths)


def test_a_replica_silent_a_second_past_the_stall_timeout_is_caught(model_dir):
    """The watchdog looks every quarter of `stall_timeout_s` (at most 5 s) and kills a replica silent for longer than
    it, not for some multiple of it: a hang of 2.5 s with stall_timeout_s=1.5 is caught before the replica resumes,
    and its request fails as stalled (redispatch_limit=0, max_restarts=0)."""
    import threading

    long = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=5)
    with ServerThread(model_dir, replicas=1, max_restarts=0, stall_timeout_s=1.5, redispatch_limit=0) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c:
        rep = s.server.pool.replicas[0]
        errors: list = []

        def generate() -> None:
            try:
                list(c.batch_generate(["1+1="], n=8, params=long))
            except grpc.RpcError as e:
                errors.append(e)

        gen = threading.Thread(target=generate, daemon=True)
        gen.start()
        deadline = time.monotonic() + 30
        while rep.outstanding == 0:
            assert time.monotonic() < deadline, "the request never reached the replica"
            time.sleep(0.01)
        pid = rep.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(2.5)
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed as stalled (and reaped by the forkserver)
                os.kill(pid, signal.SIGCONT)
        gen.join(60)
        assert s.server.pool.deaths == {0: 1}, ("a replica silent 2.5 s was not killed (stall_timeout_s=1.5)",
                                                s.server.pool.deaths)
        assert errors and "stalled" in errors[0].details(), errors


def _replaced_after(pool, deadline_s: float = 30) -> float:
    """SIGKILL replica 0; the seconds until its replacement process was started."""
    dead = pool.replicas[0]
    os.kill(dead.process.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while pool.replicas[0] is dead:
        assert time.monotonic() - t0 < deadline_s, "no replacement was started"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_a_dead_replica_is_restarted_after_1_s_then_2_s_in_a_row(model_dir):
    """The restart back-off is 1 s, doubling with each restart in a row (at most 30 s): a replica that died for the
    first time is replaced about 1 s after, neither at once (a crash loop would spin) nor after the 2 s of a second
    restart in a row; its replacement, dead again at once, is replaced after 2 s."""
    with ServerThread(model_dir, replicas=1, max_restarts=2) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        pool = s.server.pool
        took = _replaced_after(pool)
        assert 0.95 <= took < 1.9, f"the first restart started {took:.2f} s after the death (the back-off is 1 s)"
        deadline = time.monotonic() + 120
        while not c.status().replicas[0].alive:
            assert time.monotonic() < deadline, "the replacement did not come up"
            time.sleep(0.05)
        took = _replaced_after(pool)
        assert 1.95 <= took < 2.9, f"the second restart in a row started {took:.2f} s after the death (back-off 2 s)"
        assert pool.restarts == {0: 2}, pool.restarts


def test_a_replacement_that_does_not_come_up_in_time_is_killed(model_dir):
    """A restart gives its replacement `timeout_s` to load and get the pool's weights; one that does not (here
    SIGSTOPped while it loads) is killed, so that its reader reports the death and `_on_dead` decides again, instead
    of a process that holds its memory, never routed to, for the server's lifetime. The restart is called directly
    with a 2-s timeout (300 s in service), on a replica that died with max_restarts=0."""
    import threading

    with ServerThread(model_dir, replicas=1, max_restarts=0) as s:
        pool = s.server.pool
        dead = pool.replicas[0]
        os.kill(dead.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not dead.error:
            assert time.monotonic() < deadline, "the pool never saw the replica die"
            time.sleep(0.02)
        restart = threading.Thread(target=lambda: s.call(pool._restart(dead, timeout_s=2.0)), daemon=True)
        restart.start()
        while pool.replicas[0] is dead:
            assert time.monotonic() < deadline, "no replacement was started"
            time.sleep(0.002)
        new = pool.replicas[0].process.pid
        os.kill(new, signal.SIGSTOP)
        try:
            restart.join(30)
            assert not restart.is_alive(), "the restart did not give up after its timeout"
            deadline = time.monotonic() + 10
            while not pid_gone(new) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pid_gone(new), "a replacement that did not come up in time was left running (stopped)"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(new, signal.SIGCONT)


def test_a_dead_replica_s_sequences_no_longer_count_against_admission(model_dir):
    """`max_pending_sequences` counts the sequences each replica holds; a replica that died (not restarted) holds none,
    whatever it ran when it died. Counted on, they took the dead replica's share of the limit for the server's
    lifetime: here a batch of 8 under a limit of 8 was refused as overloaded with the other replica idle."""
    import threading

    long = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=5)
    with ServerThread(model_dir, replicas=2, max_restarts=0, redispatch_limit=0, max_pending_sequences=8) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c:
        pool = s.server.pool

        def batch() -> None:
            with contextlib.suppress(grpc.RpcError):  # its samples on replica 1 fail (redispatch_limit=0)
                list(c.batch_generate(["1+1=", "2+2="], n=4, params=long))

        first = threading.Thread(target=batch, daemon=True)
        first.start()
        deadline = time.monotonic() + 30
        while not all(r.outstanding > 0 for r in pool.replicas):
            assert time.monotonic() < deadline, ("the batch did not reach both replicas",
                                                 [r.outstanding for r in pool.replicas])
            time.sleep(0.01)
        os.kill(pool.replicas[1].process.pid, signal.SIGKILL)
        first.join(60)
        while pool.replicas[0].outstanding or not pool.replicas[1].error:
            assert time.monotonic() < deadline + 30, "replica 0 never went idle, or the death was not seen"
            time.sleep(0.05)
        assert pool.pending_sequences == 0, ("the dead replica's sequences still count", pool.pending_sequences)
        outs = list(c.batch_generate(["3+3="], n=8, params=rollout_pb2.SamplingParams(max_tokens=4)))
        assert len(outs) == 8 and {o.replica_id for o in outs} == {0}


def test_a_stop_kills_a_replica_still_loading_instead_of_waiting_for_it(model_dir, tmp_path):
    """A replica reads the Shutdown only once its model is loaded (minutes, for a large one), so `stop` kills one still
    loading at once rather than wait out its join timeout (10 s) for it. Here `tlt rollout serve` gets SIGTERM while
    its two replicas (forked by the forkserver, a process this test started) are held SIGSTOPped mid-load: it exits
    in seconds and takes them with it."""
    import subprocess

    import psutil
    from rollout_helpers import ServeProcess, assert_all_gone

    serve = ServeProcess(model_dir, tmp_path, replicas=2)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(serve.cmd, stdout=out, stderr=subprocess.STDOUT)
    replicas: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(replicas) < 2 or "replicas_starting" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            forkservers = [p for p in psutil.Process(proc.pid).children() if "forkserver" in " ".join(p.cmdline())]
            replicas = [c.pid for f in forkservers for c in f.children()]
            time.sleep(0.01)
        for pid in replicas:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        proc.terminate()
        proc.wait(60)
        took = time.monotonic() - t0
        assert took < 7.0, f"the stop waited {took:.1f} s for replicas that were still loading (its timeout is 10 s)"
        assert_all_gone(replicas)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in replicas:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_a_new_replica_and_a_dead_one_report_an_empty_engine_on_capacity_events(model_dir):
    """What a replica's engine holds (ipc.EngineLoad) is nothing until its first step reports, and nothing again once
    it died: a fresh replica's IDLE and its first BUSY (work handed over, no step yet: all of it queued) say 0
    running and 0 KV use, and so does a dead one's DRAINING, whatever it ran before it died."""
    import threading

    from tlt.services.common.events import CapacitySubscriber
    from tlt.v1 import common_pb2

    busy, draining = common_pb2.REPLICA_STATE_BUSY, common_pb2.REPLICA_STATE_DRAINING
    long = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=5)
    with ServerThread(model_dir, replicas=1, max_restarts=0, redispatch_limit=0, capacity_pub="tcp://127.0.0.1:*",
                      capacity_heartbeat_s=0.2) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        try:
            assert [(e.running, e.queued, e.kv_usage) for e in sub.snapshot()] == [(0, 0, 0.0)], sub.snapshot()

            def batch() -> None:
                with contextlib.suppress(grpc.RpcError):  # it fails when the replica is killed
                    list(c.batch_generate(["1+1="], n=6, params=long))

            threading.Thread(target=batch, daemon=True).start()
            seen: list = []
            deadline = time.monotonic() + 30
            while not any(e.state == busy and e.kv_usage > 0 for e in seen):
                assert time.monotonic() < deadline, [(e.state, e.running, e.queued, e.kv_usage) for e in seen]
                if (e := sub.recv(0.5)) is not None:
                    seen.append(e)
            first = next(e for e in seen if e.state == busy)
            assert (first.running, first.queued, first.kv_usage) == (0, 6, 0.0), ("the first BUSY, no step yet", first)
            os.kill(s.server.replica_pids()[0], signal.SIGKILL)
            while not any(e.state == draining for e in seen):
                assert time.monotonic() < deadline + 30, [(e.state, e.running, e.kv_usage) for e in seen]
                if (e := sub.recv(0.5)) is not None:
                    seen.append(e)
            dead = next(e for e in seen if e.state == draining)
            assert (dead.running, dead.queued, dead.kv_usage) == (0, 0, 0.0), ("a dead replica's DRAINING", dead)
        finally:
            sub.close()


def test_a_stop_during_a_restart_s_forkserver_warm_up_starts_no_replica(model_dir, monkeypatch):
    """A restart warms the forkserver (which imports torch: seconds) before it spawns the replacement. A stop landing
    in that warm-up must leave no replica started after it: a process nobody stops, holding its memory (a GPU's, in
    service) after the server is gone. The warm-up is held here until the pool has stopped, with the loop still
    running, then let go; no spawn may follow. (Session 55's audit left this as L-20: stop cancels the restart task,
    and the restart now also checks for a stop after the warm-up; the test fails only with both gone.)"""
    import threading

    from tlt.services.rollout import replica_lifecycle

    entered, release = threading.Event(), threading.Event()
    real_warm = replica_lifecycle.warm

    def held_warm(ctx):  # noqa: ANN001, ANN202
        entered.set()
        release.wait(30)
        return real_warm(ctx)

    with ServerThread(model_dir, replicas=1, max_restarts=1) as s:
        pool = s.server.pool
        spawned: list[int] = []
        real_spawn = pool._spawn
        monkeypatch.setattr(pool, "_spawn", lambda i: spawned.append(i) or real_spawn(i))
        monkeypatch.setattr(replica_lifecycle, "warm", held_warm)
        try:
            os.kill(pool.replicas[0].process.pid, signal.SIGKILL)
            assert entered.wait(30), "the dead replica's restart never reached the forkserver warm-up"
            s.call(pool.stop(), timeout=30)
        finally:
            release.set()
        time.sleep(1.0)  # the loop still runs: a restart that outlived the stop would spawn now
        assert spawned == [], f"a replica was started after the pool had stopped (replica ids {spawned})"
        assert [r.process.pid for r in pool.replicas if r.process.is_alive()] == [], "a replica outlived the stop"
