"""The drafter coordinator without the rollout server: its gate (when it evaluates, what it publishes), feature
ingest, batch requests and the workers' status. The real coordinator (ROUTER, feature buffer, gating,
checkpoint) with a real CapacityPublisher (ZeroMQ on 127.0.0.1) playing the rollout's replicas, real target
features of a tiny random Qwen2, from tests/drafter_helpers.py. The rollout's UpdateWeights is replaced by a
recording function (the integration test uses the real server). Stand-ins, not the real thing: the gate tests
script `mean_accept_length`'s scores so that the candidate wins or loses by construction.

Its pushes and checkpoints across failures and restarts: test_drafter_coordinator_pushes.py; which versions the
gate evaluates over time, and an evaluation cut by a busy rollout: test_drafter_coordinator_gate.py."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from drafter_helpers import BUSY, IDLE, gated_coordinator, make, model_dir, samples, state, wait_for  # noqa: F401 (fixtures)
from tlt.services.common.zmq_auth import ZmqAuth
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import Coordinator
from tlt.v1 import events_pb2


def test_candidates_are_evaluated_only_while_every_replica_is_idle(tmp_path, model_dir, samples) -> None:
    """The gate's evaluation is seconds of CPU: it waits until no replica decodes, and gives the CPU back
    (nothing recorded, nothing pushed) the moment one turns busy."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

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


def _count_scorings(coord) -> list[int]:  # noqa: ANN001
    """Detach the coordinator from the rollout and count its scorings: the returned list gets the size of each
    held-out set scored. The caller puts the real `mean_accept_length` back."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    real, calls = coordinator_mod.mean_accept_length, []

    def counting(drafter, held, depth, should_stop=None):  # noqa: ANN001, ANN202
        calls.append(len(held))
        return real(drafter, held, depth, None)

    coord.rollout = None
    coordinator_mod.mean_accept_length = counting
    return calls


def test_serving_drafter_is_scored_once_per_held_out_set(tmp_path, model_dir, samples) -> None:
    """Between two rollouts several candidates are scored against the same held-out set; the serving
    drafter's score is reused (it is ~0.4 CPU-s per scoring on the tiny model, in the trainer's time on a
    CPU machine) and recomputed when the held-out set, the serving drafter or the policy changes."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, eval_interval_s=1e9)  # the gate never fires
    real = coordinator_mod.mean_accept_length
    calls = _count_scorings(coord)  # scoring is called directly here, not through the gate
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
        cur = coord.shared.current  # a new policy: its lm_head scores every drafter anew (the engine's own)
        coord.shared.current = dataclasses.replace(cur, policy_version=cur.policy_version + 1,
                                                   lm_head=cur.lm_head.flip(0).contiguous())
        with coord._lock:
            coord.candidate_version = 3
        coord.evaluate_and_publish()
        assert len(calls) == 9, f"the serving drafter's score under the old policy was reused: {len(calls)} scorings"
        coord.evaluate_and_publish()
        assert len(calls) == 10  # and reused again under that policy
    finally:
        coordinator_mod.mean_accept_length = real
        coord.close()
        pub.close()


