"""Colocated placement: the trainer borrows the rollout replicas' devices (Rollout.LendDevices) for its
old-logprob pass and update. Real server, real replica processes, real gRPC and ZeroMQ on 127.0.0.1.

While lent, an idle replica publishes LENT, not IDLE, so that a drafter worker (which trains only on IDLE) does
not train on the device the trainer is using; the lend ends when the trainer takes the devices back, when new work
arrives, or when its lease lapses (a trainer killed mid-update must not keep the drafter off forever). The SGLang
backend's `release()` / `resume()` hooks run in the replica; `tests/lend_engine.py` is a native engine with the
same hooks (SGLang itself needs a GPU) that records when they run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import grpc
import pytest

from drafter_helpers import make, model_dir, running, samples, state, wait_for  # noqa: F401 (fixtures)
from lend_engine import LendRecordingEngine
from rollout_helpers import ServerThread
from tlt.services.common.events import CapacitySubscriber
from tlt.services.drafter.worker import DrafterWorker
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import common_pb2, rollout_pb2

BUSY, IDLE, LENT = common_pb2.REPLICA_STATE_BUSY, common_pb2.REPLICA_STATE_IDLE, common_pb2.REPLICA_STATE_LENT


def _changes(sub, until, timeout_s: float = 10.0) -> list[tuple[int, int]]:  # noqa: ANN001
    """(replica, state) of every non-heartbeat event until `until(changes)` holds, or the timeout."""
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(seen):
        e = sub.recv(0.2)
        if e is not None and not e.heartbeat:
            seen.append((e.replica_id, e.state))
    return seen


def _states_of(seen: list[tuple[int, int]], replica: int) -> list[int]:
    """The replica's state changes (a count change repeats the state: collapsed)."""
    out: list[int] = []
    for r, st in seen:
        if r == replica and (not out or out[-1] != st):
            out.append(st)
    return out


def _last(seen: list[tuple[int, int]]) -> dict[int, int]:
    return {r: st for r, st in seen}


TEST_BACKENDS = frozenset({"lend_engine:LendRecordingEngine", "test_colocated_lend:SlowResumeEngine"})
TEST_ENV = frozenset({"TLT_TEST_LEND_LOG", "TLT_TEST_RELEASE_S", "TLT_TEST_RESUME_S"})


@pytest.fixture(autouse=True)
def _test_backends_forked(monkeypatch):  # noqa: ANN001, ANN202
    """Start the test backends' replicas as forks of the preloaded forkserver, as a native CPU replica's are
    (services/rollout/replica_start.py). They are the native engine on a CPU with the lend hooks added, so a fork is
    the process a spawn would give; but any 'module:Class' backend is spawned, and so is a replica of a front whose
    environment changed (the TLT_TEST_* variables these tests set): a spawn imports torch again, ~8 s of a core per
    replica start and restart on the 2-core CI machine. The TLT_TEST_* variables are read when a hook runs, never at
    import, and a forked replica takes the front's environment as it is now (serve_replica(environ=...)): volatile.
    What is tested (the pool's and the replica loop's lend, release and resume) runs the same either way; the
    choice of start method itself is tested in tests/test_replica_start.py."""
    from tlt.services.rollout import replica_lifecycle, replica_start

    real = replica_start.replica_context
    monkeypatch.setattr(replica_start, "VOLATILE", replica_start.VOLATILE | TEST_ENV)
    monkeypatch.setattr(replica_lifecycle, "replica_context",
                        lambda backend, *args: real("native" if backend in TEST_BACKENDS else backend, *args))


def _server(model_dir, **kw):  # noqa: ANN001, ANN202
    return ServerThread(model_dir, replicas=2, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.3, **kw)


