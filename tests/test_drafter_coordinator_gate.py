"""The drafter coordinator's gate over time: which candidate versions it evaluates, when an evaluation may end in
a push, and that each drafter is scored with its own weights. The real coordinator (its gate thread, its rollout
view) with a real CapacityPublisher (ZeroMQ on 127.0.0.1) playing the rollout's replicas, from
tests/drafter_helpers.py; real deltas through `apply_delta`. Stand-ins, not the real thing: `mean_accept_length`'s
scores are scripted, and the rollout's UpdateWeights is a recording function."""

from __future__ import annotations

import time

import pytest
import torch

from drafter_helpers import BUSY, IDLE, gated_coordinator, make, model_dir, samples, state, wait_for  # noqa: F401 (fixtures)
from tlt.services.drafter.acceptance import EvaluationInterrupted
from tlt.services.drafter.training import own_tensors, tensors_message
from tlt.v1 import drafter_pb2


def _zero_delta(coord, base: int) -> drafter_pb2.DeltaUpdate:  # noqa: ANN001
    """A worker's delta on `base` (zeros: the scores are scripted anyway)."""
    m, p = tensors_message({k: torch.zeros_like(v) for k, v in own_tensors(coord.candidate).items()}, base)
    return drafter_pb2.DeltaUpdate(base_version=base, manifest=m, payload=p)


def test_each_candidate_version_is_evaluated_once_and_one_made_during_an_evaluation_next(
        tmp_path, model_dir, samples, monkeypatch) -> None:
    """A worker's delta that lands while the gate scores candidate v1 makes v2: v2 is evaluated at the next gate
    round (marking 'evaluated' the version the candidate had reached by the end left v2 unscored until some later
    delta). And a version already evaluated is not scored again every eval_interval_s while the rollout is idle
    (seconds of CPU each time, and the acceptance history filled with copies)."""
    import tlt.services.drafter.coordinator_gate as gate

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes)  # eval_interval_s 0.2

    def scoring(drafter, held, depth, should_stop=None):  # noqa: ANN001, ANN202
        if coord.candidate_version == 1:  # scoring v1: a worker's delta lands meanwhile
            assert coord.apply_delta(_zero_delta(coord, 1), worker_id=1) == 2
        return 1.0, 10  # never better than the serving one: nothing pushed

    monkeypatch.setattr(gate, "mean_accept_length", scoring)
    try:
        assert coord.apply_delta(_zero_delta(coord, 0), worker_id=1) == 1
        state(pub, 0, IDLE)
        state(pub, 1, IDLE)
        assert wait_for(lambda: len(coord.acceptance) >= 2, 15), [a.drafter_version for a in coord.acceptance]
        time.sleep(1.5)  # several more gate rounds, the rollout idle
        assert [a.drafter_version for a in coord.acceptance] == [1, 2] and not pushes
    finally:
        coord.close()
        pub.close()


def test_an_evaluation_the_rollout_turned_busy_during_publishes_nothing(tmp_path, model_dir, samples,
                                                                        monkeypatch) -> None:
    """A replica that turns busy while the serving drafter is scored (after the candidate won): the push would land
    in the middle of a rollout. The evaluation is given up (EvaluationInterrupted), nothing pushed or recorded, the
    candidate still due."""
    import tlt.services.drafter.coordinator_gate as gate

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, eval_interval_s=1e9)  # the gate never fires
    calls: list[int] = []

    def scoring(drafter, held, depth, should_stop=None):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 2:  # the serving drafter's scoring: a rollout starts
            state(pub, 0, BUSY)
            assert wait_for(coord.rollout.busy, 10)
        return (2.0, 10) if len(calls) == 1 else (1.0, 10)  # the candidate wins

    monkeypatch.setattr(gate, "mean_accept_length", scoring)
    try:
        with coord._lock:
            coord.candidate_version = 1
        state(pub, 0, IDLE)
        state(pub, 1, IDLE)
        assert wait_for(coord.rollout.idle, 10)
        with pytest.raises(EvaluationInterrupted):
            coord.evaluate_and_publish()
        assert len(calls) == 2 and not pushes and coord.serving_version == 0 and not coord.acceptance
        assert coord._evaluated == 0
    finally:
        coord.close()
        pub.close()


