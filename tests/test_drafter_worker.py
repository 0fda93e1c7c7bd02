"""The elastic drafter workers without the rollout server: a real CapacityPublisher (ZeroMQ on 127.0.0.1)
plays the rollout's replicas, real workers (threads here, a `tlt drafter worker` process for kill -9) train
on real target features of a tiny random Qwen2 (transformers forward, post-norm last layer) against the real
coordinator (ROUTER, buffer, gating), all from tests/drafter_helpers.py. The rollout's UpdateWeights is
replaced by a recording function (the integration test uses the real server). Stand-in, not the real thing:
`StubbedWorker` replaces a real worker's coordinator and capacity feed by in-process stubs so that BUSY lands
at an exact micro-step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from drafter_helpers import BUSY, IDLE, StubbedWorker, make, model_dir, running, samples, state, wait_for  # noqa: F401
from tlt.services.common.events import CapacityPublisher
from tlt.services.drafter.training import load_state
from tlt.services.drafter.worker import DrafterWorker
from tlt.v1 import common_pb2, events_pb2


def test_trains_only_while_idle_is_preempted_and_publishes(tmp_path, model_dir, samples) -> None:
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes)
    workers = [DrafterWorker(cfg, str(model_dir), i, i, coord.endpoint) for i in (0, 1)]
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        assert coord.candidate_version == 0 and not coord.windows  # both replicas busy: nothing trains
        log = []
        for cycle in range(3):
            for r in (0, 1):
                log.append(state(pub, r, IDLE))
            time.sleep(1.5)
            for r in (0, 1):
                log.append(state(pub, r, BUSY))
            deadline = time.monotonic() + 10
            while len(coord.windows) < 2 * (cycle + 1) and time.monotonic() < deadline:
                time.sleep(0.05)
        wins = list(coord.windows)
        assert len(wins) == 6 and all(w.preempted and w.micro_steps > 0 for w in wins)
        for w in wins:  # each window lies inside an IDLE interval of its replica and ends after BUSY
            idle = [e.timestamp for e in log if e.replica_id == w.replica_id and e.state == IDLE and e.timestamp <= w.start]
            busy = [e.timestamp for e in log if e.replica_id == w.replica_id and e.state == BUSY and e.timestamp > idle[-1]]
            assert w.busy_timestamp == busy[0] and w.released >= busy[0]
            assert w.released - w.busy_timestamp < 2.0
        assert coord.preemptions == 6 and coord.candidate_version > 0
        for r in (0, 1):  # the coordinator evaluates and publishes while the whole rollout is idle
            state(pub, r, IDLE)
        deadline = time.monotonic() + 20
        while not pushes and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pushes, [(a.candidate_accept_len, a.serving_accept_len) for a in coord.acceptance]
        names, version = pushes[0]
        assert all(not ("embed" in n or "lm_head" in n) for n in names) and version > 0
        rec = [a for a in coord.acceptance if a.published][0]
        assert rec.candidate_accept_len > rec.serving_accept_len
        st = coord.status()
        assert st.serving_version == pushes[-1][1] and st.preemptions == 6 and len(st.workers) == 2
        text = coord.metrics.render().decode()
        assert "drafter_preemptions_total 6.0" in text and "drafter_release_seconds_count 6.0" in text
    finally:
        stop.set()
        for r in (0, 1):
            state(pub, r, BUSY)
        for t in threads:
            t.join(20)
        for w in workers:
            w.close()
        coord.close()
        pub.close()


def test_kill_minus_9_worker_resumes_from_its_checkpoint(tmp_path, model_dir, samples) -> None:
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, submit_every=3)
    cmd = [sys.executable, "-m", "tlt.cli", "drafter", "worker", "--model", str(model_dir), "--coordinator",
           coord.endpoint, "--replica", "0", "--config-json", cfg.model_dump_json()]
    ckpt = tmp_path / "ckpt" / "worker-0.pt"
    proc = subprocess.Popen(cmd)
    try:
        state(pub, 0, IDLE)
        deadline = time.monotonic() + 90
        while (load_state(ckpt) or {}).get("micro_steps", 0) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)  # mid-window, possibly mid-step
        proc.wait(10)
        saved = load_state(ckpt)
        assert saved["micro_steps"] >= 6 and saved["optimizer"]["state"]
        version = coord.candidate_version
        assert version == coord.deltas and version >= 2  # only whole deltas were applied
        assert coord.status().candidate_version == version  # the coordinator keeps answering
        proc = subprocess.Popen(cmd)  # restart: continues from the checkpoint
        deadline = time.monotonic() + 90
        while (load_state(ckpt) or {}).get("micro_steps", 0) <= saved["micro_steps"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert load_state(ckpt)["micro_steps"] > saved["micro_steps"]
        state(pub, 0, BUSY)
        deadline = time.monotonic() + 20
        while not coord.windows and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.windows and coord.windows[-1].preempted
        assert coord.candidate_version == coord.deltas > version
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)
        coord.close()
        pub.close()


def test_rollout_idle_workers_train_only_while_every_replica_is_idle(tmp_path, model_dir, samples) -> None:
    """train_when = rollout_idle (CPU replicas sharing caches): worker 0 waits while replica 1 still decodes
    although its own replica is idle, and replica 1 turning busy ends its window."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, train_when="rollout_idle")
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        state(pub, 0, IDLE)  # its own replica is done, replica 1 decodes
        time.sleep(1.5)
        assert not coord.windows and worker.total_steps == 0
        state(pub, 1, IDLE)
        deadline = time.monotonic() + 10
        while worker.total_steps == 0 and not coord.windows and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        busy = state(pub, 1, BUSY)  # the OTHER replica's rollout starts: the window ends
        deadline = time.monotonic() + 10
        while not coord.windows and time.monotonic() < deadline:
            time.sleep(0.05)
        (w,) = coord.windows
        assert w.preempted and w.micro_steps > 0 and w.busy_timestamp == busy.timestamp
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


