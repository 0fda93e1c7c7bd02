"""Named model presets: Qwen2-architecture configs (GQA, qkv bias, RMSNorm, RoPE, SwiGLU) plus training budgets.

`tiny` is deep and narrow on purpose: the EAGLE drafter is one decoder layer
plus an fc of 2H x H, and with 12 target layers it costs about 1/8 of a
target forward (see `drafter_cost_ratio`: 0.115). Its pre-training is a fixed
720 steps of 2 x 320 packed tokens (461k tokens; fixed so the model is the
same on any machine): 192 s at the 2,404 tokens/s two idle cores gave with
libgomp's default OpenMP wait (the CLI no longer forces a passive wait on the
build; passive, the same machine gave 1,432 tokens/s); `time_budget_s` (265 s,
so the build stays under 5 minutes) is only a safety stop for a slower or busy
machine (below ~1,740 tokens/s). lr 1e-3: at 3e-3 the model stalls
at loss ~1.2-1.6 and stays at chance. `small` is the
same recipe sized for one GPU (not run yet).

Each preset is a plain dict with two parts: `model` (keyword arguments of
`transformers.Qwen2Config`, vocab_size filled in from the tokenizer) and
`train` (the pre-training budget read by `tlt model build`).
"""

from __future__ import annotations

from typing import Any

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {
            "hidden_size": 192,
            "intermediate_size": 384,
            "num_hidden_layers": 12,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        "train": {
            "seq_len": 320,
            "batch_size": 2,
            "lr": 1e-3,
            "min_lr_ratio": 0.1,
            "warmup_steps": 40,
            "weight_decay": 0.1,
            "max_steps": 720,
            "time_budget_s": 265.0,
            "threads": 2,
        },
    },
    "small": {
        "model": {
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 16,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        "train": {
            "seq_len": 512,
            "batch_size": 64,
            "lr": 1e-3,
            "min_lr_ratio": 0.1,
            "warmup_steps": 100,
            "weight_decay": 0.1,
            "max_steps": 6000,
            "time_budget_s": 1800.0,
            "threads": 8,
        },
    },
}


def layer_params(hidden: int, intermediate: int, heads: int, kv_heads: int) -> int:
    """Weights of one Qwen2 decoder layer (attention with qkv bias, SwiGLU MLP, two RMSNorms)."""
    head_dim = hidden // heads
    q = hidden * hidden + hidden
    kv = 2 * (hidden * kv_heads * head_dim + kv_heads * head_dim)
    o = hidden * hidden
    mlp = 3 * hidden * intermediate
    return q + kv + o + mlp + 2 * hidden


def drafter_cost_ratio(preset: str, vocab_size: int = 320) -> float:
    """Weights read by one drafter step (fc 2H x H + one layer + lm_head) over one target step (N layers + lm_head)."""
    m = MODEL_PRESETS[preset]["model"]
    h = m["hidden_size"]
    layer = layer_params(h, m["intermediate_size"], m["num_attention_heads"], m["num_key_value_heads"])
    head = h * vocab_size
    return (2 * h * h + layer + head) / (m["num_hidden_layers"] * layer + head)
