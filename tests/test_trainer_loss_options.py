"""Opt-in GRPO-family options of [trainer]: loss_agg, entropy_coef, ppo_epochs, advantage_estimator, overlong_filter.

Pure functions (services/trainer/grpo.py) against values computed by hand; the step (services/trainer/step.py) on
a tiny random Qwen2 under real DeepSpeed against an independent reference: a plain autograd loop that forwards
each sequence alone through a copy of the same model and writes the loss out from its formula.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.grpo import (
    aggregate,
    entropy_from_logits,
    loss_units,
    policy_loss,
    rloo_advantages,
)
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step
from tlt.services.trainer.types import ScoredCompletion
from test_trainer_step import config, make_samples, tiny_qwen2


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


# ---- pure functions, by hand ----------------------------------------------------------------------------------

# Two sequences of 3 and 1 tokens (width 4), values 1, 2, 3 | 4, and a third row with no token at all.
V = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
M = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_aggregate_modes_by_hand():
    # token-mean: (1 + 2 + 3 + 4) / 4 tokens = 2.5
    assert aggregate(V, M, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: sequence means 2 and 4, over the 2 sequences with a token (the empty row is no
    # sequence of the loss) = 3
    assert aggregate(V, M, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum-norm, max_tokens 8: sums 6 and 4, each / 8 -> 0.75, 0.5, mean over 2 sequences = 0.625
    assert aggregate(V, M, "seq-mean-token-sum-norm", max_tokens=8).item() == pytest.approx(0.625)
    # an explicit denominator (the whole mini-batch's units / W): the same sums divided by it
    assert aggregate(V, M, "token-mean", denom=10).item() == pytest.approx(1.0)
    assert aggregate(V, M, "seq-mean-token-mean", denom=4).item() == pytest.approx(1.5)
    assert aggregate(V, M, "seq-mean-token-sum-norm", denom=5, max_tokens=8).item() == pytest.approx(0.25)
    assert loss_units(M, "token-mean") == 4 and loss_units(M, "seq-mean-token-mean") == 2
    assert loss_units(M, "seq-mean-token-sum-norm") == 2
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(V, M, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(V, M, "seq-sum")


def test_aggregate_of_no_tokens_is_zero_not_nan():
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = aggregate(V, torch.zeros_like(M), mode, max_tokens=4)
        assert out.item() == 0.0, mode


def test_aggregate_split_into_micro_batches_sums_to_the_whole():
    """Gradient accumulation: each micro-batch divides its sums by the whole mini-batch's units."""
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate(V, M, mode, max_tokens=8)
        units = loss_units(M, mode)
        parts = sum(aggregate(V[i : i + 1], M[i : i + 1], mode, denom=units, max_tokens=8) for i in range(3))
        assert parts.item() == pytest.approx(whole.item()), mode


def test_policy_loss_aggregation_by_hand():
    # On-policy (ratio 1): per-token loss = -A. A = +1 on the 3-token sequence, -2 on the 1-token one.
    logp = torch.zeros(2, 4)
    mask = M[:2]
    adv = torch.tensor([1.0, -2.0])
    # token-mean: -(1 * 3 - 2 * 1) / 4 = -0.25
    assert policy_loss(logp, logp, adv, mask).loss.item() == pytest.approx(-0.25)
    # seq-mean-token-mean: -(1 + (-2)) / 2 = 0.5 (the short sequence weighs as much as the long one)
    out = policy_loss(logp, logp, adv, mask, loss_agg="seq-mean-token-mean")
    assert out.loss.item() == pytest.approx(0.5)
    # Dr. GRPO, max_tokens 4: -(3 / 4 - 2 / 4) / 2 = -0.125
    out = policy_loss(logp, logp, adv, mask, loss_agg="seq-mean-token-sum-norm", max_tokens=4)
    assert out.loss.item() == pytest.approx(-0.125)
    # the mini-batch's sequence count as denominator: -(1 - 2) / 8 = 0.125
    out = policy_loss(logp, logp, adv, mask, loss_agg="seq-mean-token-mean", num_seqs=8)
    assert out.loss.item() == pytest.approx(0.125)


