"""The drafter loss against values computed by hand (H = 2, V = 3)."""

from __future__ import annotations

import math

import torch

from tlt.services.drafter.loss import drafter_loss

W = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # lm_head: logits = (h0, h1, 0)


def test_loss_by_hand():
    pred = torch.tensor([[[0.5, 2.0], [1.0, 0.0], [50.0, -50.0]]], requires_grad=True)
    target = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])  # the third token is a prompt token: ignored
    out = drafter_loss(pred, target, W, mask, ce_weight=0.1)
    # token 0: smooth L1 (.5*.5^2 = .125, 2 - .5 = 1.5) -> mean .8125; token 1: (|1| -> .5, 0) -> .25
    sl1 = (0.8125 + 0.25) / 2
    # token 0: target logits (0,0,0) -> p uniform; pred logits (.5, 2, 0)
    ce0 = math.log(math.exp(0.5) + math.exp(2) + 1) - (0.5 + 2 + 0) / 3
    # token 1: target logits (2,0,0) -> p = (e^2, 1, 1)/Z; pred logits (1, 0, 0)
    z = math.exp(2) + 2
    lse1 = math.log(math.e + 2)
    ce1 = -(math.exp(2) / z * (1 - lse1) + 2 / z * (0 - lse1))
    ce = (ce0 + ce1) / 2
    assert math.isclose(out.smooth_l1, sl1, rel_tol=1e-6)
    assert math.isclose(out.soft_ce, ce, rel_tol=1e-6)
    assert math.isclose(out.loss.item(), sl1 + 0.1 * ce, rel_tol=1e-6)
    # top-1: token 0 target argmax 0 (tie -> first) vs pred 1: disagree; token 1 both 0: agree
    assert out.top1 == 0.5 and out.tokens == 2
    out.loss.backward()
    assert pred.grad[0, 2].abs().sum() == 0  # masked token gets no gradient
    assert pred.grad[0, :2].abs().sum() > 0


def test_perfect_prediction_minimises_the_loss():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 4, generator=g)
    h = torch.randn(3, 5, 4, generator=g)
    perfect = drafter_loss(h.clone(), h, w)
    assert perfect.smooth_l1 == 0.0 and perfect.top1 == 1.0
    # at h' = h the soft CE equals the target's entropy (its minimum)
    p = torch.nn.functional.linear(h, w).softmax(-1)
    entropy = float(-(p * p.log()).sum(-1).mean())
    assert math.isclose(perfect.soft_ce, entropy, rel_tol=1e-5)
    worse = drafter_loss(h + 0.3 * torch.randn(h.shape, generator=g), h, w)
    assert worse.loss.item() > perfect.loss.item()
    empty = drafter_loss(h, h, w, torch.zeros(3, 5, dtype=torch.bool))
    assert empty.loss.item() == 0.0 and empty.tokens == 0


def test_the_default_ce_weight_is_tlt_md_s_one_tenth():
    # the trainers call drafter_loss without ce_weight: the default is what weighs the soft CE in every training step
    pred = torch.tensor([[0.5, 2.0], [1.0, 0.0]])
    target = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    out = drafter_loss(pred, target, W)
    assert out.soft_ce > 0.5 and math.isclose(out.loss.item(), out.smooth_l1 + 0.1 * out.soft_ce, rel_tol=1e-6)
