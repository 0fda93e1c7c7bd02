"""The elastic drafter service without the rollout server: a real CapacityPublisher (ZeroMQ on
127.0.0.1) plays the rollout's replicas, the real coordinator (ROUTER, buffer, gating) and real
workers (threads here, a `tlt drafter worker` process for kill -9) train on real target features
of a tiny random Qwen2 (transformers forward, post-norm last layer). The rollout's
UpdateWeights is replaced by a recording function (the integration test uses the real server).
Stand-ins, not the real thing: `_StubbedWorker` replaces a real worker's coordinator and capacity
feed by in-process stubs so that BUSY lands at an exact micro-step, and the gate tests script
`mean_accept_length`'s scores so that the candidate wins or loses by construction."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from rollout_helpers import tiny_checkpoint
from tlt.services.common.events import CapacityPublisher
from tlt.services.drafter.collect import sample_features
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import Coordinator
from tlt.services.drafter.training import load_state
from tlt.services.drafter.worker import DrafterWorker
from tlt.services.rollout.client import WeightPushError
from tlt.v1 import common_pb2, events_pb2

BUSY, IDLE = common_pb2.REPLICA_STATE_BUSY, common_pb2.REPLICA_STATE_IDLE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def samples(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [[int(x) for x in torch.randint(5, 200, (6,))] for _ in range(12)]
    return sample_features(model, prompts, max_new_tokens=40, window_tokens=64)


def make(tmp_path, model_dir, samples, pushes, server_id="", **over):
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", server_id=server_id, heartbeat_s=0.2)
    kw = dict(capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
              coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=64,
              batch_tokens=64, batch_rows=2, lr=3e-3, submit_every=5, eval_interval_s=0.2, min_eval_tokens=32,
              holdout_every=4, publish_margin=0.0)
    cfg = DrafterServiceConfig(**{**kw, **over})
    coord = Coordinator(cfg, str(model_dir), None, lambda t, v: pushes.append((sorted(t), v))).start()
    coord.buffer.add_samples(samples[3:])
    coord.buffer.add_samples(samples[:3], holdout=True)
    for r in (0, 1):
        pub.publish(events_pb2.CapacityEvent(replica_id=r, state=BUSY))
    return pub, cfg, coord


def state(pub, r, s):
    return pub.publish(events_pb2.CapacityEvent(replica_id=r, state=s))


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


def test_candidates_are_evaluated_only_while_every_replica_is_idle(tmp_path, model_dir, samples) -> None:
    """The gate's evaluation is seconds of CPU: it waits until no replica decodes, and gives the CPU back
    (nothing recorded, nothing pushed) the moment one turns busy."""
    import tlt.services.drafter.coordinator as coordinator_mod

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes)  # both replicas BUSY
    real = coordinator_mod.mean_accept_length
    calls: list[bool] = []  # per evaluation call: was the rollout idle when it started?
    try:
        with coord._lock:
            coord.candidate_version = 1  # a candidate to evaluate (as after a worker's delta)
        time.sleep(1.5)  # many gate ticks (eval_interval_s = 0.2) while busy
        assert not coord.acceptance and not pushes
        state(pub, 1, IDLE)  # one replica idle is not enough
        time.sleep(1.0)
        assert not coord.acceptance

        def interrupting(drafter, held, depth, should_stop=None):  # noqa: ANN001, ANN202
            calls.append(coord.rollout.idle())
            state(pub, 1, BUSY)  # a rollout starts while the candidate is being evaluated
            deadline = time.monotonic() + 5
            while not should_stop() and time.monotonic() < deadline:
                time.sleep(0.01)
            return real(drafter, held, depth, should_stop)

        coordinator_mod.mean_accept_length = interrupting
        state(pub, 0, IDLE)
        deadline = time.monotonic() + 10
        while coord.interrupted_evals == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.interrupted_evals >= 1 and calls[0] is True
        assert not coord.acceptance and not pushes and coord._evaluated == 0  # retried at the next idle moment
        coordinator_mod.mean_accept_length = real
        state(pub, 1, IDLE)
        deadline = time.monotonic() + 20
        while not coord.acceptance and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coord.acceptance and coord.acceptance[-1].drafter_version == 1  # evaluated once all were idle
    finally:
        coordinator_mod.mean_accept_length = real
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


def _wait(cond, timeout_s: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


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
        assert _wait(lambda: coord.candidate_version > 0, 20)  # a first delta: it trains
        for r in (0, 1):
            state(pub, r, common_pb2.REPLICA_STATE_DRAINING)  # shutting down
        assert _wait(lambda: len(coord.windows) == 1, 10) and coord.windows[0].preempted
        pub.close()
        version = coord.candidate_version
        new = CapacityPublisher(pub_ep, snap_ep, server_id="rollout-222", heartbeat_s=0.2)  # the restart
        for r in (0, 1):
            state(new, r, IDLE)
        # trains again, as before the restart: the deferred delta (if any) and at least one new one arrive
        assert _wait(lambda: coord.candidate_version >= version + 2, 15), (worker.state, worker._states)
        for r in (0, 1):
            state(new, r, BUSY)
        assert _wait(lambda: len(coord.windows) == 2, 20)
        assert coord.windows[1].micro_steps > 0 and thread.is_alive()
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        coord.close()
        (new or pub).close()


def test_bad_feature_sequences_are_refused_at_ingest_and_counted(tmp_path, model_dir, capfd) -> None:
    """A FeatureSequence that decodes but does not fit the model (hidden size, feature byte length, token ids
    outside the vocabulary, non-finite features) is refused when it arrives on the features socket, counted
    in the status and logged with its sender; before, it sat in the buffer and made batch() raise. Real
    FeaturePusher -> FeaturePuller over ZeroMQ on 127.0.0.1 into a real coordinator."""
    import numpy as np

    from tlt.services.common.events import FeaturePuller, FeaturePusher

    puller = FeaturePuller("tcp://127.0.0.1:*")
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               window_tokens=16, batch_tokens=16, holdout_every=1000, gate_when_idle=False,
                               eval_interval_s=1e9)
    coord = Coordinator(cfg, str(model_dir), puller, None).start()
    pusher = FeaturePusher(puller.endpoint)
    h, vocab = coord.drafter_cfg.hidden_size, coord.drafter_cfg.vocab_size

    def seq(name: str, n: int = 12, hidden: int = h, tokens: list[int] | None = None, nbytes: int | None = None,
            value: float = 0.5) -> events_pb2.FeatureSequence:
        feats = np.full((n, hidden), value, np.float16).tobytes()
        return events_pb2.FeatureSequence(seq_id=name, token_ids=tokens or list(range(5, 5 + n)), response_start=3,
                                          hidden_size=hidden, features=feats[:nbytes], replica_id=7)

    bad = [seq("wide", hidden=h + 8), seq("short_bytes", nbytes=12 * h * 2 - 2),
           seq("vocab", tokens=[5] * 11 + [vocab]), seq("negative", tokens=[-1] + [5] * 11),
           seq("nan", value=float("nan"))]
    try:
        deadline = time.monotonic() + 10
        while not pusher.push(events_pb2.FeatureBatch(sequences=[seq("good"), *bad], source="rollout")):
            assert time.monotonic() < deadline, "the puller never connected"
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while coord.buffer.received_sequences < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert coord.buffer.received_sequences == 6
        assert coord.buffer.stats() == (1, 10)  # the good sequence only: one window, from response_start - 1
        assert coord.buffer.batch(2, 16) is not None  # batch() no longer raises on what was let in
        st = coord.status()
        assert st.features_rejected == 5 and st.buffer_sequences == 1
        err = capfd.readouterr()
        logged = err.err + err.out
        for s in bad:
            assert f"seq_id={s.seq_id}" in logged, logged
        assert "feature_sequence_rejected" in logged and "replica=7" in logged and "source=rollout" in logged
    finally:
        pusher.close()
        coord.close()
        puller.close()


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
        assert _wait(lambda: 0 in coord.workers and coord.workers[0].training, 10)  # it asked for a batch
        time.sleep(1.0)  # several refused batches
        assert thread.is_alive() and coord.candidate_version == 0
        coord.buffer.add_samples([dataclasses.replace(s, policy_version=100) for s in samples[3:]])  # newer data
        assert _wait(lambda: coord.candidate_version > 0, 20)  # it trains on it
        state(pub, 0, BUSY)
        assert _wait(lambda: len(coord.windows) == 1, 20)
        assert coord.windows[0].micro_steps > 0 and thread.is_alive()
    finally:
        stop.set()
        state(pub, 0, BUSY)
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


def test_serving_drafter_is_scored_once_per_held_out_set(tmp_path, model_dir, samples) -> None:
    """Between two rollouts several candidates are scored against the same held-out set; the serving
    drafter's score is reused (it is ~0.4 CPU-s per scoring on the tiny model, in the trainer's time on a
    CPU machine) and recomputed when the held-out set, the serving drafter or the policy changes."""
    import tlt.services.drafter.coordinator as coordinator_mod

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, eval_interval_s=1e9)  # the gate never fires
    real = coordinator_mod.mean_accept_length
    calls: list[int] = []

    def counting(drafter, held, depth, should_stop=None):  # noqa: ANN001, ANN202
        calls.append(len(held))
        return real(drafter, held, depth, None)

    coord.rollout = None  # scoring is called directly here, not through the gate
    coordinator_mod.mean_accept_length = counting
    try:
        with coord._lock:
            coord.candidate_version = 1  # the candidate is still the serving drafter: never better
        first = coord.evaluate_and_publish()
        assert len(calls) == 2 and not first.published  # candidate, then serving
        with coord._lock:
            coord.candidate_version = 2
        second = coord.evaluate_and_publish()
        assert len(calls) == 3  # the candidate only
        assert second.serving_accept_len == first.serving_accept_len
        coord.buffer.add_samples(samples[:1], holdout=True)  # a new held-out window
        third = coord.evaluate_and_publish()
        assert len(calls) == 5 and calls[-1] == calls[0] + 1  # both scored again, on the larger set
        with coord._lock:
            coord.serving_version = 7  # a published drafter would change it
        coord.evaluate_and_publish()
        assert len(calls) == 7
        assert third is not None
    finally:
        coordinator_mod.mean_accept_length = real
        coord.close()
        pub.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_evaluation_sched_idle_puts_only_the_gate_thread_in_sched_idle(tmp_path, model_dir, samples) -> None:
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, evaluation_sched="idle")
    try:
        gate = next(t for t in coord._threads if t.name == "drafter-gate")
        others = [t for t in coord._threads if t.name != "drafter-gate"]
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(gate.native_id) != os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.sched_getscheduler(gate.native_id) == os.SCHED_IDLE
        assert all(os.sched_getscheduler(t.native_id) != os.SCHED_IDLE for t in others)  # ingest, router, saver
        assert os.sched_getscheduler(0) != os.SCHED_IDLE
    finally:
        coord.close()
        pub.close()


def test_window_max_steps_trains_a_budget_per_idle_period(tmp_path, model_dir, samples) -> None:
    """A worker with window_max_steps = 4 trains 4 micro-steps in an idle period, sends them at once (the
    replica is still idle), and trains again only after its replica has been busy and idle again."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, window_max_steps=4, eval_interval_s=1e9)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
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
    finally:
        stop.set()
        state(pub, 0, BUSY)
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