def test_too_few_held_out_tokens_score_and_push_nothing(tmp_path, model_dir, samples) -> None:
    """A candidate is scored (and may be pushed) only on at least `min_eval_tokens` held-out tokens: on fewer, an
    accept length of a handful of positions decided what every replica serves. One token short: nothing scored,
    recorded or pushed; exactly enough: scored."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, eval_interval_s=1e9)  # the gate never fires
    real = coordinator_mod.mean_accept_length
    calls = _count_scorings(coord)  # scoring is called directly here, not through the gate
    try:
        held = sum(len(s) for s in coord.buffer.holdout(0))
        assert held > 0
        with coord._lock:
            coord.candidate_version = 1
        coord.cfg = cfg.model_copy(update={"min_eval_tokens": held + 1})
        assert coord.evaluate_and_publish() is None
        assert not calls and not coord.acceptance and not pushes
        coord.cfg = cfg.model_copy(update={"min_eval_tokens": held})
        assert coord.evaluate_and_publish() is not None and len(calls) == 2 and len(coord.acceptance) == 1
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


def test_a_batch_request_cannot_ask_for_more_than_the_configured_batch(tmp_path, model_dir, samples) -> None:
    """The router thread builds every worker's batch while the others wait. A buggy or hostile peer's
    BatchRequest(rows=10**6) kept it busy for 32 s (every worker timed out) and allocated gigabytes of
    padding (a larger one: a MemoryError, or the OOM killer); max_tokens = 10**6 packs the whole buffer into
    one row. A request is served at most the configured batch_rows x batch_tokens. Real ROUTER over ZeroMQ."""
    import zmq

    from tlt.v1 import drafter_pb2

    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9)
    ctx = zmq.Context()
    try:
        for rows, tokens in ((20000, 0), (0, 10**6), (1, 32)):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            ZmqAuth(ctx).connect(sock, coord.endpoint)  # a peer with the token
            req = drafter_pb2.WorkerMessage(worker_id=9, batch_request=drafter_pb2.BatchRequest(rows=rows,
                                                                                               max_tokens=tokens))
            sock.send(req.SerializeToString())
            assert sock.poll(30_000), "the coordinator did not answer"
            batch = drafter_pb2.CoordinatorMessage.FromString(sock.recv()).batch
            sock.close()
            assert 0 < batch.rows <= cfg.batch_rows and 0 < batch.length <= cfg.batch_tokens, (rows, tokens)
            if rows == 1:  # a smaller batch than the configured one is still served as asked
                assert batch.rows == 1 and batch.length <= 32
    finally:
        ctx.term()
        coord.close()
        pub.close()


@pytest.mark.parametrize(("cand", "serve", "margin", "published"), [
    (2.5, 2.0, 0.25, True),    # exactly 25% better: 2.5 >= 2.0 * 1.25
    (2.4, 2.0, 0.25, False),   # better, but by less than the margin (2.4 < 2.5)
    (2.0, 2.0, 0.0, False),    # a tie is never published, even without a margin
    (2.25, 2.0, 0.0, True),    # any gain without a margin
])
def test_the_gate_publishes_only_a_candidate_better_by_the_margin(tmp_path, model_dir, monkeypatch, cand, serve,
                                                                  margin, published) -> None:
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    pushes: list = []
    coord = gated_coordinator(tmp_path, model_dir, lambda t, v: pushes.append(v), publish_margin=margin,
                              min_eval_tokens=16)  # the held-out window is exactly 16 tokens: enough
    try:
        scores = iter([(cand, 10), (serve, 10)])  # candidate, then serving
        monkeypatch.setattr(coordinator_mod, "mean_accept_length", lambda *a, **k: next(scores))
        with coord._lock:
            coord.candidate_version = 2
        rec = coord.evaluate_and_publish()
        assert rec is not None and rec.published is published and pushes == ([2] if published else [])
        assert (rec.candidate_accept_len, rec.serving_accept_len) == (cand, serve)
        assert coord.serving_version == (2 if published else 0)
        # the serving gauge shows what serves now: the candidate's score once it is published
        assert coord.m_accept.labels("serving")._value.get() == (cand if published else serve)
    finally:  # never started: only its socket to close
        coord.close_sockets()


def test_a_dead_worker_is_reported_neither_alive_nor_training(tmp_path, model_dir, samples) -> None:
    """A worker killed with -9 mid-window stayed `alive=True, training=True` in GetStatus for good: every message
    set alive and only a window report cleared training. A worker not heard for `worker_silent_s` (shortened here)
    is reported not alive and not training; heard again, it is alive again. Real ROUTER over ZeroMQ; the worker is
    a bare REQ socket that asks for a batch and then goes silent, as a killed worker does."""
    import zmq

    from tlt.v1 import drafter_pb2

    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9)
    coord.worker_silent_s = 2.0
    ctx = zmq.Context()

    def ask(**body) -> None:  # noqa: ANN003
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        ZmqAuth(ctx).connect(sock, coord.endpoint)  # a peer with the token
        sock.send(drafter_pb2.WorkerMessage(worker_id=7, replica_id=0, **body).SerializeToString())
        assert sock.poll(10_000), "the coordinator did not answer"
        sock.recv()
        sock.close()

    def worker7() -> drafter_pb2.WorkerStatus:
        return {w.worker_id: w for w in coord.status().workers}[7]

    try:
        ask(hello=drafter_pb2.WorkerHello(worker_id=7, replica_id=0, pid=os.getpid()))  # the worker starts
        ask(batch_request=drafter_pb2.BatchRequest(rows=1))
        assert worker7().alive and worker7().training
        heard = time.monotonic()  # at most when the coordinator heard it
        ask(hello=drafter_pb2.WorkerHello(worker_id=7, replica_id=0, pid=os.getpid()))  # its heartbeat: still training
        assert worker7().alive and worker7().training
        deadline = time.monotonic() + 10
        while worker7().alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker7().alive and not worker7().training
        assert time.monotonic() - heard >= 2.0
        ask(hello=drafter_pb2.WorkerHello(worker_id=7, replica_id=0, pid=os.getpid() + 1))  # a restarted worker
        assert worker7().alive and not worker7().training
    finally:
        ctx.term()
        coord.close()
        pub.close()


def test_a_coordinator_never_started_closes(tmp_path, model_dir) -> None:
    """close() joined threads that were never started ("cannot join thread before it is started"): a caller whose
    setup failed between the constructor and start() could not release the coordinator's socket."""
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"))
    coord = Coordinator(cfg, str(model_dir), None, None)
    coord.close()
    assert coord._router.closed


