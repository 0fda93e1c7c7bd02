"""Shared by tests/test_spec_decoder.py and tests/test_spec_decoder_bandit.py: SpecDecoder inside the native
engine on a tiny random Qwen2 checkpoint (built in code, no downloads), driven by the engine's own step."""

from __future__ import annotations

import pytest
import torch

from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return random_checkpoint(tmp_path_factory.mktemp("ckpt"), hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, max_position_embeddings=256, weight_scale=0.02)


def _engine(ckpt, blocks=64):
    return LLMEngine(ckpt, EngineConfig(num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=256))


def _spec_generate(engine, decoder, requests, observe=True):
    """Generate through the engine's own step with `decoder` attached (observe=False: the plain steps'
    features are not passed on, as with an engine that does not call observe_plain)."""
    engine.spec_decoder = decoder
    engine.scheduler.on_release = decoder.release
    if not observe:
        decoder.observe_plain = lambda seqs, hidden: None
    return engine.generate(requests)


def _requests(n_req=3, n=2, max_tokens=40):
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return [GenerationRequest(f"r{i}", tuple(torch.randint(3, 60, (5 + 3 * i,), generator=g).tolist()), params, n)
            for i in range(n_req)]


SPEC = dict(mode="adaptive", threshold=8, hysteresis_steps=2, bucket_thresholds=(1, 3),
            bucket_arms=(("4_2_8", "3_1_4"), ("3_2_6", "2_1_3")))
STATIC = dict(SPEC, mode="static", static_arm="4_2_8")  # deterministic trees for figures we assert on
