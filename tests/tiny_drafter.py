"""A tiny random EAGLE drafter built in code (hidden 32, vocab 40), shared by the drafter runtime, graph and
training-time-test tests: non-trivial norm weights and biases, its own random embedding and lm_head."""

from __future__ import annotations

import torch

from tlt.model.drafter import Drafter, DrafterConfig

H, V = 32, 40


def tiny_config(**overrides) -> DrafterConfig:  # noqa: ANN003
    """The tiny drafter's config (hidden H, vocab V, 4 heads over 2 K/V heads), with any field overridden."""
    return DrafterConfig(**{**dict(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                                   vocab_size=V), **overrides})


def random_drafter(seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    cfg = tiny_config()
    d = Drafter(cfg, torch.randn(V, H), torch.randn(V, H))
    for p in d.parameters():  # non-trivial norm weight and biases
        p.data.add_(torch.randn_like(p) * 0.1)
    return d.eval()
