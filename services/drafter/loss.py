"""The drafter loss (EAGLE-2 style), a pure function of tensors.

    loss = SmoothL1(h', h) + ce_weight * CE(softmax(lm_head(h)), log_softmax(lm_head(h')))

h' is the drafter's predicted feature, h the target's true next feature (post final norm), both
[..., H]. SmoothL1 (beta 1) is averaged over the hidden dimension per token; the soft cross-entropy
uses the target's own distribution lm_head(h) (no gradient) as the label, so the drafter learns the
target's distribution, not the sampled token. Both terms are averaged over the tokens where `mask`
is True (response tokens). Metric: top-1 agreement, the fraction of masked tokens where the drafter's
argmax equals the target's, a cheap proxy for greedy acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DrafterLoss:
    loss: torch.Tensor  # scalar, differentiable w.r.t. pred_h
    smooth_l1: float
    soft_ce: float
    top1: float  # drafter argmax == target argmax, over masked tokens
    tokens: int


def drafter_loss(
    pred_h: torch.Tensor,
    target_h: torch.Tensor,
    lm_head_weight: torch.Tensor,
    mask: torch.Tensor | None = None,
    ce_weight: float = 0.1,
) -> DrafterLoss:
    """pred_h, target_h [..., H]; lm_head_weight [V, H]; mask [...] bool (None: every token)."""
    if pred_h.shape != target_h.shape:
        raise ValueError(f"pred_h {tuple(pred_h.shape)} and target_h {tuple(target_h.shape)} differ")
    m = torch.ones(pred_h.shape[:-1], dtype=torch.bool, device=pred_h.device) if mask is None else mask.bool()
    w = m.to(torch.float32)
    n = w.sum().clamp(min=1.0)
    target_h = target_h.detach().to(pred_h.dtype)
    sl1 = F.smooth_l1_loss(pred_h.float(), target_h.float(), reduction="none", beta=1.0).mean(-1)
    lm = lm_head_weight.detach()
    pred_logits = F.linear(pred_h, lm.to(pred_h.dtype)).float()
    with torch.no_grad():
        tgt_logits = F.linear(target_h, lm.to(target_h.dtype)).float()
        p = tgt_logits.softmax(-1)
    ce = -(p * pred_logits.log_softmax(-1)).sum(-1)
    sl1_mean = (sl1 * w).sum() / n
    ce_mean = (ce * w).sum() / n
    loss = sl1_mean + ce_weight * ce_mean
    with torch.no_grad():
        agree = (pred_logits.argmax(-1) == tgt_logits.argmax(-1)).float()
        top1 = float((agree * w).sum() / n)
    return DrafterLoss(loss, float(sl1_mean.detach()), float(ce_mean.detach()), top1, int(m.sum()))