def test_rloo_advantages_by_hand():
    # [1, 0, 0, 1]: the others' mean of a 1 is (0 + 0 + 1) / 3 -> 1 - 1/3 = 2/3; of a 0: (0 + 1 + 1) / 3 -> -2/3
    # [2, 2, 2, 2]: 0 exactly
    # [0, 0, 0, 3]: of the 3: 0 -> 3; of a 0: (0 + 0 + 3) / 3 = 1 -> -1
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    want = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -1.0, 3.0]])
    torch.testing.assert_close(rloo_advantages(r), want, atol=1e-6, rtol=0)
    # flat with group_size, as the step calls it; [0.5, 1.5]: 0.5 - 1.5 = -1 and 1
    flat = rloo_advantages(torch.tensor([0.5, 1.5, 1.0, 4.0]), group_size=2)
    torch.testing.assert_close(flat, torch.tensor([-1.0, 1.0, -3.0, 3.0]), atol=1e-6, rtol=0)
    # a group of one has no other sample: 0
    assert (rloo_advantages(torch.tensor([3.0, -1.0]), group_size=1) == 0).all()
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=2)


def test_rloo_all_equal_inexact_rewards_are_exactly_zero():
    for value in (0.1, 0.7, 1000.3):
        for n in (3, 7, 8):
            r = torch.full((2, n), value)
            r[1, 0] = value + 1.0
            a = rloo_advantages(r)
            assert (a[0] == 0).all(), (value, n, a[0])
            assert a[1, 0] == pytest.approx(1.0, rel=1e-4) and a[1, 1:].tolist() == pytest.approx(
                [-1.0 / (n - 1)] * (n - 1), rel=1e-3)


def test_the_entropy_has_the_autograd_gradient():
    torch.manual_seed(0)
    z = torch.randn(2, 3, 5, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    live = entropy_from_logits(z, mask)
    # the reference: H = -sum p log p, written out
    p = torch.softmax(z, -1)
    ref = -(p * torch.log(p)).sum(-1) * mask
    torch.testing.assert_close(live, ref.detach(), atol=1e-6, rtol=0)
    w = torch.tensor([[0.3, -1.2, 5.0], [2.0, 1.0, 1.0]])
    (g_live,) = torch.autograd.grad((live * w).sum(), z)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), z)
    torch.testing.assert_close(g_live, g_ref, atol=1e-6, rtol=0)


# ---- config ----------------------------------------------------------------------------------------------------


def test_defaults_are_todays_behaviour():
    cfg = TrainerConfig()
    assert (cfg.loss_agg, cfg.entropy_coef, cfg.ppo_epochs, cfg.advantage_estimator, cfg.overlong_filter) == (
        "token-mean", 0.0, 1, "grpo", False)


@pytest.mark.parametrize("field, value", [
    ("loss_agg", "seq-mean"), ("entropy_coef", -0.01), ("ppo_epochs", 0), ("advantage_estimator", "gae"),
    ("overlong_filter", "sometimes"),
])
def test_bad_values_fail_naming_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        TrainerConfig(**{field: value})


def test_the_config_offers_exactly_the_aggregations_grpo_implements():
    import typing

    from tlt.services.trainer.grpo import LOSS_AGG_MODES

    assert typing.get_args(TrainerConfig.model_fields["loss_agg"].annotation) == LOSS_AGG_MODES


def test_every_new_option_has_a_description():
    for name in ("loss_agg", "entropy_coef", "ppo_epochs", "advantage_estimator", "overlong_filter"):
        assert TrainerConfig.model_fields[name].description, name


# ---- the step against a plain autograd reference ----------------------------------------------------------------

MAX_TOKENS = 12