@pytest.mark.parametrize("train_when", ["rollout_idle", "replica_idle"])
def test_a_worker_trains_again_after_the_rollout_restarts(tmp_path, model_dir, samples, train_when) -> None:
    """The rollout server restarts on the same endpoints under a new server_id (`rollout-<pid>`) after its
    replicas went DRAINING. A rollout_idle worker kept the dead server's DRAINING states for good and never
    trained again; they must stop counting once stale (as in RolloutIdle). The per-replica mode follows the
    new server's state of its replica. Real publishers on 127.0.0.1, a real coordinator and worker."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, server_id="rollout-111", train_when=train_when,
                           eval_interval_s=1e9)
    pub_ep, snap_ep = pub.pub_endpoint, pub.snapshot_endpoint
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.stale_s = 1.0  # heartbeats every 0.2 s here
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    new = None
    try:
        for r in (0, 1):
            state(pub, r, IDLE)
        assert wait_for(lambda: coord.candidate_version > 0, 20)  # a first delta: it trains
        for r in (0, 1):
            state(pub, r, common_pb2.REPLICA_STATE_DRAINING)  # shutting down
        assert wait_for(lambda: len(coord.windows) == 1, 10) and coord.windows[0].preempted
        pub.close()
        version = coord.candidate_version
        new = CapacityPublisher(pub_ep, snap_ep, server_id="rollout-222", heartbeat_s=0.2)  # the restart
        for r in (0, 1):
            state(new, r, IDLE)
        # trains again, as before the restart: the deferred delta (if any) and at least one new one arrive
        assert wait_for(lambda: coord.candidate_version >= version + 2, 15), (worker.state, worker._states)
        for r in (0, 1):
            state(new, r, BUSY)
        assert wait_for(lambda: len(coord.windows) == 2, 20)
        assert coord.windows[1].micro_steps > 0 and thread.is_alive()
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        coord.close()
        (new or pub).close()


def test_a_worker_survives_a_batch_the_coordinator_cannot_build(tmp_path, model_dir, samples) -> None:
    """The coordinator answers a batch request with an error (here: two windows of different widths in the
    buffer, put there directly, as ingest now refuses them); the worker logs it, skips the batch and keeps
    going, instead of dying with every other worker that draws the same data. Real coordinator and worker
    over ZeroMQ on 127.0.0.1."""
    import dataclasses

    import numpy as np

    from tlt.services.drafter.packing import Sample

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, eval_interval_s=1e9)
    h = coord.drafter_cfg.hidden_size
    poison = [Sample(f"p{w}", np.arange(5, 13, dtype=np.int32), np.zeros((8, w), np.float16), 1, 99)
              for w in (h, h + 1)]
    coord.buffer.add_samples(poison)  # the newest version: drawn first, and pack() cannot join them
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        state(pub, 0, IDLE)
        assert wait_for(lambda: 0 in coord.workers and coord.workers[0].training, 10)  # it asked for a batch
        time.sleep(1.0)  # several refused batches
        assert thread.is_alive() and coord.candidate_version == 0
        coord.buffer.add_samples([dataclasses.replace(s, policy_version=100) for s in samples[3:]])  # newer data
        assert wait_for(lambda: coord.candidate_version > 0, 20)  # it trains on it
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20)
        assert coord.windows[0].micro_steps > 0 and thread.is_alive()
    finally:
        stop.set()
        state(pub, 0, BUSY)
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


def test_window_max_steps_trains_a_budget_per_idle_period(tmp_path, model_dir, samples) -> None:
    """A worker with window_max_steps = 4 trains 4 micro-steps in an idle period, sends them at once (the
    replica is still idle), and trains again only after its replica has been busy and idle again."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, window_max_steps=4, eval_interval_s=1e9)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    with running(worker, pub, coord):
        time.sleep(0.5)
        state(pub, 0, IDLE)
        deadline = time.monotonic() + 20
        while not coord.windows and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # an idle period long enough for many more steps (heartbeats say IDLE meanwhile)
        wins = list(coord.windows)
        assert len(wins) == 1 and wins[0].micro_steps == 4 and not wins[0].preempted, wins
        assert coord.candidate_version == 1  # the 4 steps were sent without waiting for the next window
        state(pub, 0, BUSY)
        time.sleep(0.3)
        state(pub, 0, IDLE)  # a new idle period: a new budget
        deadline = time.monotonic() + 20
        while len(coord.windows) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        wins = list(coord.windows)
        assert len(wins) == 2 and wins[1].micro_steps == 4 and coord.candidate_version == 2, wins