class SlowResumeEngine(LendRecordingEngine):
    """`LendRecordingEngine` whose resume takes TLT_TEST_RESUME_S (SGLang re-allocating its KV cache is not instant)
    and logs `resumed-<pid>` once done, so a test can tell which replica had resumed when it said IDLE. Runs in the
    replica's process (backend "test_colocated_lend:SlowResumeEngine")."""

    def resume(self) -> None:
        if self.released:
            time.sleep(float(os.environ.get("TLT_TEST_RESUME_S", "0")))
            super().resume()
            self._log(f"resumed-{os.getpid()}")


def test_lent_replicas_say_lent_until_taken_back(model_dir) -> None:
    with _server(model_dir) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert sorted((e.replica_id, e.state) for e in sub.snapshot()) == [(0, IDLE), (1, IDLE)]
        with RolloutClient(s.grpc_address) as client:
            r = client.lend_devices(True, lease_s=60, holder="trainer")
            assert r.lent and sorted(r.replicas) == [0, 1] and 55 < r.expires_in_s <= 60
            seen = _changes(sub, lambda c: _last(c) == {0: LENT, 1: LENT})
            assert _last(seen) == {0: LENT, 1: LENT}, seen
            # a late subscriber learns it at once, and status says who has the devices
            late = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
            assert sorted((e.replica_id, e.state) for e in late.snapshot()) == [(0, LENT), (1, LENT)]
            late.close()
            st = client.status()
            assert st.lent_to == "trainer" and [x.state for x in st.replicas] == [LENT, LENT]
            # renewing sends no new state
            assert client.lend_devices(True, lease_s=60).lent
            assert _changes(sub, lambda c: False, timeout_s=0.8) == []
            back = client.lend_devices(False)
            assert not back.lent and sorted(back.replicas) == [0, 1]
            seen = _changes(sub, lambda c: _last(c) == {0: IDLE, 1: IDLE})
            assert _last(seen) == {0: IDLE, 1: IDLE} and all(st == IDLE for _, st in seen), seen
            st = client.status()
            assert st.lent_to == "" and [x.state for x in st.replicas] == [IDLE, IDLE]
        sub.close()


def test_work_takes_the_devices_back_and_the_served_replica_never_says_idle_between(model_dir) -> None:
    """LENT -> BUSY directly: an IDLE in between would let a drafter worker start on a device about to decode."""
    with _server(model_dir) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        sub.snapshot()
        with RolloutClient(s.grpc_address) as client:
            client.lend_devices(True, lease_s=60)
            _changes(sub, lambda c: _last(c) == {0: LENT, 1: LENT})
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=6)
            done = client.generate("1+2=", n=1, params=params)
            assert len(done) == 1 and done[0].token_ids
            seen = _changes(sub, lambda c: _last(c) == {0: IDLE, 1: IDLE})
            served = next(r for r, st in seen if st == BUSY)
            other = 1 - served
            assert _states_of(seen, served) == [BUSY, IDLE], seen
            assert _states_of(seen, other) == [IDLE], seen
            assert client.status().lent_to == ""
        sub.close()


def test_a_policy_push_takes_the_devices_back(model_dir) -> None:
    import safetensors.torch

    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    with _server(model_dir) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        sub.snapshot()
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            client.lend_devices(True, lease_s=60)
            _changes(sub, lambda c: _last(c) == {0: LENT, 1: LENT})
            assert client.update_weights(weights, "policy", 1).ok
            seen = _changes(sub, lambda c: _last(c) == {0: IDLE, 1: IDLE})
            for r in (0, 1):
                assert _states_of(seen, r) == [BUSY, IDLE], seen
            assert client.status().lent_to == ""
        sub.close()


def test_the_lease_lapses_when_the_borrower_goes_quiet(model_dir) -> None:
    with _server(model_dir) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        sub.snapshot()
        with RolloutClient(s.grpc_address) as client:
            t0 = time.monotonic()
            client.lend_devices(True, lease_s=1.0)
            _changes(sub, lambda c: _last(c) == {0: LENT, 1: LENT})
            client.lend_devices(True, lease_s=1.0)  # renewed at ~t0: lapses ~1 s after this
            seen = _changes(sub, lambda c: _last(c) == {0: IDLE, 1: IDLE})
            waited = time.monotonic() - t0
            assert _last(seen) == {0: IDLE, 1: IDLE} and 0.9 < waited < 5, (seen, waited)
            assert client.status().lent_to == ""
        sub.close()


