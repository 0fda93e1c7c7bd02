"""GRPO maths as pure tensor functions: advantages, PPO-clip loss, k3 KL, entropy.

Nothing here knows about models, DeepSpeed or the network; every function
takes tensors and returns tensors, so each can be checked against values
computed by hand (tests/test_grpo.py).

Shapes: B sequences, T response positions. `mask` is 1.0 on real response
tokens and 0.0 on padding. Per-token outputs are zero outside the mask.

Deliberate choices (and departures from the original GRPO paper):
- Token-mean aggregation (DAPO / Dr. GRPO) by default: the loss is the mean
  over every response token of the mini-batch, not a mean of per-sequence
  means, so long responses are not down-weighted. `num_tokens` lets a
  micro-batch divide by the whole mini-batch's token count, making gradient
  accumulation exact. `aggregate` also offers the original GRPO paper's
  seq-mean-token-mean and Dr. GRPO's seq-mean-token-sum-norm (a sum over each
  sequence's tokens divided by a constant), with `num_seqs` playing the part
  of `num_tokens` (exact accumulation over a mini-batch's sequences).
- Leave-one-out baselines (RLOO) beside the group-normalised ones.
- Asymmetric clipping is allowed (clip_low, clip_high: DAPO's clip-higher).
- `scale_by_std=False` is Dr. GRPO: advantages are only centred per group.
- Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp
  (as verl does), in the PPO ratio and in k3, so a stale or mismatched
  logprob cannot overflow to inf and turn the gradients into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# exp(20) = 4.85e8: finite in float32/bf16, and no in-range ratio (|log-ratio| < 20) is touched.
LOG_RATIO_CLAMP = 20.0

# [trainer] loss_agg's values (config.py spells them as a Literal).
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def flat_groups(grouped: torch.Tensor) -> torch.Tensor:
    """[G, 1] of [G, n] rewards: the groups whose rewards are all equal in float32, as dynamic sampling judges them
    (`informative`), whatever precision the statistics run in: 0.1 + 0.2 and 0.3 are one reward (no signal)."""
    g = grouped.float()
    return g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)


def _grouped(rewards: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[G, n] rewards from [G, n], or from flat [G*n] with `group_size=n` (a group's samples adjacent): float32, or
    float64 when given float64 (the step's: near float32's limit its mean and std overflow)."""
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    if rewards.dim() == 1:
        if group_size is None or group_size < 1 or rewards.numel() % group_size:
            raise ValueError(f"flat rewards of length {rewards.numel()} need group_size dividing it, got {group_size}")
        return rewards.reshape(-1, group_size).to(dtype)
    if rewards.dim() == 2:
        return rewards.to(dtype)
    raise ValueError(f"rewards must be [G, n] or [G*n], got shape {tuple(rewards.shape)}")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> torch.Tensor:
    """Normalise rewards within each prompt's group of samples.

    rewards: [G, n] (G prompts x n samples) or flat [G*n] with `group_size=n`
    (samples of one prompt adjacent). Returns advantages of the same shape:

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)   (scale_by_std)
        A_i =  r_i - mean(r_group)                           (Dr. GRPO)

    std is the sample standard deviation (Bessel, n - 1), as in the GRPO
    reference implementations. A group whose rewards are all equal carries no
    signal: its advantages are exactly 0 (0 / (0 + eps)), never NaN. A group
    of one sample also gets 0 (its std is undefined).
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        n = grouped.shape[1]
        if n < 2:
            return torch.zeros_like(rewards, dtype=torch.float32)
        std = grouped.std(dim=1, keepdim=True, unbiased=True)
        centred = centred / (std + eps)
    # The mean of equal values rounds (0.7 x 8 in float32), leaving ~1 ulp centred and ~1 ulp std:
    # ulp / (ulp + eps) is O(1) for large rewards. An all-equal group is set to exactly 0.
    equal = flat_groups(grouped)
    centred = centred.masked_fill(equal, 0.0)
    return centred.reshape(rewards.shape)


def rloo_advantages(rewards: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """REINFORCE leave-one-out (RLOO, Ahmadian et al. 2024): each sample's baseline is the mean reward of the
    other n - 1 samples of its group.

    rewards: [G, n] or flat [G*n] with `group_size=n`, as for `group_advantages`. Returns the same shape:

        A_i = r_i - (sum_j r_j - r_i) / (n - 1)   (= n / (n - 1) * (r_i - mean(r_group)))

    No division by the group std (verl's RLOO has none either). A group of one sample has no other sample:
    0 (verl leaves it at r_i). A group whose rewards are all equal is exactly 0, as in `group_advantages`.
    """
    grouped = _grouped(rewards, group_size)
    n = grouped.shape[1]
    if n < 2:
        return torch.zeros_like(rewards, dtype=torch.float32)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (n - 1)
    adv = grouped - baseline
    equal = flat_groups(grouped)
    return adv.masked_fill(equal, 0.0).reshape(rewards.shape)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Sum over masked tokens divided by `num_tokens` (default: tokens in `mask`, at least 1)."""
    denom = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0)
    return masked_sum(values, mask) / denom


