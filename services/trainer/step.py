"""One GRPO update from a step's scored completions.

    ScoredCompletion x (G prompts x n samples)
      -> group advantages (per prompt)                      grpo.group_advantages / grpo.rloo_advantages
      -> old logprobs (no grad; optional hidden states)     policy.logprobs
      -> reference logprobs (only when kl_beta > 0)
      -> ppo_epochs x shuffled mini-batches -> micro-batches grouped by length:
           loss = PPO-clip + kl_beta * k3 KL                grpo.policy_loss / grpo.kl_k3
                  - entropy_coef * entropy, each aggregated as loss_agg says (grpo.aggregate)
           DeepSpeed backward, step (optimizer at each mini-batch boundary)
      -> policy version + 1, StepMetrics

Every mini-batch's loss is divided by that mini-batch's count of loss units
(response tokens for token-mean, sequences for the seq-mean modes), so
gradient accumulation over its micro-batches gives exactly the aggregate of
the whole mini-batch. overlong_filter drops truncated responses from both the
sums and the counts. Data parallel (W ranks under the DeepSpeed launcher):
every rank holds the same completions (the loop broadcasts them), computes the
same advantages and the same seeded shuffles, and trains on its 1/W of each
mini-batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt.services.common.seeds import torch_seed
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.grpo import (
    aggregated_sum,
    flat_groups,
    group_advantages,
    kl_k3,
    loss_units,
    policy_loss,
    rloo_advantages,
)
from tlt.services.trainer.policy import Policy, ReferencePolicy, TokenBatch
from tlt.services.trainer.rewards import RewardError
from tlt.services.trainer.types import ScoredCompletion, StepMetrics


@dataclass(frozen=True)
class StepResult:
    metrics: StepMetrics
    ordered: list[ScoredCompletion]  # the completions in (prompt, sample) order
    # Last-layer features of each sequence from the old-logprob pass, when asked
    # for (drafter training reuses them): [len(prompt)+len(response), H] fp16 per
    # sequence in (prompt, sample) order; None for sequences another rank trained on.
    features: list[torch.Tensor | None] | None = None


def _ordered_groups(samples: Sequence[ScoredCompletion], n: int) -> list[ScoredCompletion]:
    """Sort by (prompt, sample) and check that every group is complete."""
    ordered = sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
    if len(ordered) % n:
        raise ValueError(f"{len(ordered)} completions is not a whole number of groups of {n}")
    for g in range(0, len(ordered), n):
        group = ordered[g : g + n]
        if len({s.prompt_index for s in group}) != 1 or [s.sample_index for s in group] != list(range(n)):
            raise ValueError(f"group starting at prompt {group[0].prompt_index} is incomplete or duplicated")
    return ordered


def _batch(samples: Sequence[ScoredCompletion], pad_id: int) -> TokenBatch:
    return TokenBatch.build([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id)


def _by_length(idx: Sequence[int], ordered: Sequence[ScoredCompletion]) -> list[int]:
    """`idx` ordered by sequence length, so each micro-batch pads only to its own longest.

    Long-tail rollouts mix 10- and 96-token responses; randomly grouped micro-batches
    pad every row to the longest one. Grouping by length changes no gradient: each
    mini-batch's loss is a sum over its tokens divided by a fixed count, and
    gradient accumulation sums the micro-batches in any grouping.
    """
    return sorted(idx, key=lambda k: (len(ordered[k].prompt_ids) + len(ordered[k].response_ids), k))


def _units(idx: Sequence[int], ordered: Sequence[ScoredCompletion], keep: Sequence[bool], loss_agg: str) -> int:
    """Loss units of the sequences `idx` (as grpo.loss_units counts them on a mask): their response tokens
    (token-mean), else how many of them have a response token; sequences not kept (overlong_filter) count 0."""
    lengths = [len(ordered[k].response_ids) for k in idx if keep[k]]
    return sum(lengths) if loss_agg == "token-mean" else sum(1 for n in lengths if n > 0)


def _rollout_rows(chunk: Sequence[ScoredCompletion]) -> torch.Tensor:
    """The rollout's logprobs of `chunk`'s response tokens, [len(chunk), longest response], zero-padded."""
    width = max(1, max(len(s.response_ids) for s in chunk))
    rows = torch.zeros(len(chunk), width)
    for j, s in enumerate(chunk):
        lp = s.rollout_logprobs[: len(s.response_ids)]
        rows[j, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return rows


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t[:, :width]


def grpo_step(
    policy: Policy,
    samples: Sequence[ScoredCompletion],
    step: int,
    reference: ReferencePolicy | None = None,
    with_features: bool = False,
) -> StepResult:
    cfg: TrainerConfig = policy.cfg
    n = cfg.n_samples
    ordered = _ordered_groups(samples, n)
    b = len(ordered)
    world, rank = policy.world_size, policy.rank
    if b % cfg.mini_batch_size:
        raise ValueError(f"{b} sequences is not a multiple of mini_batch_size {cfg.mini_batch_size}")
    times: dict[str, float] = {}
    device = policy.device

    # the group statistics in float64: rewards near float32's limit (3e38, refused past it) overflowed the mean and
    # std, and one update made every weight NaN
    rewards = torch.tensor([s.reward for s in ordered], dtype=torch.float64)
    if cfg.advantage_estimator == "rloo":
        adv = rloo_advantages(rewards, group_size=n)
    else:
        adv = group_advantages(rewards, group_size=n, eps=cfg.adv_eps, scale_by_std=cfg.scale_adv_by_std)
    adv = adv.float()
    if not torch.isfinite(adv).all():  # without the std division (rloo, scale_adv_by_std off) 3e38 rewards give inf
        raise RewardError(f"the step's advantages ({cfg.advantage_estimator}, scale_adv_by_std="
                          f"{cfg.scale_adv_by_std}) overflow float32 with rewards up to {max(abs(s.reward) for s in ordered):.3g}; "
                          "scale the rewards down")
    r_len = max(1, max(len(s.response_ids) for s in ordered))
    # DAPO's overlong filtering: a response cut at max_tokens leaves the loss (its reward stayed in the advantages).
    keep = [not (cfg.overlong_filter and s.finish_reason == "length") for s in ordered]
    keep_t = torch.tensor(keep, dtype=torch.float32)

    # Each pass's mini-batches are drawn from one seeded shuffle that every rank computes alike (the first pass's
    # is the one a 1-epoch step draws); rank r trains on positions r, r + W, ... of each mini-batch (data parallel).
    gen = torch.Generator().manual_seed(torch_seed(cfg.seed * 100_003 + step))
    passes: list[list[list[int]]] = []
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(b, generator=gen).tolist()
        passes.append([order[m0 : m0 + cfg.mini_batch_size] for m0 in range(0, b, cfg.mini_batch_size)])
    first = {k for mini in passes[0] for k in mini[rank::world]}  # features: the sequences of this rank's first pass
    # Old logprobs of this rank's first-pass share: as many sequences, so as many forwards, as every other rank
    # (under ZeRO-3 each forward is a collective). Later passes also train on other ranks' shares: summed below.
    mine = _by_length(sorted(first), ordered)

    # -- old (and reference) logprobs: one no-grad pass over this rank's sequences ------
    t0 = time.perf_counter()
    old = torch.zeros(b, r_len)
    ref = torch.zeros(b, r_len) if reference is not None and cfg.kl_beta > 0 else None
    features: list[torch.Tensor | None] | None = [None] * b if with_features else None
    mb = cfg.micro_batch_size
    chunks = [mine[i : i + mb] for i in range(0, len(mine), mb)]
    # old_logprobs = 'rollout': the longest chunk (the last: `mine` is sorted by length) is recomputed first and
    # checked; the others take the rollout's logprobs unless that check fails.
    # Only for samples of the policy being trained (the version it pushed: not a replica left on older weights), and
    # not under ZeRO-3 with several ranks: there every forward is a collective, and the ranks' checks could differ.
    take_rollout = (cfg.old_logprobs == "rollout" and not with_features and len(chunks) > 1
                    and not (policy.gathers and world > 1)
                    and all(ordered[k].rollout_logprobs is not None and ordered[k].policy_version == policy.version
                            for k in mine))
    chunk_order = [len(chunks) - 1, *range(len(chunks) - 1)] if take_rollout else list(range(len(chunks)))
    logprob_diff = 0.0
    from_rollout = 0
    policy.train(False)
    with torch.no_grad():
        for ci in chunk_order:
            idx = chunks[ci]
            chunk = [ordered[k] for k in idx]
            batch = _batch(chunk, policy.pad_id)
            if ref is not None:
                ref[idx] = _pad_to(reference.logprobs(batch).float().cpu(), r_len)
            if take_rollout and ci != chunk_order[0]:
                old[idx] = _pad_to(_rollout_rows(chunk), r_len)
                from_rollout += len(idx)
                continue
            out = policy.logprobs(batch, with_hidden=with_features)
            old[idx] = _pad_to(out.logprobs.float().cpu(), r_len)
            for j, (k, s) in enumerate(zip(idx, chunk)):
                if features is not None and out.hidden is not None and k in first:
                    length = len(s.prompt_ids) + len(s.response_ids)
                    features[k] = out.hidden[j, :length].to("cpu", torch.float16)
                if s.rollout_logprobs is not None and s.response_ids:
                    got = out.logprobs[j, : len(s.response_ids)].float().cpu()
                    want = torch.tensor(s.rollout_logprobs[: len(s.response_ids)], dtype=torch.float32)
                    logprob_diff = max(logprob_diff, float((got[: len(want)] - want).abs().max()))
            if take_rollout and logprob_diff > cfg.old_logprob_tolerance:
                from tlt.services.common.logging import get_logger

                get_logger("trainer").warning("old_logprobs_recomputed", step=step, max_diff=round(logprob_diff, 6),
                                              tolerance=cfg.old_logprob_tolerance,
                                              detail="the rollout's logprobs are not the trainer's: recomputing")
                take_rollout = False
    if world > 1 and cfg.ppo_epochs > 1:  # every rank's rows on every rank (each row is non-zero on one rank only)
        old = policy.all_reduce_sum(old)
        if ref is not None:
            ref = policy.all_reduce_sum(ref)
    times["old_logprobs_s"] = time.perf_counter() - t0

    # -- updates ---------------------------------------------------------------------
    t0 = time.perf_counter()
    policy.train(True)
    # loss, pg, kl, ent: sums of loss units' values (the aggregate's numerators), over `units`; clip and akl:
    # token sums over `ltok` (the loss's tokens). Every pass adds to them: the step's means are over every pass.
    sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "ent": 0.0, "clip": 0.0, "akl": 0.0, "units": 0.0, "ltok": 0.0}
    total_tokens = 0  # response tokens of the step's batch (its first pass), as the rollout generated them
    sums["from_rollout"] = float(from_rollout)  # summed over the ranks with the others
    updates = 0
    grad_norms: list[float] = []
    lrs: list[float] = []  # the LR each optimizer update of this step used
    agg = cfg.loss_agg
    for epoch, minis in enumerate(passes):
        for mini in minis:
            # DeepSpeed averages gradients over the W ranks, so each rank divides its sums by (the mini-batch's
            # loss units / W): the average is then the exact aggregate of the whole mini-batch.
            denom = max(1, _units(mini, ordered, keep, agg)) / world
            units_kw = {"num_tokens": denom} if agg == "token-mean" else {"num_seqs": denom}
            local = _by_length(mini[rank::world], ordered)
            for u0 in range(0, len(local), mb):
                idx = local[u0 : u0 + mb]
                chunk = [ordered[k] for k in idx]
                batch = _batch(chunk, policy.pad_id)
                out = policy.logprobs(batch, with_entropy=True, entropy_grad=cfg.entropy_coef > 0)
                width = out.logprobs.shape[1]
                mask = out.mask * keep_t[idx].to(device).unsqueeze(1) if cfg.overlong_filter else out.mask
                old_mb = _pad_to(old[idx], width).to(device)
                pl = policy_loss(out.logprobs, old_mb, adv[idx].to(device), mask, cfg.clip_low, cfg.clip_high,
                                 loss_agg=agg, max_tokens=cfg.max_tokens, **units_kw)
                loss = pl.loss
                kl_sum = torch.zeros((), device=device)
                if ref is not None:
                    kl_tok = kl_k3(out.logprobs, _pad_to(ref[idx], width).to(device), mask)
                    kl_sum = aggregated_sum(kl_tok, mask, agg, cfg.max_tokens)
                    loss = loss + cfg.kl_beta * kl_sum / denom
                ent_sum = aggregated_sum(out.entropy, mask, agg, cfg.max_tokens)
                if cfg.entropy_coef > 0:
                    loss = loss - cfg.entropy_coef * ent_sum / denom
                policy.backward(loss)
                lr = policy.lr  # read before step(): the scheduler moves on to the next update's LR inside it
                if policy.step():
                    updates += 1
                    lrs.append(lr)
                    if policy.grad_norm is not None:
                        grad_norms.append(policy.grad_norm)
                if epoch == 0:
                    total_tokens += int(out.mask.sum())
                tokens = float(mask.sum())
                sums["loss"] += float(loss.detach()) * denom
                sums["pg"] += float(pl.loss.detach()) * denom
                sums["kl"] += float(kl_sum.detach())
                sums["ent"] += float(ent_sum.detach())
                sums["units"] += float(loss_units(mask, agg))
                sums["clip"] += float(pl.clip_fraction) * tokens
                sums["akl"] += float(pl.approx_kl) * tokens
                sums["ltok"] += tokens
    if world > 1:  # every rank reports the whole step
        sums, total_tokens, logprob_diff = policy.all_reduce_stats(sums, total_tokens, logprob_diff)
    times["update_s"] = time.perf_counter() - t0
    policy.version += 1

    units = max(1.0, sums["units"])
    ltok = max(1.0, sums["ltok"])
    lengths = torch.tensor([len(s.response_ids) for s in ordered], dtype=torch.float32)
    metrics = StepMetrics(
        step=step,
        policy_version=policy.version,
        loss=sums["loss"] / units,
        pg_loss=sums["pg"] / units,
        kl=sums["kl"] / units,
        entropy=sums["ent"] / units,
        clip_fraction=sums["clip"] / ltok,
        approx_kl=sums["akl"] / ltok,
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        lr=sum(lrs) / len(lrs) if lrs else policy.lr,
        optimizer_updates=updates,
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()) if b > 1 else 0.0,
        accuracy=sum(s.correct for s in ordered) / b,
        zero_signal_groups=float(flat_groups(rewards.reshape(-1, n)).float().mean()),
        response_len_mean=float(lengths.mean()),
        response_len_max=int(lengths.max()),
        truncated_fraction=sum(s.finish_reason == "length" for s in ordered) / b,
        overlong_filtered_fraction=keep.count(False) / b,
        rollout_logprob_max_diff=logprob_diff,
        old_logprobs_from_rollout=int(sums["from_rollout"]),
        tokens=total_tokens,
        times=times,
    )
    return StepResult(metrics, ordered, features)