def test_lend_is_control_plane_and_checks_its_lease(model_dir) -> None:
    with _server(model_dir, control_token="s3cret") as s:
        with RolloutClient(s.grpc_address) as anon:
            with pytest.raises(grpc.RpcError) as e:
                anon.lend_devices(True, lease_s=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with RolloutClient(s.grpc_address, control_token="s3cret") as client:
            for bad in (0, -1, float("nan"), float("inf"), 1e9):
                with pytest.raises(grpc.RpcError) as e:
                    client.lend_devices(True, lease_s=bad)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert client.status().lent_to == ""
            assert client.lend_devices(True, lease_s=10).lent
            from tlt.services.rollout.lease import MAX_LEASE_S

            r = client.lend_devices(True, lease_s=MAX_LEASE_S)  # the bound itself is a lease (here a renewal)
            assert r.lent and r.expires_in_s > MAX_LEASE_S - 60, r


def test_backend_release_waits_for_running_sequences_and_resume_comes_before_new_work(model_dir, tmp_path,
                                                                                        monkeypatch) -> None:
    log = tmp_path / "lend.log"
    log.write_text("")
    monkeypatch.setenv("TLT_TEST_LEND_LOG", str(log))  # inherited by the spawned replica
    with ServerThread(model_dir, replicas=1, backend="lend_engine:LendRecordingEngine") as s:
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            import threading

            out: list = []
            t = threading.Thread(target=lambda: out.extend(client.generate("1+2=", n=2, params=params)))
            t.start()
            deadline = time.monotonic() + 30
            while log.read_text().count("add") < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            # the pool lends; the engine still runs the request: release comes after its sequences end
            s.call(s.server.pool.lend("trainer", 60, 60))
            t.join(30)
            assert len(out) == 2 and all(len(c.token_ids) == 40 for c in out)
            assert log.read_text().split() == ["add", "release"]
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=4)
            assert len(client.generate("2+2=", n=1, params=params)) == 1  # resumed first, then added
            assert log.read_text().split() == ["add", "release", "resume", "add"]


def test_the_trainer_keeps_its_loan_alive_past_the_lease_and_gives_it_back(model_dir) -> None:
    from tlt.services.trainer.colocate import DeviceLoan

    with ServerThread(model_dir, replicas=1) as s, RolloutClient(s.grpc_address) as client:
        loan = DeviceLoan([client], lease_s=0.6)
        loan.borrow()
        assert loan.borrow() == 0.0 and loan.held  # borrowing what it holds starts nothing twice
        time.sleep(1.5)  # 2.5 leases: only the renewals keep it
        assert client.status().lent_to == "trainer"
        loan.give_back()
        assert client.status().lent_to == "" and not loan.held
        loan.give_back()  # idempotent


def test_a_colocated_trainer_lends_the_devices_for_each_update_only(random_model_dir, tmp_path) -> None:
    """tlt's trainer with lend_rollout_devices: each step's old-logprob pass and update run while the replica is
    LENT (a drafter worker stays off), and the rollouts and pushes never are."""
    import json
    import threading

    from test_trainer_loop import config

    from tlt.services.trainer.loop import train

    with ServerThread(random_model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*",
                      capacity_heartbeat_s=0.3) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        sub.snapshot()
        seen: list[tuple[int, int]] = []
        stop = threading.Event()

        def listen() -> None:
            while not stop.is_set():
                e = sub.recv(0.1)
                if e is not None and not e.heartbeat:
                    seen.append((e.replica_id, e.state))

        t = threading.Thread(target=listen)
        t.start()
        try:
            train(config(random_model_dir, s.grpc_address, tmp_path / "run", lend_rollout_devices=True))
            time.sleep(0.5)
        finally:
            stop.set()
            t.join()
        sub.close()
        with RolloutClient(s.grpc_address) as client:
            assert client.status().lent_to == ""
    states = _states_of(seen, 0)
    # per step: rollout BUSY -> IDLE -> LENT (update) -> IDLE -> BUSY (push) -> IDLE
    assert states.count(LENT) == 2, states
    for i, st in enumerate(states):
        if st == LENT:
            assert states[i - 2: i] == [BUSY, IDLE] and states[i + 1: i + 3] == [IDLE, BUSY], states
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(m["times"]["lend_s"] > 0 for m in lines)