def _samples(length_cut: tuple[int, ...] = ()) -> list[ScoredCompletion]:
    """8 completions (2 groups of 4) with rewards that give unequal advantages; `length_cut` (ordered
    positions) are marked finish_reason 'length'."""
    rewards = [[0.0, 1.0, 1.0, 0.5], [2.0, 0.0, 0.0, 0.0]]
    base = sorted(make_samples(2, 4, seed=7), key=lambda s: (s.prompt_index, s.sample_index))
    return [ScoredCompletion(s.prompt_index, s.sample_index, s.prompt_ids, s.response_ids,
                             rewards[s.prompt_index][s.sample_index],
                             finish_reason="length" if i in length_cut else "stop")
            for i, s in enumerate(base)]


def _hand_advantages(estimator: str) -> list[float]:
    if estimator == "grpo":  # (r - mean) / (sample std + 1e-6)
        out = []
        for g in ([0.0, 1.0, 1.0, 0.5], [2.0, 0.0, 0.0, 0.0]):
            mean = sum(g) / 4
            std = math.sqrt(sum((x - mean) ** 2 for x in g) / 3)
            out += [(x - mean) / (std + 1e-6) for x in g]
        return out
    # rloo: r - mean of the other three
    # [0, 1, 1, .5]: 0 - 2.5/3, 1 - 1.5/3, 1 - 1.5/3, .5 - 2/3 ; [2, 0, 0, 0]: 2 - 0, 0 - 2/3 (x3)
    return [-2.5 / 3, 0.5, 0.5, 0.5 - 2 / 3, 2.0, -2 / 3, -2 / 3, -2 / 3]


def _reference_grads(samples, loss_agg: str, entropy_coef: float, estimator: str, overlong: bool):
    """The gradient of one on-policy mini-batch holding every sequence, written from the formulas.

    Each sequence alone through the model (no padding, no batching); ratio = exp(logp - logp.detach()) = 1 with
    the PPO gradient; entropy H = -sum p log p; aggregation as the option's description states it."""
    model = tiny_qwen2()
    model.train(True)
    adv = _hand_advantages(estimator)
    contributions, tokens, seqs = [], 0, 0
    for i, s in enumerate(samples):
        if overlong and s.finish_reason == "length":
            continue
        p, r = list(s.prompt_ids), list(s.response_ids)
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)].float()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(1, torch.tensor(r)[:, None])[:, 0]
        ratio = torch.exp(logp - logp.detach())
        ent = -(logp_all.exp() * logp_all).sum(-1)
        per_token = -adv[i] * ratio - entropy_coef * ent
        tokens += len(r)
        seqs += 1
        if loss_agg == "token-mean":
            contributions.append(per_token.sum())
        elif loss_agg == "seq-mean-token-mean":
            contributions.append(per_token.sum() / len(r))
        else:
            contributions.append(per_token.sum() / MAX_TOKENS)
    loss = sum(contributions) / (tokens if loss_agg == "token-mean" else seqs)
    loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _step_grads(monkeypatch, samples, world: int = 1, rank: int = 0, **kw):
    """Gradients the step accumulates on `rank` of `world` (no optimizer update: the weights stay put)."""
    policy = Policy(config(mini_batch_size=8, max_tokens=MAX_TOKENS, **kw), model=tiny_qwen2())
    monkeypatch.setattr(policy, "world_size", world)
    monkeypatch.setattr(policy, "rank", rank)
    monkeypatch.setattr(policy, "step", lambda: False)
    monkeypatch.setattr(policy, "all_reduce_stats", lambda sums, tokens, diff: (sums, tokens, diff))
    res = grpo_step(policy, samples, step=0)
    grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for k, p in policy.module.named_parameters()}
    return grads, res.metrics


def _assert_grads_close(got, want):
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5 * scale, rtol=1e-4, msg=k)


