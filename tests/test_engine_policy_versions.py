"""A completion's policy versions when weights are pushed while it generates: the engine accepts any integer
version (a rollback pushes a lower one), and the completion says the oldest and the newest version among the
steps that ran it (Versions.policy_min .. Versions.policy), not the first and the last pushed."""

from __future__ import annotations

import pytest
import torch

from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = random_checkpoint(tmp_path_factory.mktemp("versions") / "m", hidden_size=32, intermediate_size=64,
                             num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=64, seed=2,
                             weight_scale=0.05)
    return LLMEngine(ckpt, EngineConfig(block_size=4))


@pytest.mark.parametrize("pushes, oldest, newest", [((5, 3, 4), 3, 5), ((5, 7, 6), 5, 7), ((4, 4, 2), 2, 4)])
def test_versions_pushed_mid_request_out_of_order_give_the_oldest_and_the_newest(engine, pushes, oldest, newest):
    norm = engine.expected_weights()["model.norm.weight"][0]
    push = lambda v: engine.update_weights("policy", {"model.norm.weight": torch.full(norm, 1.0 + v / 100)}, v)
    push(pushes[0])  # before the request: its first step runs under pushes[0]
    engine.add_request(GenerationRequest(f"r{pushes}", tuple(range(3, 10)), GREEDY))
    done = []
    for v in pushes[1:]:  # a step under each version, the request still running as the next is pushed
        assert not engine.step()[1] and engine.has_unfinished()
        push(v)
    while engine.has_unfinished():
        done += engine.step()[1]
    assert len(done) == 1 and len(done[0].token_ids) == GREEDY.max_tokens
    assert (done[0].versions.policy_min, done[0].versions.policy) == (oldest, newest)


def test_record_version_keeps_the_range_over_any_order():
    s = Sequence("r", 0, (1, 2, 3), GREEDY, 4, 0, frozenset())
    assert s.policy_versions is None
    for v, seen in ((5, (5, 5)), (3, (3, 5)), (4, (3, 5)), (9, (3, 9)), (-1, (-1, 9))):
        s.record_version(v)
        assert s.policy_versions == seen