def test_a_drafter_worker_stops_on_lent_and_trains_again_when_the_trainer_gives_back(tmp_path, model_dir, samples) -> None:
    """The drafter side of the lend: a real worker (thread) against the real coordinator and a real capacity
    publisher playing the replica (tests/drafter_helpers.py). LENT ends its window like BUSY, no window opens
    while the device stays LENT, and the next IDLE trains again."""
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], publish_margin=1e9)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    with running(worker, pub, coord):
        state(pub, 0, IDLE)
        time.sleep(1.5)  # trains
        lent = state(pub, 0, LENT)
        assert wait_for(lambda: len(coord.windows) == 1, 10)
        w = coord.windows[0]
        assert w.micro_steps > 0 and w.preempted, "no training on an IDLE replica, or LENT did not end it"
        assert w.busy_timestamp == lent.timestamp and w.released - lent.timestamp < 2.0
        time.sleep(1.5)  # LENT all along (heartbeats repeat it): no window opens
        assert len(coord.windows) == 1 and worker.windows == 1
        state(pub, 0, IDLE)  # given back
        time.sleep(1.5)
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 2, 10)
        assert coord.windows[1].micro_steps > 0, "no training after the devices came back"


def test_min_idle_s_keeps_a_worker_out_of_the_gap_before_the_lend(tmp_path, model_dir, samples) -> None:
    """Colocated, the replica is IDLE for a moment between the rollout's end and the trainer's lend; with
    `min_idle_s` no window opens in it (it would load the drafter onto the device the trainer starts on), and a
    longer idle period still trains."""
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], publish_margin=1e9, min_idle_s=1.0)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    with running(worker, pub, coord):
        for _ in range(3):  # rollout ends, the lend follows 0.4 s later: three steps' worth
            state(pub, 0, IDLE)
            time.sleep(0.4)
            state(pub, 0, LENT)
            time.sleep(0.3)
            state(pub, 0, BUSY)
        assert worker.windows == 0 and not coord.windows
        state(pub, 0, IDLE)  # a real idle period
        time.sleep(2.5)
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 10) and coord.windows[0].micro_steps > 0


def test_a_refused_lend_fails_the_trainer_clearly_and_leaves_nothing_lent(model_dir) -> None:
    from tlt.services.trainer.colocate import DeviceLoan, LendError

    with ServerThread(model_dir, replicas=1, control_token="s3cret") as s:
        with RolloutClient(s.grpc_address) as anon, RolloutClient(s.grpc_address, control_token="s3cret") as ok:
            loan = DeviceLoan([ok, anon], lease_s=30)  # the first server lends, the second refuses
            with pytest.raises(LendError, match="UNAUTHENTICATED"):
                loan.borrow()
            assert not loan.held and ok.status().lent_to == ""  # the one already lent was given back


