"""The presets' cost arithmetic (tlt/model/presets.py) against the real transformers modules it counts."""

from __future__ import annotations

import pytest
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from tlt.model.presets import MODEL_PRESETS, drafter_cost_ratio, layer_params


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_layer_params_counts_a_real_qwen2_layer(preset):
    """layer_params is the weight count of one Qwen2 decoder layer (q, k and v with their biases, o, the SwiGLU MLP,
    two RMSNorms): the drafter's cost ratio (docs: 0.115 for tiny) is read off it, so a term left out (the k/v
    biases) skewed what `tiny`'s design argues from."""
    m = MODEL_PRESETS[preset]["model"]
    cfg = Qwen2Config(vocab_size=320, **m)
    real = sum(p.numel() for p in Qwen2DecoderLayer(cfg, 0).parameters())
    assert layer_params(m["hidden_size"], m["intermediate_size"], m["num_attention_heads"],
                        m["num_key_value_heads"]) == real
    assert round(drafter_cost_ratio("tiny"), 3) == 0.115