def test_a_window_report_is_checkpointed_once_the_rollout_is_idle_and_answered_without_the_history(
        tmp_path, model_dir, samples, monkeypatch) -> None:
    """Workers report a window as their replica turns busy (the start of every rollout). Its checkpoint write (the
    drafter's tensors, the history, an fsync) took a decoding replica's CPU ~0.5 s later: it now waits until every
    replica is idle, at most HISTORY_SAVE_WAIT_S (shortened here: a rollout longer than that gets the write). A delta,
    which changes the candidate, waits too, at most STATE_SAVE_WAIT_S (shortened here). The answer to a hello or a
    report leaves the history out (the worker does not read it); GetStatus keeps it."""
    import torch
    import zmq

    from tlt.services.drafter import coordinator as coordinator_module

    from tlt.services.common.weights import pack_state_dict
    from tlt.services.drafter.training import own_tensors
    from tlt.v1 import common_pb2, drafter_pb2

    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9)  # both replicas BUSY
    ctx = zmq.Context()

    def ask(**body) -> drafter_pb2.CoordinatorMessage:  # noqa: ANN003
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        ZmqAuth(ctx).connect(sock, coord.endpoint)  # a peer with the token
        sock.send(drafter_pb2.WorkerMessage(worker_id=3, replica_id=0, **body).SerializeToString())
        assert sock.poll(10_000), "the coordinator did not answer"
        reply = drafter_pb2.CoordinatorMessage.FromString(sock.recv())
        sock.close()
        return reply

    def saved_windows() -> int:
        if not coord.ckpt.exists():
            return -1
        return len(torch.load(coord.ckpt, weights_only=False)["windows"])

    try:
        assert wait_for(lambda: coord.rollout.busy(), 10)
        reply = ask(window=drafter_pb2.TrainingWindow(worker_id=3, replica_id=0, micro_steps=4, preempted=True))
        assert reply.status.preemptions == 1 and len(reply.status.windows) == 0
        assert len(coord.status().windows) == 1
        time.sleep(2.0)  # the saver wrote within ~0.5 s before
        assert saved_windows() == -1, "a history-only change was written while a replica decoded"
        local = {k: v + 0.01 for k, v in own_tensors(coord.candidate).items()}
        manifest, payload = pack_state_dict({k: local[k] - v for k, v in own_tensors(coord.candidate).items()},
                                            common_pb2.WEIGHT_KIND_DRAFTER, 0)
        assert ask(update=drafter_pb2.DeltaUpdate(base_version=0, micro_steps=1, manifest=manifest.SerializeToString(),
                                                  payload=bytes(payload))).candidate_version == 1
        time.sleep(2.0)
        assert saved_windows() == -1, "a delta was written while a replica decoded, before STATE_SAVE_WAIT_S"
        for r in (0, 1):
            state(pub, r, IDLE)
        assert wait_for(lambda: saved_windows() == 1, 5), "written once every replica is idle"
        for r in (0, 1):
            state(pub, r, BUSY)
        assert wait_for(lambda: coord.rollout.busy(), 10)
        monkeypatch.setattr(coordinator_module, "STATE_SAVE_WAIT_S", 1.0)
        assert ask(update=drafter_pb2.DeltaUpdate(base_version=1, micro_steps=1, manifest=manifest.SerializeToString(),
                                                  payload=bytes(payload))).candidate_version == 2
        assert wait_for(lambda: torch.load(coord.ckpt, weights_only=False)["candidate_version"] == 2, 5), \
            "a delta is written at STATE_SAVE_WAIT_S, the rollout still busy"
        assert coord.rollout.busy()
        ask(window=drafter_pb2.TrainingWindow(worker_id=3, replica_id=0, micro_steps=2))
        worker = coord.status().workers[0]  # the worker's windows add up; only a preempted one is a preemption
        assert (worker.micro_steps, worker.preemptions, coord.status().preemptions) == (6, 1, 1)
        time.sleep(1.5)
        assert saved_windows() == 1
        for r in (0, 1):
            state(pub, r, IDLE)
        assert wait_for(lambda: saved_windows() == 2, 5), "written once every replica is idle"
        coord.acceptance.append(drafter_pb2.AcceptanceRecord(drafter_version=1))
        hello = ask(hello=drafter_pb2.WorkerHello(worker_id=3, replica_id=0, pid=1)).status
        assert len(hello.windows) == len(hello.acceptance) == 0 and len(coord.status().acceptance) == 1
        monkeypatch.setattr(coordinator_module, "HISTORY_SAVE_WAIT_S", 1.0)
        state(pub, 0, BUSY)
        assert wait_for(lambda: coord.rollout.busy(), 10)
        ask(window=drafter_pb2.TrainingWindow(worker_id=3, replica_id=0, micro_steps=1))
        assert wait_for(lambda: saved_windows() == 3, 5), "written at the cap, the rollout still busy"
        assert coord.rollout.busy()
    finally:
        ctx.term()
        coord.close()
        pub.close()