class _StubbedWorker:
    """A DrafterWorker whose coordinator and capacity feed are stubs: `busy_after` batch requests of a
    window, a BUSY event is queued; `asks` records every request kind in order."""

    def __init__(self, tmp_path, model_dir, **over) -> None:  # noqa: ANN001
        import numpy as np

        from tlt.services.drafter.packing import Sample, pack
        from tlt.services.drafter.training import new_drafter, own_tensors

        kw = dict(capacity_pub="tcp://127.0.0.1:9", capacity_snapshot="tcp://127.0.0.1:9",
                  checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=16, batch_tokens=16, batch_rows=1,
                  submit_every=100, pin_cpus=False)
        self.worker = DrafterWorker(DrafterServiceConfig(**{**kw, **over}), str(model_dir), 0, 0, "tcp://127.0.0.1:9")
        self.worker.sub.close()
        self.cand = own_tensors(new_drafter(model_dir))
        g = np.random.default_rng(0)
        h = self.cand["fc.weight"].shape[0]
        smp = Sample("a", g.integers(0, 100, 16).astype(np.int32), g.standard_normal((16, h)).astype(np.float16), 1, 0)
        self.batch = pack([smp], 1, 16)[0].to_proto()
        self.events: list = []
        self.asks: list[str] = []
        self.busy_after = 0
        self.version = 0
        self.shared_policy_version = self.shared_fetch_failures = 0
        self.worker.client, self.worker.sub = self, self

    def busy(self) -> None:
        self.events.append(events_pb2.CapacityEvent(replica_id=0, state=BUSY, timestamp=time.time()))

    def ask(self, **body):  # noqa: ANN003, ANN201
        from tlt.services.drafter.coordinator import tensors_from, tensors_message
        from tlt.v1 import drafter_pb2

        kind = next(iter(body))
        self.asks.append(kind)
        if kind == "pull":
            m, p = tensors_message(self.cand, self.version)
            return drafter_pb2.CoordinatorMessage(candidate=drafter_pb2.CandidateWeights(
                version=self.version, manifest=m, payload=p))
        if kind == "batch_request":
            self.busy_after -= 1
            if self.busy_after < 0:
                self.busy()
            return drafter_pb2.CoordinatorMessage(batch=self.batch)
        if kind == "update":
            for k, d in tensors_from(body["update"].manifest, body["update"].payload).items():
                self.cand[k] += d
            self.version += 1
            return drafter_pb2.CoordinatorMessage(candidate_version=self.version)
        return drafter_pb2.CoordinatorMessage()

    def recv(self, timeout_s):  # noqa: ANN001, ANN201
        return self.events.pop(0) if self.events else None

    def close(self) -> None:
        pass


