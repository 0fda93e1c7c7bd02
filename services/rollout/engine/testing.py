"""Random checkpoints for engine tests and `tlt bench engine` (no downloads).

`random_checkpoint(out_dir, ...)` writes a Hugging Face folder (config.json,
generation_config.json, model.safetensors, tokenizer files) of a randomly
initialised Qwen2 model with the task tokenizer, loadable by `transformers`
and by the native loader alike. Defaults are the shape of the `tiny` preset.
"""

from __future__ import annotations

from pathlib import Path

import torch


def random_checkpoint(
    out_dir: str | Path,
    *,
    hidden_size: int = 192,
    intermediate_size: int = 512,
    num_layers: int = 12,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    weight_scale: float = 0.0,
) -> Path:
    """Save a random Qwen2 checkpoint with the task tokenizer; weight_scale > 0 adds N(0, s) to every weight."""
    import transformers

    from tlt.model.tokenizer import test_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = test_tokenizer()
    cfg = transformers.Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    if weight_scale > 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * weight_scale)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