def test_the_serving_drafter_is_scored_with_its_own_weights(tmp_path, model_dir, monkeypatch) -> None:
    """The gate compares the candidate with the serving drafter: each scored with its own weights. Scored with the
    candidate's weights on the serving side too, a candidate never beat itself, or (the serving score cached) was
    compared with an earlier candidate's score instead of the drafter the rollout serves: a worse drafter could be
    published over a better one. The scores here follow the weights loaded, not the order of the calls."""
    import tlt.services.drafter.coordinator_gate as gate

    pushes: list[int] = []
    coord = gated_coordinator(tmp_path, model_dir, lambda t, v: pushes.append(v))  # not started
    try:
        serving = {k: v + 0.5 for k, v in coord.serving.items()}  # the drafter the rollout serves: other weights
        with coord._lock:
            coord.serving, coord.serving_version, coord.candidate_version = serving, 4, 5
        key = sorted(serving)[0]
        scored: list[str] = []

        def by_weights(drafter, held, depth, should_stop=None):  # noqa: ANN001, ANN202
            is_serving = torch.equal(drafter.state_dict()[key], serving[key])
            scored.append("serving" if is_serving else "candidate")
            return (1.5 if is_serving else 2.0), 10

        monkeypatch.setattr(gate, "mean_accept_length", by_weights)
        rec = coord.evaluate_and_publish()
        assert scored == ["candidate", "serving"], scored
        assert rec is not None and rec.published and pushes == [5] and rec.serving_accept_len == 1.5
    finally:
        coord.close_sockets()


def test_features_held_through_the_rollout_are_in_the_buffer_before_the_gate_scores(tmp_path, model_dir, samples,
                                                                                 monkeypatch) -> None:
    """Under train_when = rollout_idle the intake holds the features that come while a replica decodes and parses
    them once the rollout is idle, in its own time; the gate parses them itself before it scores, so an evaluation
    that starts first still has the last rollout's held-out features. Here the intake thread is kept from getting
    there (its source's recv_frame waits until the end), so only the gate's own parse can put the held batch in:
    the scoring sees it (its `dropped_before`, which the buffer takes as the sender's count). Stand-ins: the
    feature source (a held real Envelope frame, parsed by events.decode) and, as above, the scripted scores."""
    import threading

    import tlt.services.drafter.coordinator_gate as gate
    from tlt.services.common.events import decode
    from tlt.v1 import events_pb2

    class HeldSource:
        def __init__(self) -> None:
            self.release = threading.Event()

        def recv_frame(self, timeout_s: float) -> None:
            self.release.wait()
            return None

        def parse(self, frames: list[bytes]) -> events_pb2.FeatureBatch:
            return decode(frames[0], "features").features

    seen: list[int] = []

    def scoring(drafter, held, depth, should_stop=None):  # noqa: ANN001, ANN202
        seen.append(coord.buffer.sender_dropped)
        return 1.0, 10

    monkeypatch.setattr(gate, "mean_accept_length", scoring)
    source = HeldSource()
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], features=source, train_when="rollout_idle")
    try:
        batch = events_pb2.FeatureBatch(source="rollout", sender="s1", dropped_before=7)
        coord.intake._hold([events_pb2.Envelope(features=batch).SerializeToString()])  # came while BUSY
        assert coord.apply_delta(_zero_delta(coord, 0), worker_id=1) == 1
        state(pub, 0, IDLE)
        state(pub, 1, IDLE)
        assert wait_for(lambda: seen, 15)
        assert seen[0] == 7 and not coord.intake._held
    finally:
        source.release.set()
        coord.close()
        pub.close()
