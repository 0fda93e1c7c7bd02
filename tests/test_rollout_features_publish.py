"""What FeaturePublisher (services/rollout/features.py) sends the drafter for finished sequences.

Real parts: a FeaturePuller bound on 127.0.0.1 (an ephemeral port) and the publisher's PUSH socket, under the
suite's control token; the finished sequences are built here as the engine hands them over (features a
[tokens, hidden] tensor). The model-driven path is in test_drafter_rollout_events.py; these pin the cuts.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tlt.services.common.events import FeaturePuller
from tlt.services.rollout.features import FeaturePublisher
from tlt.services.rollout.types import CompletionOutput, FinishReason, Versions

HIDDEN = 4


def _finished(request_id: str, tokens: int, policy: int = 1, policy_min: int | None = None) -> CompletionOutput:
    return CompletionOutput(
        request_id=request_id, sample_index=0, prompt_token_ids=[5, 6], token_ids=list(range(100, 100 + tokens)),
        text="", finish_reason=next(iter(FinishReason)), versions=Versions(policy=policy, policy_min=policy_min),
        features=torch.arange(tokens * HIDDEN, dtype=torch.float32).reshape(tokens, HIDDEN))


def _wired(max_tokens: int) -> Iterator[tuple[FeaturePublisher, FeaturePuller]]:
    with FeaturePuller("tcp://127.0.0.1:*") as puller:
        publisher = FeaturePublisher(puller.endpoint, replica_id=3, max_tokens=max_tokens)
        try:
            assert publisher.pusher.wait_connected(10), "the PUSH socket never connected"
            yield publisher, puller
        finally:
            publisher.close()


@pytest.fixture
def wired() -> Iterator[tuple[FeaturePublisher, FeaturePuller]]:
    yield from _wired(max_tokens=4096)


@pytest.fixture
def capped() -> Iterator[tuple[FeaturePublisher, FeaturePuller]]:
    yield from _wired(max_tokens=4)


def test_a_long_sequence_is_cut_to_max_tokens_rows(capped) -> None:
    publisher, puller = capped
    assert publisher.publish([_finished("r", 10)], policy_version=1)
    batch = puller.recv(5.0)
    assert batch is not None and len(batch.sequences) == 1
    seq = batch.sequences[0]
    rows = np.frombuffer(seq.features, dtype=np.float16).reshape(-1, HIDDEN)
    assert list(seq.token_ids) == [6, 100, 101, 102] and rows.shape == (4, HIDDEN)  # [p_last, r_0 .. r_2]
    assert rows[3, 0] == 12.0  # the state at r_2, row 3 of the engine's


def test_a_sequence_spanning_two_policy_pushes_is_cut_at_the_first(wired) -> None:
    """Rows after the first push are new weights over old K/V; a second push must not move the cut (or its tag) on,
    and a mixed-version sequence with no record of where is not sent at all rather than sent mislabelled."""
    publisher, puller = wired
    publisher.policy_changed(1, [("r", 0, 3)])
    publisher.policy_changed(2, [("r", 0, 6)])
    assert publisher.publish([_finished("r", 8, policy=3, policy_min=1)], policy_version=3)
    batch = puller.recv(5.0)
    assert batch is not None and len(batch.sequences) == 1
    seq = batch.sequences[0]
    assert (list(seq.token_ids), seq.policy_version) == ([6, 100, 101], 1)
    assert not publisher.publish([_finished("unrecorded", 8, policy=3, policy_min=2)], policy_version=3)
    assert puller.recv(0.3) is None


def test_a_one_token_sequence_is_not_sent(wired) -> None:
    """One emitted token leaves one row, the state at p_last, with no next token in the sequence to train it on."""
    publisher, puller = wired
    assert not publisher.publish([_finished("short", 1)], policy_version=1)
    assert publisher.publish([_finished("short2", 2)], policy_version=1)
    batch = puller.recv(5.0)
    assert batch is not None and [list(s.token_ids) for s in batch.sequences] == [[6, 100]]