def _check_loss_agg(loss_agg: str) -> None:
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGG_MODES)}; got {loss_agg!r}")


def loss_units(mask: torch.Tensor, loss_agg: str = "token-mean") -> int:
    """What a loss of `loss_agg` averages over: tokens in `mask` (token-mean), else the sequences (rows) with at
    least one token in it. A row with none (a masked-out sequence) is no sequence of the loss."""
    _check_loss_agg(loss_agg)
    if loss_agg == "token-mean":
        return int(mask.sum())
    return int((mask.sum(dim=-1) > 0).sum())


def aggregated_sum(
    values: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token-mean", max_tokens: int | None = None
) -> torch.Tensor:
    """The numerator of `aggregate`: the sum over the batch's loss units of each unit's value.

        token-mean:               sum_i sum_t m_it v_it
        seq-mean-token-mean:      sum_i (sum_t m_it v_it) / (sum_t m_it)   (0 for a row with no token)
        seq-mean-token-sum-norm:  sum_i (sum_t m_it v_it) / max_tokens     (Dr. GRPO's constant)

    Additive over rows, so micro-batches of a mini-batch sum to the mini-batch's value.
    """
    _check_loss_agg(loss_agg)
    mask = mask.to(values.dtype)
    if loss_agg == "token-mean":
        return masked_sum(values, mask)
    per_seq = (values * mask).sum(dim=-1)
    if loss_agg == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=-1).clamp(min=1.0)).sum()
    if max_tokens is None or max_tokens < 1:
        raise ValueError(f"loss_agg 'seq-mean-token-sum-norm' needs max_tokens >= 1 (its constant), got {max_tokens}")
    return per_seq.sum() / float(max_tokens)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str = "token-mean",
    denom: float | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Per-token `values` [B, T] to one number, the way `loss_agg` says:

        token-mean:               sum_{i,t} m v / N_tokens                      (DAPO; today's default)
        seq-mean-token-mean:      (1 / N_seqs) sum_i [sum_t m v / sum_t m]      (the GRPO paper)
        seq-mean-token-sum-norm:  (1 / N_seqs) sum_i [sum_t m v / max_tokens]   (Dr. GRPO)

    i.e. `aggregated_sum(values, mask, loss_agg, max_tokens) / denom`. `denom` defaults to `loss_units(mask)`
    (at least 1); pass the whole mini-batch's units (divided by the data-parallel ranks) to make gradient
    accumulation exact. token-mean is computed as `masked_mean` (bit-identical to it).
    """
    _check_loss_agg(loss_agg)
    if loss_agg == "token-mean":
        return masked_mean(values, mask, denom)
    d = float(denom) if denom is not None else float(max(1, loss_units(mask, loss_agg)))
    return aggregated_sum(values, mask, loss_agg, max_tokens) / d


@dataclass(frozen=True)
class PolicyLossOutput:
    """The differentiable loss and detached diagnostics (token means over `mask`, whatever `loss_agg`)."""

    loss: torch.Tensor         # scalar, requires grad
    clip_fraction: torch.Tensor  # share of tokens whose gradient the clip removed
    approx_kl: torch.Tensor    # k3 estimate of KL(old || new) per token
    ratio_mean: torch.Tensor   # mean importance ratio pi/pi_old


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    num_tokens: float | None = None,
    loss_agg: str = "token-mean",
    max_tokens: int | None = None,
    num_seqs: float | None = None,
) -> PolicyLossOutput:
    """PPO-clip surrogate with token-mean aggregation (or another `loss_agg`, see `aggregate`).

    logprobs, old_logprobs, mask: [B, T]; advantages: [B] (one per sequence,
    broadcast over its tokens) or [B, T].

        ratio  = exp(clamp(logp - logp_old, -20, 20))
        l_tok  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        loss   = sum(l_tok * mask) / num_tokens                        (token-mean)
        loss   = aggregate(l_tok, mask, loss_agg, num_seqs, max_tokens)  (seq-mean-*)

    Taking the max of the two negated surrogates is the pessimistic bound:
    the gradient vanishes once the ratio has moved past the clip in the
    direction the advantage favours. `clip_fraction` counts those tokens.

    `num_tokens` (token-mean) or `num_seqs` (the seq-mean modes) is the whole
    mini-batch's count of loss units (divided by the data-parallel ranks), so a
    micro-batch's loss sums to the mini-batch's under gradient accumulation;
    default: this batch's own (at least 1). `max_tokens` is Dr. GRPO's constant.

    The log-ratio clamp (LOG_RATIO_CLAMP) is an overflow guard, not part of
    the objective: e^100 is inf in float32, so one token with stale old
    logprobs would make the loss inf (A < 0) and every gradient NaN, and inf
    on a padding token times mask 0 is NaN too. A clamped token contributes
    at most |A| * e^20 to the loss and no gradient (like dual-clip PPO, the
    token is dropped rather than followed). Inside the clamp the values are
    bit-identical to the unclamped formula.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logprobs.dtype)
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if loss_agg == "token-mean":
        loss = masked_mean(per_token, mask, num_tokens)
    else:
        loss = aggregate(per_token, mask, loss_agg, num_seqs, max_tokens)
    with torch.no_grad():  # token means whatever loss_agg is (verl logs clipfrac and ppo_kl so too)
        clip_fraction = masked_mean((clipped > unclipped).to(mask.dtype), mask)
        # The tokens were sampled from pi_old, so kl_k3's "pi" is the old policy: r = log(pi / pi_old),
        # k3 = ratio - 1 - log(ratio), unbiased for KL(old || new). (Swapped, as before session 8, its
        # expectation is not KL(old || new): 0.326 vs 0.135 on a 50-way categorical.)
        approx_kl = masked_mean(kl_k3(old_logprobs, logprobs, mask), mask)
        ratio_mean = masked_mean(ratio, mask)
    return PolicyLossOutput(loss, clip_fraction, approx_kl, ratio_mean)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) on tokens sampled from pi.

        r  = clamp(logp_ref - logp, -20, 20)
        k3 = exp(r) - r - 1

    Non-negative (e^r >= 1 + r), zero when the two agree, unbiased with lower
    variance than -r (Schulman, "Approximating KL divergence"). Differentiable
    in `logprobs`. Zero outside `mask`. Aggregate with `masked_mean`.

    The exponent is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] so e^r stays
    finite (k3 <= e^20 - 21); a clamped token has no gradient. The value itself
    is not capped (verl also clips k3 to [-10, 10]): a cap that low (reached at
    r = 2.6, a reference 13x likelier than the policy) would drop the KL pull
    on exactly the tokens that drifted most. Inside the clamp the values are
    bit-identical to the unclamped formula.
    """
    r = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(r) - r - 1.0) * mask.to(logprobs.dtype)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of softmax(logits): H = logsumexp(z) - sum(softmax(z) * z).

    logits: [B, T, V]; mask: [B, T]. Returns [B, T], zero outside `mask`.
    Computed in float32 from the logits (stable; no log(0)). Differentiable in
    `logits` where grad is enabled (an entropy bonus, [trainer] entropy_coef).
    """
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    h = torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
    return h * mask.to(h.dtype)
