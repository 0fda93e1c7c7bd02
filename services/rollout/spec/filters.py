"""Target-distribution filters shared by plain sampling and speculative acceptance.

    logits -> / temperature -> top_k -> top_p -> min_p -> filtered logits (-inf where removed)

Speculative sampling is lossless only if acceptance uses exactly the distribution
plain decoding samples from, so both must call this one function. Parameters are
python numbers or tensors broadcastable to `logits.shape[:-1]` (one per row).
temperature must be > 0 here: greedy rows take the argmax and never come here.
top_k <= 0, top_p >= 1 and min_p <= 0 disable their filter.
"""

from __future__ import annotations

import torch

Param = float | int | torch.Tensor


def _per_row(x: Param, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=dtype, device=like.device)
    return t.expand(like.shape[:-1]).unsqueeze(-1)


def filter_logits(
    logits: torch.Tensor, temperature: Param = 1.0, top_k: Param = 0, top_p: Param = 1.0, min_p: Param = 0.0
) -> torch.Tensor:
    """Return float32 logits [..., V] after temperature, top-k, top-p and min-p (removed tokens are -inf)."""
    # T floored at 1e-30: a tinier temperature (1e-40 passes validation) overflowed logits / T to +-inf and the
    # softmax to NaN. At 1e-30 float32 logits (|x| < 3e8) stay finite and any two distinct ones already differ by
    # ~1e23 after the division: the same one-hot (ties split) as every T below it, the greedy limit.
    x = logits.float() / _per_row(temperature, logits, torch.float32).clamp(min=1e-30)
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    v = x.shape[-1]
    k = _per_row(top_k, x, torch.long)
    if bool((k > 0).any()):
        k_eff = torch.where(k > 0, k.clamp(max=v), torch.full_like(k, v))
        kth = x.sort(dim=-1, descending=True).values.gather(-1, k_eff - 1)
        x = torch.where(x < kth, neg_inf, x)
    p = _per_row(top_p, x, torch.float32)
    if bool((p < 1).any()):
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token in sorted order
        # keep the smallest prefix whose mass reaches top_p (the first always kept). Only rows with top_p < 1:
        # the float32 cumsum of a peaked row reaches 1.0 before its tail, which `before >= 1` would drop.
        drop_sorted = (before >= p) & (p < 1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = torch.where(drop, neg_inf, x)
    m = _per_row(min_p, x, torch.float32)
    if bool((m > 0).any()):
        probs = x.softmax(-1)
        x = torch.where(probs < m * probs.amax(-1, keepdim=True), neg_inf, x)
    return x


def filtered_probs(logits: torch.Tensor, temperature: Param = 1.0, top_k: Param = 0, top_p: Param = 1.0,
                   min_p: Param = 0.0) -> torch.Tensor:
    """softmax(filter_logits(...)): the distribution q that sampling draws from."""
    return filter_logits(logits, temperature, top_k, top_p, min_p).softmax(-1)