@pytest.mark.parametrize("train_when", ["rollout_idle", "replica_idle"])
def test_features_that_arrive_while_the_rollout_decodes_are_parsed_once_it_is_idle(tmp_path, model_dir, monkeypatch,
                                                                                   train_when: str) -> None:
    """With train_when = rollout_idle no worker trains while a replica decodes, so parsing the features that arrive
    then into the buffer only took a decoding replica's CPU: they are taken off the socket as they come (its queue is
    short, the senders drop when it is full) and parsed once every replica is idle, none lost, or once
    HELD_FEATURE_BYTES of them wait. With replica_idle a worker may train on an idle replica while another decodes:
    they go into the buffer at once. Real FeaturePusher -> FeaturePuller and capacity events over ZeroMQ on
    127.0.0.1, into a real coordinator."""
    import numpy as np

    from tlt.services.common.events import CapacityPublisher, FeaturePuller, FeaturePusher
    from tlt.services.drafter import intake

    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    for r in (0, 1):
        state(pub, r, BUSY)
    puller = FeaturePuller("tcp://127.0.0.1:*")
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
                               window_tokens=16, batch_tokens=16, holdout_every=1000, eval_interval_s=1e9,
                               train_when=train_when)
    coord = Coordinator(cfg, str(model_dir), puller, None).start()
    pusher = FeaturePusher(puller.endpoint)
    h = coord.drafter_cfg.hidden_size
    n = 64
    feats = np.full((n, h), 0.5, np.float16).tobytes()

    def seq(i: int) -> events_pb2.FeatureSequence:
        return events_pb2.FeatureSequence(seq_id=f"s{i}", token_ids=[5 + t % 50 for t in range(n)], response_start=3,
                                          hidden_size=h, features=feats)

    def send(count: int) -> None:
        sent, deadline = 0, time.monotonic() + 10
        while sent < count:
            if pusher.push(events_pb2.FeatureBatch(sequences=[seq(sent)], source="rollout")):
                sent += 1
            else:
                assert time.monotonic() < deadline, "the puller never connected or stopped reading"
                time.sleep(0.01)

    try:
        assert wait_for(lambda: coord.rollout.busy(), 10)
        send(30)
        # every frame is taken off the socket while the rollout decodes (a coordinator that stopped reading would
        # leave the senders to drop them in a long rollout)
        assert wait_for(lambda: puller.frames == 30, 10), puller.frames
        if train_when == "rollout_idle":
            time.sleep(0.5)
            assert coord.buffer.received_sequences == 0, "parsed while every replica was busy"
            monkeypatch.setattr(intake, "HELD_FEATURE_BYTES", 40 * len(feats))  # ~40 frames
            send(20)  # 50 held: over the cap, so they are parsed although the rollout still decodes
            assert wait_for(lambda: coord.buffer.received_sequences >= 30, 10), coord.buffer.received_sequences
            assert coord.rollout.busy()
            for r in (0, 1):
                state(pub, r, IDLE)
        else:
            send(20)
        assert wait_for(lambda: coord.buffer.received_sequences == 50, 10), coord.buffer.received_sequences
        assert puller.garbage == 0 and puller.received == 50
    finally:
        pusher.close()
        coord.close()
        puller.close()
        pub.close()