def test_a_replica_restarted_during_a_lend_comes_back_lent_and_released(model_dir, tmp_path, monkeypatch) -> None:
    """kill -9 of a replica while the trainer has the devices: the pool's restart replays the lend, so the new
    process frees its share too (`release` in its log) and says LENT, not IDLE, until the trainer gives back."""
    import os
    import signal

    log = tmp_path / "lend.log"
    log.write_text("")
    monkeypatch.setenv("TLT_TEST_LEND_LOG", str(log))
    with ServerThread(model_dir, replicas=1, backend="lend_engine:LendRecordingEngine", max_restarts=1,
                      capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.3) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        sub.snapshot()
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            client.lend_devices(True, lease_s=120)
            assert log.read_text().split() == ["release"]
            old = s.server.replica_pids()[0]
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                st = client.status()
                if st.replicas[0].alive and s.server.replica_pids()[0] != old:
                    break
                time.sleep(0.2)
            assert st.replicas[0].alive and st.replicas[0].state == LENT and st.lent_to == "trainer"
            seen = _changes(sub, lambda c: bool(c) and c[-1] == (0, LENT))
            assert seen and seen[-1] == (0, LENT) and (0, IDLE) not in seen, seen  # DRAINING, then LENT
            assert log.read_text().split() == ["release", "release"]  # the new process released its share
            client.lend_devices(False)
            assert log.read_text().split() == ["release", "release", "resume"]
            assert _changes(sub, lambda c: bool(c) and c[-1] == (0, IDLE))[-1] == (0, IDLE)
        sub.close()


def test_a_lend_waiting_for_sequences_that_are_aborted_is_answered(tmp_path) -> None:
    """A lend that arrives while the engine decodes waits for its sequences to end; the replica loop released it
    only after an engine step. Sequences that leave by an abort end no step (the trainer cancels a rollout's
    stragglers, then borrows the devices), so the lend was never answered and LendDevices timed out after
    update_timeout_s. The real replica loop and native engine, in a thread, over a real pipe."""
    import threading
    from multiprocessing import Pipe

    from rollout_helpers import ENGINE_TEST_SETTINGS, tiny_checkpoint
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.ipc import AbortRequest, AddRequest, Lend, Reply, Shutdown, StepEvents
    from tlt.services.rollout.replica import ReplicaLoop
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    engine = LLMEngine(tiny_checkpoint(tmp_path), EngineConfig(**ENGINE_TEST_SETTINGS))
    front, back = Pipe(duplex=True)
    loop = threading.Thread(target=ReplicaLoop(engine, back, 0).run, daemon=True)
    loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        front.send(AddRequest(GenerationRequest("r", (1, 2, 3), params, n=8)))
        while not isinstance(front.recv(), StepEvents):  # it is decoding
            pass
        front.send(Lend(7, True))  # the trainer borrows the devices: the lend waits for the sequences
        front.send(AbortRequest("r", 8))  # the rollout's stragglers are cancelled
        answered, deadline = False, time.monotonic() + 10
        while not answered and time.monotonic() < deadline:
            if front.poll(0.1):
                ev = front.recv()
                answered = isinstance(ev, Reply) and ev.cmd_id == 7 and not ev.error
        assert answered and not engine.has_unfinished()
    finally:
        front.send(Shutdown())
        loop.join(10)


def test_a_replica_restarted_during_a_lend_that_ends_meanwhile_comes_back_resumed(model_dir, tmp_path,
                                                                                   monkeypatch) -> None:
    """A replica restarted while the devices are lent is told to release before it serves. When the trainer gave
    the devices back while that release ran, the take-back reached only the live replicas, not this one: it came
    back released while the pool said nothing was lent, and every request routed to it was refused ("released:
    resume first"). The release here takes 1.5 s, as SGLang's KV-cache release is not instant."""
    import asyncio
    import os
    import signal

    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    log = tmp_path / "lend.log"
    log.write_text("")
    monkeypatch.setenv("TLT_TEST_LEND_LOG", str(log))
    monkeypatch.setenv("TLT_TEST_RELEASE_S", "1.5")

    async def scenario(pool) -> list:
        await pool.lend("trainer", 120, 30)
        os.kill(pool.replicas[0].process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while log.read_text().split().count("release-start") < 2:  # the restarted replica is releasing
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.02)
        assert not pool.replicas[0].alive
        await pool.take_back(30)  # the trainer gives the devices back now
        while not pool.replicas[0].alive:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        req = GenerationRequest("after", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=4))
        return [c async for c in pool.generate(req)]

    with ServerThread(model_dir, replicas=1, backend="lend_engine:LendRecordingEngine", max_restarts=1) as s:
        outs = s.call(scenario(s.server.pool), timeout=150)
        assert len(outs) == 1 and s.server.pool.lent_to == ""
        assert log.read_text().split()[-3:] == ["release", "resume", "add"]