def test_optimizer_state_carries_over_preempted_windows(tmp_path, model_dir) -> None:
    """A preempted window defers its optimizer checkpoint to the next idle window; that window must train
    with it (Adam's moments and step count continue), not with the checkpoint from before the last window.
    A stub coordinator and event feed drive two windows of 3 and 2 micro-steps, preempted by BUSY."""
    stub = _StubbedWorker(tmp_path, model_dir)
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

    stub = _StubbedWorker(tmp_path, model_dir, submit_every=3)
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


def test_a_published_version_is_checkpointed_before_the_publish_returns(tmp_path, model_dir, monkeypatch) -> None:
    """The rollout serves a published drafter at once; a coordinator killed (-9) right after the publish,
    before its background saver ran, must not restart with an older candidate/serving version (it would
    reuse a version number the rollout serves with other weights, and gate against a stale serving one)."""
    import numpy as np

    import tlt.services.drafter.coordinator as coordinator_mod
    from tlt.services.drafter.packing import Sample

    pushes: list = []
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               window_tokens=16, batch_tokens=16, min_eval_tokens=8, publish_margin=0.0,
                               gate_when_idle=False)
    coord = Coordinator(cfg, str(model_dir), None, lambda t, v: pushes.append(v))  # not started: no saver
    try:
        h = coord.drafter_cfg.hidden_size
        g = np.random.default_rng(0)
        coord.buffer.add_samples([Sample("held", g.integers(0, 100, 16).astype(np.int32),
                                         g.standard_normal((16, h)).astype(np.float16), 1, 0)], holdout=True)
        scores = iter([(2.0, 10), (1.0, 10)])  # candidate, then serving
        monkeypatch.setattr(coordinator_mod, "mean_accept_length", lambda *a, **k: next(scores))
        with coord._lock:
            coord.candidate_version = 3  # as after three deltas
        rec = coord.evaluate_and_publish()
        assert rec is not None and rec.published and pushes == [3]
        saved = load_state(coord.ckpt)  # what a restart after kill -9 would see
        assert saved is not None and saved["serving_version"] == 3 and saved["candidate_version"] >= 3
        again = Coordinator(cfg, str(model_dir), None, None)  # the restart
        try:
            assert again.serving_version == 3 and again.candidate_version >= 3 and again.acceptance[-1].published
        finally:
            again._router.close()
            again._ctx.term()
    finally:  # never started: only its socket to close
        coord._router.close()
        coord._ctx.term()