def test_optimizer_state_carries_over_preempted_windows(tmp_path, model_dir) -> None:
    """A preempted window defers its optimizer checkpoint to the next idle window; that window must train
    with it (Adam's moments and step count continue), not with the checkpoint from before the last window.
    A stub coordinator and event feed drive two windows of 3 and 2 micro-steps, preempted by BUSY."""
    stub = StubbedWorker(tmp_path, model_dir)
    worker = stub.worker
    for steps in (3, 2):
        worker.state, stub.busy_after = IDLE, steps
        res = worker.window()
        assert res.preempted and res.micro_steps == steps
    worker._flush()
    saved = load_state(worker.ckpt)
    assert saved["micro_steps"] == 5
    assert {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {5}


def test_busy_during_a_step_defers_the_due_submission(tmp_path, model_dir, monkeypatch) -> None:
    """BUSY arriving during the micro-step after which a submission is due: the worker stops there and
    defers the delta, checkpoint and re-pull (seconds of serialisation and disk on a real drafter) to its
    next idle window, as for any preemption, instead of doing them on the busy replica's time."""
    import tlt.services.drafter.worker as worker_mod

    stub = StubbedWorker(tmp_path, model_dir, submit_every=3)
    real, steps = worker_mod.micro_step, []

    def step(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = real(*a, **k)
        steps.append(1)
        if len(steps) == 3:  # the replica turns busy while the 3rd step runs
            stub.busy()
        return out

    monkeypatch.setattr(worker_mod, "micro_step", step)
    stub.worker.state, stub.busy_after = IDLE, 10**6
    res = stub.worker.window()
    assert res.preempted and res.micro_steps == 3
    assert stub.asks == ["pull", "batch_request", "batch_request", "batch_request", "window"], stub.asks
    assert stub.worker._deferred is not None and stub.worker._deferred.steps == 3
    stub.worker._flush()  # the next idle moment sends all three steps
    assert stub.asks[-1] == "update" and stub.version == 1


@pytest.mark.parametrize("train_when", ["replica_idle", "rollout_idle"])
def test_a_silent_capacity_feed_stops_training(tmp_path, model_dir, samples, train_when) -> None:
    """The rollout's capacity feed goes silent while its replicas were IDLE (the server froze, was SIGSTOPped or
    lost its network path): the worker kept its last IDLE and trained on, for good, on a device that may be
    busy. An IDLE not heard again (heartbeat or event) for `stale_s` must end the window within a micro-step,
    as a BUSY event does, and no window may open until the feed speaks again; then it trains again. Real
    CapacityPublisher (closed to silence it, then a new one on the same endpoints), coordinator and worker."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, train_when=train_when, eval_interval_s=1e9)
    pub_ep, snap_ep = pub.pub_endpoint, pub.snapshot_endpoint
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.stale_s = 1.0  # heartbeats every 0.2 s here
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    new = None
    try:
        for r in (0, 1):
            state(pub, r, IDLE)
        assert wait_for(lambda: 0 in coord.workers and coord.workers[0].training, 20)  # it trains
        silent_at = time.time()
        pub.close()  # no more heartbeats; the last state heard was IDLE
        assert wait_for(lambda: len(coord.windows) == 1, 10), "the worker trains on with a silent capacity feed"
        (w,) = coord.windows
        assert w.preempted and w.micro_steps > 0 and silent_at < w.busy_timestamp <= w.released
        assert w.released - w.busy_timestamp < 2.0
        time.sleep(1.0)  # still silent: no new window
        assert len(coord.windows) == 1 and not coord.workers[0].training
        new = CapacityPublisher(pub_ep, snap_ep, heartbeat_s=0.2)  # the feed is back
        for r in (0, 1):
            state(new, r, IDLE)
        assert wait_for(lambda: coord.workers[0].training, 20)  # trains again
        for r in (0, 1):
            state(new, r, BUSY)
        assert wait_for(lambda: len(coord.windows) == 2, 20)
        assert coord.windows[1].micro_steps > 0 and thread.is_alive()
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        coord.close()
        (new or pub).close()


def _log_reader(capfd):  # noqa: ANN001, ANN202
    """log_has(text): whether `text` was logged since the test began (capfd's reads, accumulated)."""
    logged: list[str] = []

    def log_has(text: str) -> bool:
        out = capfd.readouterr()
        logged.append(out.err + out.out)
        return text in "".join(logged)

    return log_has


def test_a_refused_delta_is_dropped_and_the_worker_trains_on(tmp_path, model_dir, samples, capfd) -> None:
    """The coordinator refuses a delta it cannot apply (here: non-finite, as from a diverged step; real
    training on features made non-finite by `feature_noise = inf`). The CoordinatorRefused ended the worker's
    run() and, as a `tlt drafter worker` process, the worker for good. It must log the refusal, drop the delta
    together with the optimizer state that produced it (back to its last checkpoint) and train on: once the
    features are sane again its next delta is taken. Real coordinator, worker and publisher on 127.0.0.1."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, submit_every=2, eval_interval_s=1e9)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.cfg = cfg.model_copy(update={"feature_noise": float("inf")})  # every step yields non-finite weights
    log_has = _log_reader(capfd)
    with running(worker, pub, coord) as thread:
        state(pub, 0, IDLE)
        assert wait_for(lambda: log_has("non-finite values"), 30), "the coordinator never refused a delta"
        time.sleep(0.5)
        assert thread.is_alive(), "a refused delta ended the worker's run()"
        assert log_has("delta_refused") and coord.candidate_version == 0
        st = coord.status()  # the operator sees it: status (total and per worker) and /metrics
        assert st.deltas_refused >= 1 and st.workers[0].deltas_refused >= 1  # (the worker may refuse more meanwhile)
        import re

        metric = re.search(r"^drafter_deltas_refused_total (\S+)$", coord.metrics.render().decode(), re.M)
        assert metric is not None and float(metric.group(1)) >= st.deltas_refused
        worker.cfg = cfg  # sane features again
        assert wait_for(lambda: coord.candidate_version > 0, 30)  # the next delta is taken
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20)
        assert coord.windows[0].micro_steps > 0 and thread.is_alive()


def test_a_refused_deferred_delta_is_dropped_and_the_worker_trains_on(tmp_path, model_dir, samples, capfd) -> None:
    """As above for a preempted window's delta, sent at the start of the next idle window (`_flush`): the
    refusal ended that window and run(). It must be dropped with its optimizer state (the next window starts
    from the last checkpoint, here none: a fresh optimizer) and the window train on; the next window's
    deferred delta, made from sane features, is taken."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, submit_every=1000, eval_interval_s=1e9)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.cfg = cfg.model_copy(update={"feature_noise": float("inf")})  # every step yields non-finite weights
    log_has = _log_reader(capfd)
    with running(worker, pub, coord) as thread:
        state(pub, 0, IDLE)
        assert wait_for(lambda: 0 in coord.workers and coord.workers[0].training, 20)
        time.sleep(0.5)
        state(pub, 0, BUSY)  # preempted: its non-finite delta waits for the next idle window
        assert wait_for(lambda: len(coord.windows) == 1, 20) and coord.windows[0].micro_steps > 0
        assert not log_has("non-finite values")  # not sent yet
        worker.cfg = cfg  # sane features again
        state(pub, 0, IDLE)  # the next window sends it first: refused
        assert wait_for(lambda: log_has("non-finite values"), 20), "the coordinator never refused the delta"
        assert wait_for(lambda: coord.workers[0].training, 10), "a refused deferred delta ended the window"
        time.sleep(0.5)
        assert thread.is_alive() and log_has("delta_refused") and coord.candidate_version == 0
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 2, 20) and coord.windows[1].micro_steps > 0
        state(pub, 0, IDLE)  # the second window's delta is sent now, and taken
        assert wait_for(lambda: coord.candidate_version == 1, 20)


def test_a_delta_resent_after_a_lost_answer_is_applied_once(tmp_path, model_dir, samples) -> None:
    """A deferred delta whose answer does not come within the worker's timeout (a slow coordinator; here its
    lock is held longer than the timeout, as a long save or evaluation could) is kept and sent again at the
    next idle moment, but the coordinator had applied it: the candidate moved by the same change twice. The
    resend must answer with the version the first send made and change nothing; the worker's next, different
    delta is applied. Real coordinator and worker over ZeroMQ on 127.0.0.1."""
    import torch

    from tlt.services.drafter.coordinator import Coordinator, tensors_message
    from tlt.services.drafter.training import own_tensors
    from tlt.services.drafter.worker import CoordinatorUnavailable, _Deferred
    from tlt.v1 import drafter_pb2

    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, pin_cpus=False)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.client.timeout_s = 0.5
    try:
        base = own_tensors(coord.candidate)
        worker._deferred = _Deferred({k: v + 0.01 for k, v in base.items()}, base, 0, 5, [1.0], {})

        def slow() -> None:
            with coord._lock:
                time.sleep(1.5)

        holder = threading.Thread(target=slow)
        holder.start()
        time.sleep(0.1)
        with pytest.raises(CoordinatorUnavailable):
            worker._flush()
        holder.join()
        assert wait_for(lambda: coord.candidate_version == 1, 5)  # applied, after the worker gave up waiting
        assert worker._deferred is not None  # the worker cannot know: it sends it again
        worker._flush()
        assert worker._deferred is None and coord.candidate_version == 1 and coord.deltas == 1
        assert torch.allclose(coord.candidate.state_dict()["fc.weight"], base["fc.weight"] + 0.01)
        worker._deferred = _Deferred({k: v + 0.02 for k, v in base.items()}, base, 0, 5, [1.0], {})
        worker._flush()  # a new change from the same base: applied
        assert coord.candidate_version == 2
        assert torch.allclose(coord.candidate.state_dict()["fc.weight"], base["fc.weight"] + 0.03)
        coord.save_now()  # a coordinator restarted from its checkpoint knows it too
        again = Coordinator(cfg, str(model_dir), None, None)
        try:
            m, p = tensors_message({k: v + 0.02 - base[k] for k, v in base.items()}, 0)
            upd = drafter_pb2.DeltaUpdate(base_version=0, manifest=m, payload=p, micro_steps=5)
            assert again.apply_delta(upd, 0) == 2 and again.candidate_version == 2
        finally:  # never started: only its socket to close
            again._router.close()
            again._ctx.term()
    finally:
        worker.close()
        coord.close()
        pub.close()


def test_a_worker_waits_for_a_capacity_snapshot_instead_of_exiting(tmp_path, model_dir, samples) -> None:
    """The worker's first act is a snapshot of every replica's state. A snapshot socket that answers garbage
    (a buggy peer) or not at all within 30 s (a rollout slower to start than the worker, or restarting) raised
    out of run(): a `tlt drafter worker` process exited for good and nothing restarts it. It must ask again
    until the rollout answers and then train as usual. Real ZeroMQ on 127.0.0.1: a raw REP socket answers
    garbage once, then the real CapacityPublisher comes up on the same endpoints."""
    import zmq

    from tlt.services.common.ports import free_port

    snap, capp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, capacity_pub=capp,
                           capacity_snapshot=snap, pin_cpus=False)
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(snap)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    rollout = None
    try:
        assert rep.poll(10_000), "the worker never asked for a snapshot"
        rep.recv()
        rep.send(b"\xff not an envelope")
        rep.close()
        time.sleep(0.5)
        assert thread.is_alive(), "a garbage snapshot answer ended the worker's run()"
        rollout = CapacityPublisher(capp, snap, heartbeat_s=0.2)
        state(rollout, 0, IDLE)
        assert wait_for(lambda: 0 in coord.workers and coord.workers[0].training, 30)
        state(rollout, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20) and coord.windows[0].micro_steps > 0
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        if rollout is not None:
            rollout.close()
        ctx.term()
        coord.close()
        pub.close()