CASES = [
    # loss_agg, entropy_coef, estimator, overlong
    ("seq-mean-token-mean", 0.0, "grpo", False),
    ("seq-mean-token-sum-norm", 0.0, "grpo", False),
    ("token-mean", 0.05, "grpo", False),
    ("seq-mean-token-mean", 0.05, "rloo", True),
    ("token-mean", 0.0, "rloo", True),
]


@pytest.mark.parametrize("loss_agg, entropy_coef, estimator, overlong", CASES)
def test_step_gradient_matches_the_autograd_reference(monkeypatch, loss_agg, entropy_coef, estimator, overlong):
    """Micro-batches of 2 grouped by length accumulate to the reference gradient of the whole mini-batch."""
    samples = _samples(length_cut=(1, 6))
    want = _reference_grads(samples, loss_agg, entropy_coef, estimator, overlong)
    got, m = _step_grads(monkeypatch, samples, micro_batch_size=2, loss_agg=loss_agg, entropy_coef=entropy_coef,
                         advantage_estimator=estimator, overlong_filter=overlong)
    _assert_grads_close(got, want)
    assert m.overlong_filtered_fraction == pytest.approx(2 / 8 if overlong else 0.0)
    assert m.truncated_fraction == pytest.approx(2 / 8)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_data_parallel_ranks_average_to_the_reference_gradient(monkeypatch, loss_agg):
    """Each of W = 2 ranks divides by (mini-batch sequences / W): DeepSpeed's average over the ranks is the
    whole mini-batch's sequence mean (without / W it would be half of it)."""
    samples = _samples(length_cut=(2,))
    want = _reference_grads(samples, loss_agg, 0.02, "grpo", True)
    ranks = [_step_grads(monkeypatch, samples, world=2, rank=r, micro_batch_size=2, loss_agg=loss_agg,
                         entropy_coef=0.02, overlong_filter=True)[0] for r in (0, 1)]
    _assert_grads_close({k: (ranks[0][k] + ranks[1][k]) / 2 for k in want}, want)


def test_step_metrics_follow_the_aggregation(monkeypatch):
    """On-policy, one mini-batch: pg_loss = the aggregated -A (by hand), entropy the same aggregation of the
    reference entropies, loss = pg_loss - entropy_coef x entropy."""
    samples = _samples()
    adv = _hand_advantages("grpo")
    model = tiny_qwen2()
    seq_ent = []
    with torch.no_grad():
        for s in samples:
            p, r = list(s.prompt_ids), list(s.response_ids)
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
            lp = torch.log_softmax(logits, -1)
            seq_ent.append(float(-(lp.exp() * lp).sum(-1).sum()))
    lens = [len(s.response_ids) for s in samples]
    _, m = _step_grads(monkeypatch, samples, micro_batch_size=4, loss_agg="seq-mean-token-sum-norm",
                       entropy_coef=0.1)
    want_pg = sum(-a * n / MAX_TOKENS for a, n in zip(adv, lens)) / 8
    want_ent = sum(e / MAX_TOKENS for e in seq_ent) / 8
    assert m.pg_loss == pytest.approx(want_pg, rel=1e-4, abs=1e-7)
    assert m.entropy == pytest.approx(want_ent, rel=1e-4)
    assert m.loss == pytest.approx(want_pg - 0.1 * want_ent, rel=1e-4, abs=1e-7)
    assert m.tokens == sum(lens)
    # seq-mean-token-mean: the per-sequence mean entropy, averaged over the 8 sequences
    _, m = _step_grads(monkeypatch, samples, micro_batch_size=4, loss_agg="seq-mean-token-mean")
    assert m.entropy == pytest.approx(sum(e / n for e, n in zip(seq_ent, lens)) / 8, rel=1e-4)
    assert m.pg_loss == pytest.approx(sum(-a for a in adv) / 8, abs=1e-6)


# ---- ppo_epochs ---------------------------------------------------------------------------------------------------