def test_a_push_that_fails_leaves_the_candidate_due_for_the_next_gate(tmp_path, model_dir, monkeypatch) -> None:
    """The gate's boundary logs a failed push and retries later: the candidate must stay due (it was marked
    evaluated before the push, so a failed push waited for the next delta, which may never come)."""
    import numpy as np

    import tlt.services.drafter.coordinator as coordinator_mod
    from tlt.services.drafter.packing import Sample

    pushes: list = []

    def publish(tensors, version):  # noqa: ANN001
        pushes.append(version)
        if len(pushes) == 1:
            raise ConnectionError("rollout unavailable")

    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               window_tokens=16, batch_tokens=16, min_eval_tokens=8, publish_margin=0.0,
                               gate_when_idle=False)
    coord = Coordinator(cfg, str(model_dir), None, publish)  # not started: the gate is called by hand
    try:
        h = coord.drafter_cfg.hidden_size
        g = np.random.default_rng(0)
        coord.buffer.add_samples([Sample("held", g.integers(0, 100, 16).astype(np.int32),
                                         g.standard_normal((16, h)).astype(np.float16), 1, 0)], holdout=True)
        with coord._lock:
            coord.candidate_version = 3
        scores = iter([(2.0, 10), (1.0, 10), (2.0, 10), (1.0, 10)])  # candidate, serving; twice
        monkeypatch.setattr(coordinator_mod, "mean_accept_length", lambda *a, **k: next(scores))
        with pytest.raises(ConnectionError):
            coord.evaluate_and_publish()
        assert coord.candidate_version > coord._evaluated and coord.serving_version < 3  # still due, not serving
        rec = coord.evaluate_and_publish()  # the next gate, no new delta
        assert rec is not None and rec.published and pushes == [3, 3] and coord.serving_version == 3
    finally:
        coord._router.close()
        coord._ctx.term()


