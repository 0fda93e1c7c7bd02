"""Randomly initialised checkpoints with the task tokenizer, for tests of servers and engines.

    path = random_checkpoint(tmp_path / "m", family="qwen2", num_hidden_layers=2)

writes a standard Hugging Face folder (config.json, generation_config.json,
model.safetensors, tokenizer files with the ChatML template) in about a
second. Weights are seeded, so two calls with the same arguments give the
same bytes. Families: `qwen2`, `qwen3`, `llama` (transformers' own configs);
sizes are small by default and any config field can be overridden.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

FAMILIES = ("qwen2", "qwen3", "llama")


def pad_vocab(n: int, multiple: int = 64) -> int:
    """Embedding rows: the tokenizer's size rounded up (spare rows are never produced by the tokenizer)."""
    return -(-n // multiple) * multiple


def config_for(family: str, vocab_size: int, eos_token_id: int, pad_token_id: int, **overrides: Any):
    """A transformers config of `family` with the small defaults, the task's special ids and `overrides`."""
    import transformers

    kw = {**_SMALL, **overrides}
    if family == "qwen2":
        cls = transformers.Qwen2Config
    elif family == "qwen3":
        cls = transformers.Qwen3Config
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    elif family == "llama":
        cls = transformers.LlamaConfig
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    return cls(
        vocab_size=vocab_size, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kw
    )


def random_checkpoint(out_dir: str | Path, family: str = "qwen2", seed: int = 0, **config_overrides: Any) -> Path:
    """Write a seeded random checkpoint of `family` with the task tokenizer into out_dir; return its path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tlt.model.tokenizer import build_tokenizer

    out = Path(out_dir)
    tokenizer = build_tokenizer(out, seed=0)
    config = config_for(
        family, pad_vocab(len(tokenizer)), tokenizer.eos_token_id, tokenizer.pad_token_id, **config_overrides
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    return out