def test_ppo_epochs_updates_shuffles_and_old_logprobs_once(monkeypatch):
    policy = Policy(config(mini_batch_size=4, micro_batch_size=2, ppo_epochs=3), model=tiny_qwen2())
    calls: list[tuple[bool, list[tuple[int, ...]]]] = []
    real = policy.logprobs

    def recording(batch, with_entropy=False, with_hidden=False, entropy_grad=False):
        rows = [tuple(int(t) for t, m in zip(ids, mk) if m) for ids, mk in zip(batch.response_ids,
                                                                          batch.response_mask)]
        calls.append((with_entropy, rows))
        return real(batch, with_entropy=with_entropy, with_hidden=with_hidden, entropy_grad=entropy_grad)

    monkeypatch.setattr(policy, "logprobs", recording)
    samples = make_samples(2, 4, seed=11)
    m = grpo_step(policy, samples, step=0).metrics
    assert m.optimizer_updates == 3 * 2  # epochs x mini-batches
    old_pass = [rows for train, rows in calls if not train]
    assert sum(len(r) for r in old_pass) == 8  # old logprobs once per sequence, not once per epoch
    train_rows = [rows for train, rows in calls if train]
    assert len(train_rows) == 3 * 4  # 2 micro-batches of 2 per mini-batch, 2 mini-batches, 3 epochs
    epochs = [sorted(r for rows in train_rows[e * 4 : (e + 1) * 4] for r in rows) for e in range(3)]
    everything = sorted(s.response_ids for s in samples)
    assert all(e == everything for e in epochs)  # each epoch passes over every sequence once
    minis = [[frozenset(r for rows in train_rows[e * 4 + 2 * k : e * 4 + 2 * k + 2] for r in rows) for k in (0, 1)]
             for e in range(3)]
    assert len({frozenset(mm) for mm in minis}) > 1  # each epoch shuffles into its own mini-batches
    # epochs after the first train on the moved policy against the once-computed old logprobs
    assert m.approx_kl > 0 and m.tokens == sum(len(s.response_ids) for s in samples)


def test_ppo_epochs_reuse_the_old_logprobs_of_the_rollout_batch():
    """One mini-batch, 2 epochs: the first epoch is on-policy (ratio 1); the second trains the moved policy
    against the old logprobs computed once before the first update, so its ratios are not 1 (recomputed old
    logprobs would make it on-policy again: approx_kl 0)."""
    samples = make_samples(2, 4, seed=3)
    policy = Policy(config(mini_batch_size=8, micro_batch_size=4, ppo_epochs=2, lr=1e-2), model=tiny_qwen2())
    m = grpo_step(policy, samples, step=0).metrics
    assert m.optimizer_updates == 2
    assert m.approx_kl > 1e-6
    single = Policy(config(mini_batch_size=8, micro_batch_size=4, lr=1e-2), model=tiny_qwen2())
    assert grpo_step(single, samples, step=0).metrics.approx_kl == pytest.approx(0.0, abs=1e-7)


def test_ppo_epochs_enter_the_lr_schedule():
    # 8 sequences, mini-batch 4, 2 epochs: 4 updates per step; steps=1, cosine, no warm-up: the schedule runs over
    # 4 updates, multipliers 0.5 (1 + cos(pi u / 4)) = 1, 0.853553, 0.5, 0.146447 (mean 0.625). Counting 2 updates
    # per step instead (no epochs), the schedule would end after the second update: 1, 0.5, 0, 0 (mean 0.375).
    policy = Policy(config(mini_batch_size=4, micro_batch_size=4, ppo_epochs=2, steps=1, lr_schedule="cosine"),
                    model=tiny_qwen2())
    m = grpo_step(policy, make_samples(2, 4), step=0).metrics
    assert m.optimizer_updates == 4
    assert m.lr == pytest.approx(1e-3 * (1.0 + 0.853553 + 0.5 + 0.146447) / 4, rel=1e-5)
