"""GRPO maths against values computed by hand (derivations in the comments).

Nothing is faked: these are the pure tensor functions of services/trainer/grpo.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from tlt.services.trainer.grpo import entropy_from_logits, group_advantages, kl_k3, masked_mean, policy_loss


def test_group_advantages_by_hand():
    # group 0: [1, 0, 0, 1]: mean 0.5, deviations +-0.5, sum of squares 1, var = 1/3,
    #          std = 0.577350 -> A = +-0.5 / 0.577350 = +-0.866025
    # group 1: [2, 2, 2, 2]: no signal -> exactly 0 (not NaN)
    # group 2: [0, 0, 0, 3]: mean 0.75, sum of squares 3*0.5625 + 2.25^2 = 6.75,
    #          var = 2.25, std = 1.5 -> A = [-0.5, -0.5, -0.5, 1.5]
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    a = group_advantages(r, eps=1e-6)
    expected = torch.tensor(
        [[0.866025, -0.866025, -0.866025, 0.866025], [0.0, 0.0, 0.0, 0.0], [-0.5, -0.5, -0.5, 1.5]]
    )
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=0)
    assert torch.isfinite(a).all()
    assert (a[1] == 0).all()


def test_group_advantages_flat_matches_grouped_and_dr_grpo():
    r = torch.tensor([0.0, 0.0, 0.0, 3.0, 5.0, 5.0])
    a = group_advantages(r, group_size=3)
    # group [0, 0, 0]: all equal -> 0; group [3, 5, 5]: mean 13/3, deviations [-4/3, 2/3, 2/3],
    # sum of squares 16/9 + 4/9 + 4/9 = 24/9, var = 12/9, std = 1.154701
    # -> A = [-1.154701, 0.577350, 0.577350]
    torch.testing.assert_close(a, torch.tensor([0.0, 0.0, 0.0, -1.154701, 0.577350, 0.577350]), atol=1e-5, rtol=0)
    # Dr. GRPO: centred only.
    d = group_advantages(r, group_size=3, scale_by_std=False)
    torch.testing.assert_close(d, torch.tensor([0.0, 0.0, 0.0, -4 / 3, 2 / 3, 2 / 3]), atol=1e-6, rtol=0)


def test_group_advantages_all_equal_inexact_rewards_are_exactly_zero():
    # Rewards like 0.7 (partial credit) or 1000.3 are not exact in float32: the group mean of n equal
    # values rounds, leaving centred values of ~1 ulp and a std of ~1 ulp, and ulp / (ulp + eps) is
    # O(1) for large rewards (0.92 for 1000.3 at n = 8). An all-equal group carries no signal: exactly 0.
    for value in (0.1, 0.7, 1000.3, 12345.678):
        for n in (3, 7, 8, 16):
            r = torch.full((2, n), value)
            r[1, 0] = value + 1.0  # a group with signal beside it keeps its advantages
            a = group_advantages(r)
            assert (a[0] == 0).all(), (value, n, a[0])
            assert (group_advantages(r, scale_by_std=False)[0] == 0).all(), (value, n)
            assert a[1, 0] > 0.9 and (a[1, 1:] < 0).all()
            flat = group_advantages(r.reshape(-1), group_size=n)
            assert (flat[:n] == 0).all()


def test_group_advantages_single_sample_and_bad_shapes():
    assert (group_advantages(torch.tensor([[3.0], [1.0]])) == 0).all()
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=2)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2, 2))


def _policy_case():
    # seq 0: A = +1, ratios [1.5, 1.0, (pad)]; seq 1: A = -2, ratios [0.5, 0.9, 1.1]
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ratios = torch.tensor([[1.5, 1.0, 1.0], [0.5, 0.9, 1.1]])
    logp = (old + torch.log(ratios)).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    return logp, old, adv, mask


def test_policy_loss_by_hand():
    logp, old, adv, mask = _policy_case()
    out = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # per token l = max(-A*ratio, -A*clip(ratio, 0.8, 1.2)):
    #   seq0 t0: max(-1.5, -1.2) = -1.2 (clipped)   seq0 t1: max(-1, -1) = -1
    #   seq1 t0: max(1.0, 1.6)   =  1.6 (clipped)   seq1 t1: 1.8   seq1 t2: 2.2
    # token mean over 5 tokens: (-1.2 - 1 + 1.6 + 1.8 + 2.2) / 5 = 3.4 / 5 = 0.68
    assert out.loss.item() == pytest.approx(0.68, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(2 / 5, abs=1e-6)
    # approx KL(old || new) per token, k3 on tokens sampled from old: ratio - 1 - ln(ratio)
    #   1.5: 0.094535   1.0: 0   0.5: 0.193147   0.9: 0.005361   1.1: 0.004690 -> mean 0.059547
    assert out.approx_kl.item() == pytest.approx(0.059547, abs=1e-5)
    assert out.ratio_mean.item() == pytest.approx((1.5 + 1.0 + 0.5 + 0.9 + 1.1) / 5, abs=1e-6)
    # gradient d l / d logp = -A * ratio / 5 where unclipped, 0 where clipped or padding:
    #   seq0: [0, -0.2, 0]; seq1: [0, 2*0.9/5, 2*1.1/5] = [0, 0.36, 0.44]
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.2, 0.0], [0.0, 0.36, 0.44]]), atol=1e-6, rtol=0)


def test_policy_loss_num_tokens_and_asymmetric_clip():
    logp, old, adv, mask = _policy_case()
    # dividing by the whole mini-batch's tokens (10) instead of this micro-batch's (5) halves the loss
    assert policy_loss(logp, old, adv, mask, num_tokens=10).loss.item() == pytest.approx(0.34, abs=1e-6)
    # clip_high 0.6: seq0 t0 ratio 1.5 is inside [0.8, 1.6] -> -1.5 instead of -1.2: (3.4 - 0.3) / 5 = 0.62
    out = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)
    assert out.loss.item() == pytest.approx(0.62, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(1 / 5, abs=1e-6)


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    # ratio 1 everywhere: loss = -sum(A * tokens) / tokens = -(1*2 + (-2)*3) / 5 = 0.8
    _, old, adv, mask = _policy_case()
    out = policy_loss(old.clone(), old, adv, mask)
    assert out.loss.item() == pytest.approx(0.8, abs=1e-6)
    assert out.clip_fraction.item() == 0.0 and out.approx_kl.item() == 0.0


def test_kl_k3_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    k = kl_k3(logp, ref, mask)
    # r = ref - logp = [0, 0.5, (masked)]; k3 = e^r - r - 1 = [0, 1.648721 - 1.5, 0] = [0, 0.148721, 0]
    torch.testing.assert_close(k, torch.tensor([[0.0, 0.148721, 0.0]]), atol=1e-6, rtol=0)
    assert masked_mean(k, mask).item() == pytest.approx(0.148721 / 2, abs=1e-6)
    # d k3 / d logp = -(e^r - 1) = [0, -0.648721, 0]
    k.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.648721, 0.0]]), atol=1e-6, rtol=0)
    # never negative
    assert (kl_k3(torch.randn(4, 7), torch.randn(4, 7), torch.ones(4, 7)) >= 0).all()


def test_entropy_from_logits_by_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9], [5.0, 1.0, 2.0, 3.0]]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    h = entropy_from_logits(logits, mask)
    # uniform over 4: ln 4 = 1.386294
    # p = [0.25, 0.75] (the -1e9 entries have probability 0): -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    # third position masked -> 0
    torch.testing.assert_close(h, torch.tensor([[1.386294, 0.562335, 0.0]]), atol=1e-5, rtol=0)


def test_policy_loss_approx_kl_estimates_kl_old_to_new_under_old_samples():
    # Tokens of a rollout are drawn from pi_old: the logged approx_kl must average to KL(old || new).
    # Exact expectation over a 50-way categorical (no sampling noise): the swapped estimator gives 0.326 here.
    g = torch.Generator().manual_seed(0)
    old = torch.log_softmax(torch.randn(50, generator=g), 0)
    new = torch.log_softmax(old + 0.8 * torch.randn(50, generator=g), 0)
    exact = float((old.exp() * (old - new)).sum())
    weights = old.exp().unsqueeze(0)  # each token weighted by its probability under pi_old
    out = policy_loss(new.unsqueeze(0), old.unsqueeze(0), torch.zeros(1), torch.ones(1, 50))
    per_token = kl_k3(old.unsqueeze(0), new.unsqueeze(0), torch.ones(1, 50))
    assert float((per_token * weights).sum()) == pytest.approx(exact, rel=1e-4)
    # and policy_loss's metric is that estimator (its plain mean over these 50 tokens)
    assert out.approx_kl.item() == pytest.approx(float(per_token.mean()), rel=1e-5)


def test_policy_loss_huge_log_ratio_stays_finite():
    # A stale or mismatched old logprob can put the log-ratio at +100: e^100 overflows float32 to inf,
    # and with A < 0 the loss -A * ratio is inf and the gradients NaN. The log-ratio is clamped to
    # [-20, 20] first, so that token's surrogate is -A * e^20 and the clamp passes it no gradient.
    old = torch.tensor([[-1.0, -1.0, -101.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)  # log-ratios [0, 0, +100]
    mask = torch.ones(1, 3)
    adv = torch.tensor([-2.0])
    out = policy_loss(logp, old, adv, mask)
    assert torch.isfinite(out.loss)
    # tokens 0, 1: ratio 1 -> max(2, 2) = 2 each; token 2: max(2 e^20, 2 * 1.2) = 2 e^20; mean over 3
    assert out.loss.item() == pytest.approx((2.0 + 2.0 + 2.0 * math.exp(20.0)) / 3, rel=1e-6)
    assert torch.isfinite(out.approx_kl) and torch.isfinite(out.ratio_mean)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    # d l / d logp = -A * ratio / 3 = 2/3 on the two in-range tokens; 0 on the clamped one
    torch.testing.assert_close(logp.grad, torch.tensor([[2 / 3, 2 / 3, 0.0]]), atol=1e-6, rtol=0)


def test_policy_loss_huge_log_ratio_on_padding_is_ignored():
    # Padding positions hold arbitrary logprobs: inf * 0 would be NaN, a clamped value * 0 is 0.
    _, old, adv, mask = _policy_case()
    logp = old.clone()
    logp[0, 2] = old[0, 2] + 100.0  # seq 0's padding token
    logp.requires_grad_(True)
    out = policy_loss(logp, old, adv, mask)
    assert out.loss.item() == pytest.approx(0.8, abs=1e-6)  # as on-policy: padding contributes nothing
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_policy_loss_in_range_is_bit_identical_to_unclamped_formula():
    # The clamp must not move any normal-range value: compare with the plain formula, exactly.
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 9, generator=g) * 5
    logp = old + torch.randn(4, 9, generator=g) * 2  # log-ratios mostly within +-6
    adv = torch.randn(4, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.2).float()
    ratio = torch.exp(logp - old)
    a = adv.unsqueeze(1)
    per_token = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
    expected = (per_token * mask).sum() / mask.sum()
    assert torch.equal(policy_loss(logp, old, adv, mask).loss, expected)
    r = old - logp
    assert torch.equal(kl_k3(logp, old, mask), (torch.exp(r) - r - 1.0) * mask)


def test_kl_k3_huge_exponent_stays_finite():
    # r = ref - logp = +100 (the policy gives a token e^-100 of the reference's probability): e^r is
    # inf in float32. The exponent is clamped to [-20, 20]; its gradient there is 0, not NaN.
    logp = torch.tensor([[-101.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5, -101.0]])  # r = [+100, -0.5, -100]
    mask = torch.ones(1, 3)
    k = kl_k3(logp, ref, mask)
    assert torch.isfinite(k).all()
    # r = +100 -> clamped 20: e^20 - 21; r = -0.5: e^-0.5 - 0.5 = 0.106531; r = -100 -> -20: e^-20 + 19
    expected = torch.tensor([[math.exp(20.0) - 21.0, math.exp(-0.5) - 0.5, math.exp(-20.0) + 19.0]])
    torch.testing.assert_close(k, expected, rtol=1e-6, atol=1e-6)
    k.sum().backward()
    assert torch.isfinite(logp.grad).all()
    # d k3 / d logp = -(e^r - 1) inside the clamp, 0 outside
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.0 - math.exp(-0.5), 0.0]]), atol=1e-6, rtol=0)


def test_group_advantages_eps_keeps_a_tiny_spread_from_being_blown_up():
    # group [0, 1e-6]: mean 5e-7, deviations +-5e-7, std (n - 1) = 5e-7 * sqrt(2) = 7.0711e-7
    # A = +-5e-7 / (7.0711e-7 + 1e-6) = +-0.292893 (without eps it would be +-0.707107 whatever the scale)
    a = group_advantages(torch.tensor([[0.0, 1e-6]]), eps=1e-6)
    torch.testing.assert_close(a, torch.tensor([[-0.292893, 0.292893]]), atol=1e-4, rtol=0)


def test_masked_mean_and_policy_loss_of_an_all_padding_batch_are_zero_not_nan():
    # a micro-batch whose mask is all zero (every response empty) contributes 0, not 0 / 0 = NaN
    assert masked_mean(torch.ones(2, 3), torch.zeros(2, 3)).item() == 0.0
    logp, old, adv, _ = _policy_case()
    out = policy_loss(logp, old, adv, torch.zeros(2, 3))
    assert out.loss.item() == 0.0 and out.clip_fraction.item() == 0.0
    assert out.approx_kl.item() == 0.0 and out.ratio_mean.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_policy_loss_diagnostics_are_means_over_the_micro_batch_whatever_num_tokens():
    # num_tokens scales the LOSS for gradient accumulation; the diagnostics stay token means over `mask`
    logp, old, adv, mask = _policy_case()
    out = policy_loss(logp, old, adv, mask, num_tokens=10)
    assert out.loss.item() == pytest.approx(0.34, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(2 / 5, abs=1e-6)
    assert out.ratio_mean.item() == pytest.approx((1.5 + 1.0 + 0.5 + 0.9 + 1.1) / 5, abs=1e-6)
    assert out.approx_kl.item() == pytest.approx(0.059547, abs=1e-5)
