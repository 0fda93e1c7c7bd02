"""A KV cache too small for one full-length sequence is named at start, not first by a refused request.

With `--set engine.kv_cache_mb=1` (7 blocks of 16 tokens for max_model_len 1024) the server started silently, then
refused every chat request without max_tokens, blaming a max_tokens the user never sent. vLLM refuses to start in
this case; the engine warns once (tests use tiny caches on purpose), naming the sizes and the setting to raise.
The real engine on a tiny random checkpoint; structlog's capture_logs reads the events.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from tlt.model.testing import random_checkpoint
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("kv") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256)


def _warnings(ckpt, **settings):
    with capture_logs() as logs:
        engine = LLMEngine(ckpt, EngineConfig(max_model_len=256, block_size=16, **settings))
    return engine, [e for e in logs if e["log_level"] == "warning" and e["event"] == "kv_cache_short"]


def test_a_cache_short_of_one_sequence_is_named_with_the_setting_to_raise(ckpt):
    engine, warned = _warnings(ckpt, num_kv_blocks=7)
    assert len(warned) == 1
    w = warned[0]
    assert (w["kv_blocks"], w["block_size"], w["kv_tokens"], w["max_model_len"]) == (7, 16, 112, 256)
    assert "num_kv_blocks" in w["hint"] and "16" in w["hint"]  # 256 / 16 blocks are needed
    assert engine.block_manager.num_blocks == 7  # a warning, not a refusal

    # from the memory budget: the setting named is kv_cache_mb, with the size that would do
    per_block_mb = 2 * 2 * 16 * 2 * 16 * 4 / 2**20  # K and V x layers x block_size x kv heads x head_dim x fp32
    _, warned = _warnings(ckpt, kv_cache_mb=per_block_mb * 3)
    assert len(warned) == 1 and warned[0]["kv_blocks"] == 3 and "kv_cache_mb" in warned[0]["hint"]


def test_a_cache_that_holds_a_full_sequence_says_nothing(ckpt):
    for settings in ({"num_kv_blocks": 16}, {"kv_cache_mb": 4.0}):
        _, warned = _warnings(ckpt, **settings)
        assert warned == [], settings