def test_busy_during_a_delta_send_stops_before_the_checkpoint_and_the_pull(tmp_path, model_dir) -> None:
    """BUSY arriving while a window's due delta is being sent: the worker went on to write its optimizer
    checkpoint (twice the drafter's size: seconds on a real one) and to pull the whole candidate back, on the
    busy replica's time and with the drafter still on its device, before it looked at the events again. It
    must release the device right after the send and write the checkpoint at the next idle moment."""
    stub = StubbedWorker(tmp_path, model_dir, submit_every=2)
    real_ask = stub.ask

    def ask(**body):  # noqa: ANN003, ANN202
        reply = real_ask(**body)
        if "update" in body:
            stub.busy()  # the replica turns busy while the delta is on its way
        return reply

    stub.worker.client = type("Client", (), {"ask": staticmethod(ask), "shared_policy_version": 0,
                                             "shared_fetch_failures": 0})()
    stub.worker.state, stub.busy_after = IDLE, 10**6
    res = stub.worker.window()
    assert res.preempted and res.micro_steps == 2 and stub.version == 1
    assert stub.asks == ["pull", "batch_request", "batch_request", "update", "window"], stub.asks
    assert load_state(stub.worker.ckpt) is None  # not written on the busy replica's time
    assert stub.worker._deferred is not None and stub.worker._deferred.steps == 0  # only the checkpoint is due
    stub.worker._flush()  # the next idle moment
    saved = load_state(stub.worker.ckpt)
    assert saved["micro_steps"] == 2 and {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {2}
    assert stub.asks[-1] == "window" and stub.version == 1  # nothing sent twice


def test_a_worker_started_before_its_coordinator_waits_for_it(tmp_path, model_dir, samples) -> None:
    """A worker (re)started while its coordinator is down, e.g. being restarted after a kill -9, asks it hello
    first; no answer within the timeout raised out of run() and the `tlt drafter worker` process exited for good
    (nothing restarts it), although every later request of a worker waits for the coordinator and retries. It
    must ask again until the coordinator answers, then train. Real ZeroMQ on 127.0.0.1: the coordinator comes up
    on its endpoint after the worker has given up once."""
    from tlt.services.common.ports import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    cfg_kw = dict(capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint, coordinator_bind=endpoint,
                  checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=64, batch_tokens=64, batch_rows=2,
                  eval_interval_s=1e9, pin_cpus=False)
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator

    cfg = DrafterServiceConfig(**cfg_kw)
    state(pub, 0, BUSY)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, endpoint)
    worker.client.timeout_s = 0.5
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    coord = None
    try:
        time.sleep(2.0)  # several hellos unanswered
        assert thread.is_alive(), "an unanswered hello ended the worker's run()"
        coord = Coordinator(cfg, str(model_dir), None, None).start()
        coord.buffer.add_samples(samples)
        assert wait_for(lambda: 0 in coord.workers, 20)
        state(pub, 0, IDLE)
        assert wait_for(lambda: coord.workers[0].training, 20)
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20) and coord.windows[0].micro_steps > 0
    finally:
        stop.set()
        state(pub, 0, BUSY)
        thread.join(20)
        worker.close()
        if coord is not None:
            coord.close()
        pub.close()