def test_a_restarted_coordinator_pushes_its_restored_serving_drafter(tmp_path, model_dir) -> None:
    """`tlt run --resume` restarts the rollout with its initial drafter while the coordinator restores
    serving version N: without a push of N the rollout drafted with the initial drafter until a candidate
    beat N by the margin. A rollout that already serves N or a newer one (only the drafter service
    restarted) refuses it, which ends the republish too: told by the version the refusal carries
    (`WeightPushError.serving_version`), not by the words of its message. A refusal from a rollout that
    serves an older drafter (e.g. the push failed validation) is retried, whatever its message says.
    `publish` stands in for the gRPC push (tests/test_rollout_hotswap.py checks the real refusal's version)."""
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False)
    first = Coordinator(cfg, str(model_dir), None, None)
    try:
        with first._lock:
            first.serving_version = first.candidate_version = 3
        first.save_now()
    finally:
        first._router.close()
        first._ctx.term()

    for serving in (None, 3, 5):  # None: the push is taken; else the version the refusing rollout serves
        pushes: list[int] = []

        def publish(tensors, version):  # noqa: ANN001
            pushes.append(version)
            assert not any("embed" in k or "lm_head" in k for k in tensors)
            if serving is not None:
                raise WeightPushError(f"drafter v{version} refused: the replicas serve v{serving}", serving)

        coord = Coordinator(cfg, str(model_dir), None, publish).start()
        try:
            deadline = time.monotonic() + 10
            while coord._republish_due and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # a few more gate rounds: no second push
            assert pushes == [3] and not coord._republish_due
        finally:
            coord.close()

    pushes = []

    def older(tensors, version):  # noqa: ANN001
        pushes.append(version)
        raise WeightPushError(f"drafter version {version} is not newer than ... (a message that says so wrongly)", 2)

    coord = Coordinator(cfg, str(model_dir), None, older).start()
    try:
        deadline = time.monotonic() + 10
        while not pushes and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert pushes == [3] and coord._republish_due  # the rollout serves v2 < 3: pushed again later
    finally:
        coord.close()
