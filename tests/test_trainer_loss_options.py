"""Opt-in GRPO-family options of [trainer]: loss_agg, entropy_coef, ppo_epochs, advantage_estimator, overlong_filter,
and the loss's k3 KL to a reference (kl_beta, at the run's temperature) and asymmetric clip (clip_low != clip_high).

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


def _reference_grads(samples, loss_agg: str, entropy_coef: float, estimator: str, overlong: bool, *,
                     kl_beta: float = 0.0, ref_model=None, temperature: float = 1.0, old=None,
                     clip: tuple[float, float] = (0.2, 0.2), stats: dict | None = None):
    """The gradient of one mini-batch holding every sequence, written from the formulas.

    Each sequence alone through the model (no padding, no batching), logits / temperature; old logprobs `old[i]`
    (default: the sequence's own, detached: on-policy, ratio 1 with the PPO gradient); per token
    max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high)) + kl_beta k3 - entropy_coef H, where
    k3 = e^r - r - 1, r = logp_ref - logp (the reference model's logprob at the same temperature; kl_k3's
    docstring) and H = -sum p log p; aggregation as the option's description states it. `stats` gets
    the share of tokens the clip took the gradient from and the aggregated KL."""
    model = tiny_qwen2()
    model.train(True)
    adv = _hand_advantages(estimator)
    contributions, kls, tokens, seqs, clipped = [], [], 0, 0, 0
    for i, s in enumerate(samples):
        if overlong and s.finish_reason == "length":
            continue
        p, r = list(s.prompt_ids), list(s.response_ids)
        ids, at = torch.tensor([p + r]), slice(len(p) - 1, len(p) - 1 + len(r))
        logits = model(input_ids=ids).logits[0, at].float() / temperature
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(1, torch.tensor(r)[:, None])[:, 0]
        old_i = logp.detach() if old is None else torch.tensor(old[i], dtype=torch.float32)
        ratio = torch.exp(logp - old_i)
        unclipped = -adv[i] * ratio
        cut = -adv[i] * torch.clamp(ratio, 1.0 - clip[0], 1.0 + clip[1])
        clipped += int((cut > unclipped).sum())
        ent = -(logp_all.exp() * logp_all).sum(-1)
        kl = torch.zeros(len(r))
        if kl_beta > 0:
            with torch.no_grad():
                ref_logp = torch.log_softmax(ref_model(input_ids=ids).logits[0, at].float() / temperature, -1)
                ref_logp = ref_logp.gather(1, torch.tensor(r)[:, None])[:, 0]
            kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1.0
        per_token = torch.maximum(unclipped, cut) + kl_beta * kl - entropy_coef * ent
        tokens += len(r)
        seqs += 1
        norm = 1.0 if loss_agg == "token-mean" else len(r) if loss_agg == "seq-mean-token-mean" else MAX_TOKENS
        contributions.append(per_token.sum() / norm)
        kls.append(float(kl.detach().sum()) / norm)
    units = tokens if loss_agg == "token-mean" else seqs
    loss = sum(contributions) / units
    loss.backward()
    if stats is not None:
        stats.update(clip_fraction=clipped / tokens, kl=sum(kls) / units)
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _step_grads(monkeypatch, samples, world: int = 1, rank: int = 0, reference=None, **kw):
    """Gradients the step accumulates on `rank` of `world` (no optimizer update: the weights stay put); `reference`:
    a ReferencePolicy for the KL term (kl_beta > 0)."""
    policy = Policy(config(mini_batch_size=8, max_tokens=MAX_TOKENS, **kw), model=tiny_qwen2())
    monkeypatch.setattr(policy, "world_size", world)
    monkeypatch.setattr(policy, "rank", rank)
    monkeypatch.setattr(policy, "step", lambda: False)
    monkeypatch.setattr(policy, "all_reduce_stats", lambda sums, tokens, diff: (sums, tokens, diff))
    res = grpo_step(policy, samples, step=0, reference=reference)
    grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for k, p in policy.module.named_parameters()}
    return grads, res.metrics


def _assert_grads_close(got, want):
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5 * scale, rtol=1e-4, msg=k)


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    """A reference model other than the policy (tiny_qwen2 of another seed), saved as ReferencePolicy loads it."""
    path = tmp_path_factory.mktemp("kl-reference")
    tiny_qwen2(seed=1).save_pretrained(path)
    return path


CASES = [
    # loss_agg, entropy_coef, estimator, overlong, kl_beta, temperature
    ("seq-mean-token-mean", 0.0, "grpo", False, 0.0, 1.0),
    ("seq-mean-token-sum-norm", 0.0, "grpo", False, 0.0, 1.0),
    ("token-mean", 0.05, "grpo", False, 0.0, 1.0),
    ("seq-mean-token-mean", 0.05, "rloo", True, 0.0, 1.0),
    ("token-mean", 0.0, "rloo", True, 0.0, 1.0),
    # the k3 KL to a reference model (another seed's), against its formula per token
    ("token-mean", 0.0, "grpo", False, 0.5, 1.0),
    ("seq-mean-token-sum-norm", 0.02, "rloo", True, 0.5, 1.0),
    ("seq-mean-token-mean", 0.0, "grpo", True, 0.5, 0.7),  # policy and reference logprobs at temperature 0.7
]


@pytest.mark.parametrize("loss_agg, entropy_coef, estimator, overlong, kl_beta, temperature", CASES)
def test_step_gradient_matches_the_autograd_reference(monkeypatch, ref_dir, loss_agg, entropy_coef, estimator,
                                                      overlong, kl_beta, temperature):
    """Micro-batches of 2 grouped by length accumulate to the reference gradient of the whole mini-batch."""
    from tlt.services.trainer.policy import ReferencePolicy

    samples = _samples(length_cut=(1, 6))
    stats: dict = {}
    want = _reference_grads(samples, loss_agg, entropy_coef, estimator, overlong, kl_beta=kl_beta,
                            ref_model=tiny_qwen2(seed=1), temperature=temperature, stats=stats)
    reference = ReferencePolicy(str(ref_dir), torch.device("cpu"), temperature) if kl_beta > 0 else None
    got, m = _step_grads(monkeypatch, samples, reference=reference, micro_batch_size=2, loss_agg=loss_agg,
                         entropy_coef=entropy_coef, advantage_estimator=estimator, overlong_filter=overlong,
                         kl_beta=kl_beta, temperature=temperature)
    _assert_grads_close(got, want)
    assert m.overlong_filtered_fraction == pytest.approx(2 / 8 if overlong else 0.0)
    assert m.truncated_fraction == pytest.approx(2 / 8)
    assert m.kl == pytest.approx(stats["kl"], rel=1e-4, abs=1e-9)
    if kl_beta > 0:
        assert m.kl > 1e-3  # a KL term the gradient comparison can see


def _off_policy(samples: list[ScoredCompletion], checked: set[int]) -> tuple[list[ScoredCompletion], list[tuple]]:
    """`samples` with rollout logprobs off the policy's own (its logprobs, each sequence alone) by log-ratios
    SHIFTS[t % 5] at token t (ratio e^shift), except the sequences in `checked` (the step's checked micro-batch,
    recomputed: theirs are exact). Returns the samples and their old logprobs."""
    import dataclasses

    model = tiny_qwen2().eval()
    out, old = [], []
    for i, s in enumerate(samples):
        p, r = list(s.prompt_ids), list(s.response_ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float(), -1)
        own = [float(x) for x in logp.gather(1, torch.tensor(r)[:, None])[:, 0]]
        lp = tuple(own if i in checked else (x - SHIFTS[t % 5] for t, x in enumerate(own)))
        out.append(dataclasses.replace(s, rollout_logprobs=lp))
        old.append(lp)
    return out, old


# ratio e^shift: 1.35 (inside [0.8, 1.6], outside a ceiling of 1.2), 0.67 (under the floor 0.8, inside 0.4), 1.82
# (over 1.6), 0.37 (under 0.4 too), 1.0
SHIFTS = (0.3, -0.4, 0.6, -1.0, 0.0)


def test_asymmetric_clip_off_policy_matches_the_reference(monkeypatch):
    """DAPO's clip-higher (clip_low 0.2, clip_high 0.6) on off-policy old logprobs (the rollout's, old_logprobs =
    'rollout'): a token is clipped (no gradient) where A > 0 and ratio > 1 + clip_high, or A < 0 and
    ratio < 1 - clip_low; clip_fraction counted by hand from the shifts and the advantages' signs, the gradient
    against the reference (clip_low and clip_high swapped, 1.35 x A > 0 and 0.67 x A < 0 swap sides)."""
    samples = _samples()
    mb = 2
    by_len = sorted(range(8), key=lambda k: (len(samples[k].prompt_ids) + len(samples[k].response_ids), k))
    checked = set(by_len[-mb:])  # the longest micro-batch: the one the step recomputes and checks
    samples, old = _off_policy(samples, checked)
    adv = _hand_advantages("grpo")
    clipped = sum(1 for i, s in enumerate(samples) if i not in checked for t in range(len(s.response_ids))
                  if (adv[i] > 0 and math.exp(SHIFTS[t % 5]) > 1.6) or (adv[i] < 0 and math.exp(SHIFTS[t % 5]) < 0.8))
    total = sum(len(s.response_ids) for s in samples)
    stats: dict = {}
    want = _reference_grads(samples, "token-mean", 0.0, "grpo", False, old=old, clip=(0.2, 0.6), stats=stats)
    got, m = _step_grads(monkeypatch, samples, micro_batch_size=mb, old_logprobs="rollout", clip_low=0.2,
                         clip_high=0.6)
    assert m.old_logprobs_from_rollout == 6 and m.rollout_logprob_max_diff < 1e-4  # the shifted ones were used
    assert 0 < clipped < total and stats["clip_fraction"] == pytest.approx(clipped / total)
    assert m.clip_fraction == pytest.approx(clipped / total, rel=1e-6)
    _assert_grads_close(got, want)


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