def _ingesting_coordinator(tmp_path, model_dir) -> Coordinator:  # noqa: ANN001
    """A coordinator whose gate never fires, fed by calling _ingest directly."""
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               window_tokens=16, batch_tokens=16, holdout_every=1000, gate_when_idle=False,
                               eval_interval_s=1e9)
    return Coordinator(cfg, str(model_dir), None, None)


def _sequence(coord: Coordinator, name: str, **fields: int) -> events_pb2.FeatureSequence:
    """12 tokens of which 9 are the response, every feature 0.5 (fp16)."""
    import numpy as np

    h = coord.drafter_cfg.hidden_size
    return events_pb2.FeatureSequence(seq_id=name, token_ids=list(range(5, 17)), response_start=3, hidden_size=h,
                                      features=np.full((12, h), 0.5, np.float16).tobytes(), **fields)


def test_a_feature_batch_from_the_other_source_is_dropped_and_an_unnamed_one_kept(tmp_path, model_dir) -> None:
    """[drafter] source picks the producer whose features train the drafter (rollout or trainer); the other's are
    dropped. A batch that names no source (FeatureBatch.source unset: a producer of the public message that does
    not say) is kept, as Coordinator._ingest means to: only a named other source is dropped."""
    coord = _ingesting_coordinator(tmp_path, model_dir)
    try:
        for name, source in (("trainer", "trainer"), ("unnamed", ""), ("rollout", "rollout")):
            coord._ingest(events_pb2.FeatureBatch(sequences=[_sequence(coord, name)], source=source))
        assert coord.buffer.received_sequences == 2 and coord.buffer.stats()[0] == 2
    finally:
        coord.close()


def test_a_late_batch_of_an_older_policy_leaves_the_newest_policy_in_status_and_the_gate(tmp_path, model_dir) -> None:
    """Features of a sequence that spanned a policy push arrive after those of the newer policy (senders queue per
    replica). The policy status shows, the one the next evaluation's embedding / lm_head are fetched for (shared.py)
    and the one acceptance records carry stays the newest heard of: not the older one of the late batch. Status
    shows the serving drafter next to it, not the candidate."""
    from tlt.v1 import common_pb2

    coord = _ingesting_coordinator(tmp_path, model_dir)
    try:
        coord._ingest(events_pb2.FeatureBatch(sequences=[_sequence(coord, "new", policy_version=3)]))
        coord._ingest(events_pb2.FeatureBatch(sequences=[_sequence(coord, "late", policy_version=2)]))
        with coord._lock:
            coord.candidate_version = 4  # as after four deltas, none published
        assert coord.status(history=False).latest_policy == common_pb2.WeightVersions(policy=3, drafter=0)
        assert coord.latest_policy == 3 and coord.shared.seen == 3
    finally:
        coord.close()


def test_a_delta_that_lacks_a_tensor_of_the_drafter_is_refused_whole(tmp_path, model_dir) -> None:
    """A delta is applied whole or not at all: one that lacks a tensor of the drafter (a worker of another drafter
    layout) is refused, nothing of it added, the version unchanged; as is one with a tensor the drafter lacks."""
    import torch

    from tlt.services.drafter.training import own_tensors, tensors_message
    from tlt.v1 import drafter_pb2

    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False, eval_interval_s=1e9)
    coord = Coordinator(cfg, str(model_dir), None, None)
    try:
        before = {k: v.clone() for k, v in own_tensors(coord.candidate).items()}
        full = {k: torch.full_like(v, 0.5) for k, v in before.items()}
        lacking = dict(full)
        del lacking[sorted(lacking)[0]]
        for delta in (lacking, {**full, "extra.weight": torch.zeros(2)}):
            m, p = tensors_message(delta, 0)
            with pytest.raises(ValueError, match="do not match"):
                coord.apply_delta(drafter_pb2.DeltaUpdate(base_version=0, manifest=m, payload=p), worker_id=1)
        after = own_tensors(coord.candidate)
        assert coord.candidate_version == 0 and all(torch.equal(after[k], before[k]) for k in before)
    finally:
        coord.close_sockets()