def test_the_workers_of_a_killed_drafter_serve_exit_with_it(tmp_path, model_dir) -> None:
    """`tlt drafter serve` started its workers as plain children: killed with -9 (OOM killer, a crashed host
    process), it left them running, and the restarted service started a second worker for every replica, under
    the same ids and checkpoint files, training side by side on the same devices. A worker must exit with the
    process that started it (as services do with `tlt run`'s launcher); the restarted service starts new ones,
    which resume from the checkpoints. Real processes: `tlt drafter serve --workers 1`, killed by its pid."""
    import json

    from rollout_helpers import pid_gone

    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    state(pub, 0, BUSY)
    ready = tmp_path / "ready.json"
    sets = {"capacity_pub": pub.pub_endpoint, "capacity_snapshot": pub.snapshot_endpoint,
            "features_bind": "tcp://127.0.0.1:*", "coordinator_bind": "tcp://127.0.0.1:*", "status_port": 0,
            "checkpoint_dir": str(tmp_path / "ckpt"), "pin_cpus": False, "coordinator_nice": 0}
    cmd = [sys.executable, "-m", "tlt.cli", "drafter", "serve", "--model", str(model_dir), "--workers", "1",
           "--ready-file", str(ready)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    serve = subprocess.Popen(cmd)
    worker = 0
    try:
        assert wait_for(lambda: ready.exists() or serve.poll() is not None, 90) and ready.exists()
        worker = json.loads(ready.read_text())["worker_pids"][0]
        time.sleep(1.0)
        assert not pid_gone(worker)
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        assert wait_for(lambda: pid_gone(worker), 30), "a worker outlived its drafter service's kill -9"
    finally:
        if serve.poll() is None:
            serve.kill()
        if worker and not pid_gone(worker):
            os.kill(worker, signal.SIGKILL)
        pub.close()


def test_a_restarted_worker_trains_with_its_configured_optimizer_settings(tmp_path, model_dir, monkeypatch) -> None:
    """A worker restarted with a new lr or weight_decay (`tlt drafter worker --set lr=...`, e.g. lowered after its
    deltas were refused as non-finite) trained on with the old ones: `load_state_dict` of its optimizer checkpoint
    brings back the saved param groups' lr, weight_decay and betas too. The checkpoint's moments and step counts
    carry over; the settings are the config's."""
    import tlt.services.drafter.worker as worker_mod

    real, seen = worker_mod.micro_step, []

    def step(drafter, opt, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        g = opt.param_groups[0]
        seen.append((g["lr"], g["weight_decay"], tuple(g["betas"])))
        return real(drafter, opt, *a, **k)

    monkeypatch.setattr(worker_mod, "micro_step", step)
    first = StubbedWorker(tmp_path, model_dir, lr=3e-3, weight_decay=0.0)
    first.worker.state, first.busy_after = IDLE, 2
    first.worker.window()
    first.worker._flush()
    again = StubbedWorker(tmp_path, model_dir, lr=3e-5, weight_decay=0.1)  # the restart, with new settings
    seen.clear()
    again.worker.state, again.busy_after = IDLE, 2
    again.worker.window()
    again.worker._flush()
    assert seen == [(3e-5, 0.1, (0.9, 0.95))] * 2, seen
    saved = load_state(again.worker.ckpt)
    assert {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {4}  # Adam's state went on


def test_busy_during_the_shared_fetch_keeps_the_deferred_delta_for_later(tmp_path, model_dir) -> None:
    """A window opens by fetching a newer policy's embedding / lm_head (GetWeights: seconds on a real model), then
    sends what the last window deferred. A BUSY that came during the fetch was only looked at after the send, which
    ran on the busy replica's time. The window ends before the send, the delta still deferred; the next idle moment
    sends it. The fetch is a stand-in that queues the BUSY as the rollout would."""
    from tlt.services.drafter.shared import SharedTensors

    stub = StubbedWorker(tmp_path, model_dir)
    worker = stub.worker
    worker.state, stub.busy_after = IDLE, 2
    worker.window()  # 2 steps, preempted: delta and checkpoint deferred
    assert worker._deferred is not None and worker._deferred.steps == 2
    stub.asks.clear()

    def fetch() -> SharedTensors:
        stub.busy()  # the replica turns busy while the tensors come
        cur = worker.shared.current
        return SharedTensors(1, cur.embed.clone(), cur.lm_head.clone())

    worker.shared.fetch = fetch
    worker.shared.see(1)  # the capacity events said the rollout serves policy 1
    worker.state, stub.busy_after = IDLE, 10**6
    res = worker.window()
    assert res.preempted and res.micro_steps == 0 and stub.asks == ["window"], stub.asks
    assert worker.shared.current.policy_version == 1 and worker._deferred.steps == 2
    assert load_state(worker.ckpt) is None  # nor was the checkpoint written
    worker._flush()  # the next idle moment
    assert stub.asks[-1] == "update" and stub.version == 1 and load_state(worker.ckpt)["micro_steps"] == 2


def test_a_worker_checkpoint_of_another_model_is_named_in_the_error(tmp_path, model_dir) -> None:
    """A worker-<id>.pt written for another model (checkpoint_dir shared between models) failed at the first
    micro-step of the first idle window with "The size of tensor a (128) must match the size of tensor b (64)",
    a traceback that ended the worker's process. The worker refuses it when it starts, with a DrafterError (one
    line, exit 2 from the CLI) that names the file and says to give [drafter] checkpoint_dir another folder."""
    from tlt.model.drafter import DrafterError
    from tlt.model.testing import random_checkpoint

    first = StubbedWorker(tmp_path, model_dir)
    first.worker.state, first.busy_after = IDLE, 2
    first.worker.window()
    first.worker._flush()
    other = random_checkpoint(tmp_path / "other", hidden_size=32, intermediate_size=64)
    with pytest.raises(DrafterError) as err:
        StubbedWorker(tmp_path, other)
    msg = str(err.value)
    assert str(first.worker.ckpt) in msg and "checkpoint_dir" in msg and "\n" not in msg, msg


def test_a_worker_whose_replica_stays_busy_is_still_reported_alive(tmp_path, model_dir, samples) -> None:
    """The coordinator reports a worker not heard from for `worker_silent_s` as dead (a kill -9). A worker whose
    replica is busy has nothing to ask the coordinator, and one in a long step or GetWeights fetch asks nothing
    either: its heartbeat thread says hello every `heartbeat_s` whatever the worker does (both shortened here).
    Once the worker has stopped it is reported dead. Real coordinator and worker over ZeroMQ on 127.0.0.1."""
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, pin_cpus=False)
    coord.worker_silent_s = 2.0
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.heartbeat_s = 0.2
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)

    def alive() -> bool:
        return any(w.worker_id == 0 and w.alive for w in coord.status().workers)

    try:
        thread.start()
        assert wait_for(alive, 20)
        for _ in range(8):  # 4 s of a busy replica: twice the silence that marks a worker dead
            time.sleep(0.5)
            assert alive()
        stop.set()
        thread.join(20)
        assert wait_for(lambda: not alive(), 10)
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


def test_a_worker_with_devices_of_its_own_trains_whatever_the_rollout_does(tmp_path, model_dir) -> None:
    """train_when = always (the Kubernetes drafter has GPUs of its own): BUSY events neither keep a worker from
    training nor end its window; a window ends at its submission, so the next one takes a newer policy's
    embedding / lm_head. With replica_idle the same BUSY ends the window at once (the tests above)."""
    stub = StubbedWorker(tmp_path, model_dir, train_when="always", submit_every=2)
    worker = stub.worker
    stub.busy()
    worker._poll_events(0.0)
    assert worker._may_train()  # the replica is busy: trains all the same
    stub.busy_after = 0  # and a BUSY comes with every batch
    res = worker.window()
    assert not res.preempted and res.micro_steps == 2
    assert stub.asks == ["pull", "batch_request", "batch_request", "update", "window"], stub.asks
    assert stub.version == 1 and worker._may_train()
    assert worker._deferred is None  # sent and saved at the submission: the next window writes nothing again
    assert load_state(worker.ckpt)["micro_steps"] == 2


def test_a_rollout_idle_worker_counts_a_draining_replica_still_finishing_work_as_busy(tmp_path, model_dir) -> None:
    """A replica dead for good (DRAINING, nothing on it) no longer keeps the gate shut; one DRAINING while it still
    finishes sequences (its server stopping) must, for workers as for the coordinator's RolloutIdle."""
    stub = StubbedWorker(tmp_path, model_dir, train_when="rollout_idle")
    worker = stub.worker

    def event(replica: int, state: int, running: int = 0):  # noqa: ANN202
        return events_pb2.CapacityEvent(server_id="s", replica_id=replica, state=state, running=running,
                                        timestamp=time.time())

    worker._see(event(0, IDLE))
    worker._see(event(1, common_pb2.REPLICA_STATE_DRAINING, running=2))
    assert worker.state != IDLE
    worker._see(event(1, common_pb2.REPLICA_STATE_DRAINING))  # dead for good: left out
    assert worker.state == IDLE
