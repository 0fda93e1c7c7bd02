"""The elastic drafter workers without the rollout server: when a worker trains. A real CapacityPublisher
(ZeroMQ on 127.0.0.1) plays the rollout's replicas, real workers (threads here, a `tlt drafter worker` process for
kill -9) train on real target features of a tiny random Qwen2 (transformers forward, post-norm last layer) against
the real coordinator (ROUTER, buffer, gating), all from tests/drafter_helpers.py: only while idle (per replica or
the whole rollout), preempted by BUSY, a budget per idle period, a silent or restarted capacity feed, devices of
its own. The rollout's UpdateWeights is replaced by a recording function (the integration test uses the real
server). Stand-in, not the real thing: `StubbedWorker` replaces a real worker's coordinator and capacity feed by
in-process stubs so that BUSY lands at an exact micro-step.

What a preempted window defers (delta, checkpoint, optimizer state): test_drafter_worker_deferred.py; a worker
that survives its peers' failures (coordinator, capacity feed, its drafter service): test_drafter_worker_failures.py."""

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
from tlt.services.drafter.serve import WORKER_CONFIG_ENV
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
           coord.endpoint, "--replica", "0"]
    env = {**os.environ, WORKER_CONFIG_ENV: cfg.model_dump_json()}  # as `tlt drafter serve` hands its config over
    ckpt = tmp_path / "ckpt" / "worker-0.pt"
    proc = subprocess.Popen(cmd, env=env)
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
        proc = subprocess.Popen(cmd, env=env)  # restart: continues from the checkpoint
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


@pytest.mark.parametrize("train_when", ["replica_idle", "rollout_idle"])
def test_a_silent_capacity_feed_stops_training(tmp_path, model_dir, samples, train_when, capfd) -> None:
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
        assert wait_for(lambda: worker._fed, 5)  # a heartbeat came through the SUB (not only the snapshot's IDLE)
        silent_at = time.time()
        pub.close()  # no more heartbeats; the last state heard was IDLE
        assert wait_for(lambda: len(coord.windows) == 1, 10), "the worker trains on with a silent capacity feed"
        (w,) = coord.windows
        assert w.preempted and w.micro_steps > 0 and silent_at < w.busy_timestamp <= w.released
        assert w.released - w.busy_timestamp < 2.0
        logged = capfd.readouterr()
        assert "capacity_feed_silent" in logged.err + logged.out  # a feed heard before: the rollout went quiet
        assert "heartbeats (about one a second) stopped" in logged.err + logged.out
        time.sleep(1.0)  # still silent: no new window
        assert len(coord.windows) == 1 and not coord.workers[0].training
        new = CapacityPublisher(pub_ep, snap_ep, heartbeat_s=0.2)  # the feed is back
        for r in (0, 1):
            state(new, r, IDLE)
        assert wait_for(lambda: coord.workers[0].training, 20)  # trains again
        time.sleep(1.0)  # some micro-steps: a BUSY right after the first batch request abandons the first step
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

    def event(replica: int, state: int, running: int = 0, queued: int = 0):  # noqa: ANN202
        return events_pb2.CapacityEvent(server_id="s", replica_id=replica, state=state, running=running,
                                        queued=queued, timestamp=time.time())

    worker._see(event(0, IDLE))
    worker._see(event(1, common_pb2.REPLICA_STATE_DRAINING, running=2))
    assert worker.state != IDLE
    worker._see(event(1, common_pb2.REPLICA_STATE_DRAINING))  # dead for good: left out
    assert worker.state == IDLE
    worker._see(event(1, common_pb2.REPLICA_STATE_DRAINING, queued=3))  # nothing running, work still queued
    assert worker.state != IDLE


@pytest.mark.parametrize("train_when", ["replica_idle", "rollout_idle"])
def test_a_worker_waiting_for_idle_reads_the_events_in_batches(tmp_path, model_dir, samples, monkeypatch,
                                                               train_when: str) -> None:
    """A decoding replica publishes tens of events a second, and a worker waiting for it to turn idle has nothing to do
    with each: it reads what queued every BUSY_POLL_S (its wake-ups were taken from the rollout's cores), and still
    opens a window soon after IDLE. Real CapacityPublisher, coordinator and worker."""
    from tlt.services.drafter import worker as worker_module

    seen_at: list[float] = []
    orig = DrafterWorker._see

    def see(self, event):  # noqa: ANN001, ANN202
        seen_at.append(time.monotonic())
        return orig(self, event)

    monkeypatch.setattr(DrafterWorker, "_see", see)
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], train_when=train_when, eval_interval_s=1e9,
                           pin_cpus=False)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    with running(worker, pub, coord):
        assert wait_for(lambda: 0 in coord.workers, 20) and not coord.workers[0].training
        time.sleep(0.3)
        seen_at.clear()
        t0 = time.monotonic()
        for i in range(40):  # count events of decoding replicas, 15 ms apart
            pub.publish(events_pb2.CapacityEvent(replica_id=i % 2, state=BUSY, running=i))
            time.sleep(0.015)
        assert wait_for(lambda: len(seen_at) >= 40, 5)
        elapsed = time.monotonic() - t0
        bursts = 1 + sum(b - a > 0.008 for a, b in zip(seen_at, seen_at[1:]))
        assert bursts <= elapsed / worker_module.BUSY_POLL_S + 4, (bursts, elapsed)  # ~13, not 40 wake-ups
        t0 = time.monotonic()
        for r in (0, 1):
            state(pub, r, IDLE)
        assert wait_for(lambda: coord.workers[0].training, 10), "no window opened after IDLE"
        assert time.monotonic() - t0 < 5.0


def test_a_fresh_worker_releases_its_first_window_soon_after_busy(tmp_path, model_dir, samples) -> None:
    """The first window of a `tlt drafter worker` process (a fresh checkpoint_dir) put the drafter on the device,
    then built its first torch optimizer, which imports torch._dynamo (~900 modules, 1.1-1.4 s of CPU on a 2-core
    VM), before it first read the capacity events: a BUSY meanwhile waited for the import (an audit of DRAFTER.md's
    "Run it" on a loaded machine, the worker at nice 19: release_ms=8601.9 steps=0). A fresh process, so that
    nothing imported it before; real publisher, coordinator and worker; BUSY 0.1 s into the first window."""
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, pin_cpus=False)
    cmd = [sys.executable, "-m", "tlt.cli", "drafter", "worker", "--model", str(model_dir), "--coordinator",
           coord.endpoint, "--replica", "0"]
    proc = subprocess.Popen(cmd, env={**os.environ, WORKER_CONFIG_ENV: cfg.model_dump_json()})
    try:
        assert wait_for(lambda: 0 in coord.workers, 60), "the worker never said hello"
        time.sleep(0.3)  # its run loop is waiting for IDLE
        state(pub, 0, IDLE)
        time.sleep(0.1)
        state(pub, 0, BUSY)
        assert wait_for(lambda: coord.windows, 20), "no window reported"
        win = coord.windows[0]
        assert win.preempted
        assert win.released - win.busy_timestamp < 0.5, (win.released - win.busy_timestamp, win.micro_steps)
    finally:
        proc.terminate()
        proc.wait(20)
        coord.close()
        pub.close()