def _resumed_when_idle(sub, log, pids: list[int], timeout_s: float = 20.0) -> dict[int, int]:  # noqa: ANN001
    """Replica -> how many resumes it had logged when its first IDLE since now arrived (all replicas of `pids`)."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(seen) < len(pids):
        e = sub.recv(0.1)
        if e is not None and not e.heartbeat and e.state == IDLE and e.replica_id not in seen:
            seen[e.replica_id] = log.read_text().split().count(f"resumed-{pids[e.replica_id]}")
    return seen


def test_a_replica_taken_back_by_work_or_a_lapse_says_idle_only_once_it_has_resumed(model_dir, tmp_path,
                                                                                    monkeypatch) -> None:
    """IDLE lets a drafter worker load onto the device: a replica must have its memory back (SGLang: its KV cache)
    first. LendDevices(false) waited for the resumes; new work and a lapsed lease published IDLE at once and only
    then queued the resumes, so a worker could start on a device SGLang was re-allocating."""
    import threading

    log = tmp_path / "lend.log"
    log.write_text("")
    monkeypatch.setenv("TLT_TEST_LEND_LOG", str(log))  # inherited by the spawned replicas
    monkeypatch.setenv("TLT_TEST_RESUME_S", "0.5")
    with _server(model_dir, backend="test_colocated_lend:SlowResumeEngine") as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        sub.snapshot()
        pids = s.server.replica_pids()
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            client.lend_devices(True, lease_s=60)
            _changes(sub, lambda c: _last(c) == {0: LENT, 1: LENT})
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=2)
            request = threading.Thread(target=client.generate, args=("1+2=",), kwargs={"n": 1, "params": params})
            request.start()  # takes the devices back: both replicas resume (events read meanwhile)
            assert _resumed_when_idle(sub, log, pids) == {0: 1, 1: 1}, log.read_text()
            request.join(30)
            client.lend_devices(True, lease_s=0.5)  # the borrower goes quiet: the lease lapses
            assert _resumed_when_idle(sub, log, pids) == {0: 2, 1: 2}, log.read_text()
            assert client.status().lent_to == ""
        sub.close()


def test_the_lease_runs_from_the_release_not_from_the_grant(model_dir, tmp_path, monkeypatch) -> None:
    """LendDevices waits for the replicas' release (SGLang's: seconds); a lease clocked from the grant lapsed inside
    the very call that granted it when the release took longer, and the trainer got lent=False back."""
    log = tmp_path / "lend.log"
    log.write_text("")
    monkeypatch.setenv("TLT_TEST_LEND_LOG", str(log))
    monkeypatch.setenv("TLT_TEST_RELEASE_S", "1.5")
    with ServerThread(model_dir, replicas=1, backend="lend_engine:LendRecordingEngine") as s:
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            r = client.lend_devices(True, lease_s=1.0)
            assert r.lent and 0.5 < r.expires_in_s <= 1.0, r
            assert client.status().lent_to == "trainer"
            deadline = time.monotonic() + 10
            while client.status().lent_to and time.monotonic() < deadline:  # and it still lapses by itself
                time.sleep(0.1)
            assert client.status().lent_to == "" and log.read_text().split() == ["release-start", "release", "resume"]


def test_borrow_does_not_report_a_loan_the_rollout_took_back_before_answering(model_dir, tmp_path,
                                                                               monkeypatch) -> None:
    """A request that reaches the rollout while its replicas release takes the devices back: LendDevices answers
    lent=False. The trainer used to ignore that and compute on devices the drafter workers were told are IDLE.
    It lends once more; a lend taken back twice is a LendError."""
    import threading

    from tlt.services.trainer.colocate import DeviceLoan, LendError

    log = tmp_path / "lend.log"
    log.write_text("")
    monkeypatch.setenv("TLT_TEST_LEND_LOG", str(log))
    monkeypatch.setenv("TLT_TEST_RELEASE_S", "1.0")

    def interfere(address: str, times: int) -> threading.Thread:
        """Send a request each time a replica starts releasing, `times` times (another client of the rollout)."""
        def run() -> None:
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=2)
            with RolloutClient(address, timeout_s=60) as other:
                for n in range(1, times + 1):
                    deadline = time.monotonic() + 30
                    while log.read_text().split().count("release-start") < n and time.monotonic() < deadline:
                        time.sleep(0.01)
                    other.generate("1+2=", n=1, params=params)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    with ServerThread(model_dir, replicas=1, backend="lend_engine:LendRecordingEngine") as s:
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            loan = DeviceLoan([client], lease_s=30)
            t = interfere(s.grpc_address, 2)
            with pytest.raises(LendError, match="took the devices back"):
                loan.borrow()
            t.join(30)
            assert not loan.held and client.status().lent_to == ""
            log.write_text("")
            t = interfere(s.grpc_address, 1)
            loan.borrow()  # taken back once: lent on the second try
            t.join(30)
            assert loan.held and client.status().lent_to == "trainer"
            loan.give_back()


def test_a_lease_every_rollout_server_refuses_is_refused_by_the_config() -> None:
    """The servers refuse lease_s outside (0, MAX_LEASE_S] (inf included); the trainer's config took any positive
    value and the run failed with a LendError only after its whole first rollout."""
    from tlt.services.rollout.grpc_api import MAX_LEASE_S
    from tlt.services.trainer.config import TrainerConfig

    for bad in (MAX_LEASE_S + 1, float("inf"), float("nan"), 0.0):  # the servers' bound, exactly
        with pytest.raises(ValueError, match="lend_lease_s"):
            TrainerConfig(lend_rollout_devices=True, lend_lease_s=bad)
    assert TrainerConfig(lend_rollout_devices=True, lend_lease_s=MAX_LEASE_S).lend_lease_s == MAX_LEASE_S


def test_the_deploy_guide_says_the_trainer_drives_the_sglang_release() -> None:
    """docs/DEPLOY.md's SGLang notes said nothing triggered release/resume around the trainer's update, while
    train() borrows the devices around each update whenever [trainer] lend_rollout_devices is on (1gpu sets it)."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    preset = tomllib.loads((root / "deploy" / "configs" / "1gpu.toml").read_text())
    assert preset["trainer"]["lend_rollout_devices"] is True
    guide = re.sub(r"\s+", " ", (root / "docs" / "DEPLOY.md").read_text())
    bullet = guide[guide.index("- Colocated memory release"):].split(" - ", 1)[0]
    assert "Nothing triggers release/resume" not in bullet, bullet
    assert "grpo_step" in bullet and "`[trainer] lend_rollout_devices`" in bullet, bullet


def test_a_give_back_that_does_not_reach_a_rollout_server_is_an_error_naming_it() -> None:
    """A rollout server that cannot be told to take its devices back (down, unreachable) keeps its replicas lent
    until the lease lapses: the trainer is told, with the server's address, rather than pushing weights and starting
    the next rollout as if the replicas had resumed."""
    from tlt.services.trainer.colocate import DeviceLoan, LendError

    from tlt.services.common.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    with RolloutClient(address, timeout_s=2) as client:
        with pytest.raises(LendError, match=f"did not take their devices back: {address}: UNAVAILABLE"):
            DeviceLoan([client], lease_s=30).give_back()
