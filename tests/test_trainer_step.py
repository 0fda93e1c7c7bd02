"""One GRPO step with real DeepSpeed (gloo process group, CPU) on a tiny random Qwen2.

Nothing is faked: the model is a `transformers` Qwen2 built in code with a
fixed seed, DeepSpeed wraps a torch AdamW, the completions are hand-made
token sequences with rewards.
"""

from __future__ import annotations

import random

import pytest
import torch

from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.policy import Policy, ReferencePolicy, TokenBatch, lr_lambda, response_logprobs
from tlt.services.trainer.step import grpo_step
from tlt.services.trainer.types import ScoredCompletion

VOCAB = 48


def tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg)


def make_samples(groups: int, n: int, seed: int = 1) -> list[ScoredCompletion]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5)))
        for k in range(n):
            resp = tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 7)))
            out.append(ScoredCompletion(g, k, prompt, resp, reward=float(k % 2), correct=bool(k % 2)))
    rng.shuffle(out)  # arrival order is arbitrary
    return out


def config(**kw) -> TrainerConfig:
    base = dict(prompts_per_step=2, n_samples=4, mini_batch_size=8, micro_batch_size=4, lr=1e-3, steps=3, seed=0)
    base.update(kw)
    return TrainerConfig(**base)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.mark.parametrize("zero_stage, bf16", [(0, False), (2, False), (1, True)])
def test_one_step_changes_every_parameter_and_advances_version(zero_stage, bf16):
    # bf16 (the GPU setting, run here on CPU): DeepSpeed keeps fp32 master weights and
    # copies them to the bf16 model; bf16 spacing at 1.0 is 2^-7, so norm weights (1.0)
    # only visibly move with a step above half of that: lr 1e-2 there.
    policy = Policy(config(zero_stage=zero_stage, bf16=bf16, lr=1e-2 if bf16 else 1e-3), model=tiny_qwen2())
    before = {k: p.detach().clone() for k, p in policy.module.named_parameters() if p.requires_grad}
    res = grpo_step(policy, make_samples(2, 4), step=0)
    after = dict(policy.module.named_parameters())
    unchanged = [k for k, v in before.items() if torch.equal(v, after[k].detach())]
    assert not unchanged, f"parameters not updated: {unchanged}"
    assert policy.version == 1 and res.metrics.policy_version == 1
    m = res.metrics
    assert m.optimizer_updates == 1
    assert m.reward_mean == pytest.approx(0.5) and m.accuracy == pytest.approx(0.5)
    # first mini-batch is on-policy: ratio 1, nothing clipped
    assert m.clip_fraction == 0.0 and m.approx_kl == pytest.approx(0.0, abs=1e-6)
    assert m.entropy > 0 and m.grad_norm > 0 and m.tokens > 0


def test_accumulation_is_exact_token_mean():
    """Micro-batches of 2 accumulate to the same update as one micro-batch of 8."""
    samples = make_samples(2, 4, seed=3)
    results = []
    for micro in (8, 2):
        policy = Policy(config(micro_batch_size=micro), model=tiny_qwen2())
        grpo_step(policy, samples, step=0)
        results.append({k: p.detach().clone() for k, p in policy.module.named_parameters()})
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=2e-6, rtol=1e-4)


def test_data_parallel_ranks_average_to_the_whole_mini_batch_token_mean(monkeypatch):
    """Each of W ranks divides its token sum by (mini-batch tokens / W), so DeepSpeed's average over the ranks is
    the token mean of the whole mini-batch. Ranks 0 and 1 of a 2-rank step are played here one after the other
    (the real 2-process run is the slow tests/test_trainer_distributed.py); a loss divided by all the mini-batch's
    tokens instead (no / W) halves the update, and only that slow test saw it before."""
    samples = make_samples(2, 4, seed=5)
    losses: dict[tuple[int, int], float] = {}
    for world, rank in ((1, 0), (2, 0), (2, 1)):
        policy = Policy(config(mini_batch_size=8, micro_batch_size=2), model=tiny_qwen2())
        monkeypatch.setattr(policy, "world_size", world)
        monkeypatch.setattr(policy, "rank", rank)
        seen: list[float] = []
        monkeypatch.setattr(policy, "backward", lambda loss, seen=seen: seen.append(float(loss.detach())))
        monkeypatch.setattr(policy, "step", lambda: False)  # weights stay put: every rank sees the same policy
        monkeypatch.setattr(policy, "all_reduce_stats", lambda sums, tokens, diff: (sums, tokens, diff))
        grpo_step(policy, samples, step=0)
        losses[world, rank] = sum(seen)
    whole = losses[1, 0]
    assert whole != 0.0
    assert (losses[2, 0] + losses[2, 1]) / 2 == pytest.approx(whole, rel=1e-5)  # DeepSpeed averages the ranks


def test_all_equal_rewards_give_zero_policy_gradient():
    samples = [ScoredCompletion(s.prompt_index, s.sample_index, s.prompt_ids, s.response_ids, 1.0)
               for s in make_samples(2, 4)]
    policy = Policy(config(), model=tiny_qwen2())
    res = grpo_step(policy, samples, step=0)
    assert res.metrics.zero_signal_groups == 1.0
    assert res.metrics.grad_norm == 0.0


def test_rewards_near_float32s_limit_train_as_their_scaled_copies():
    """Rewards near 3e38 (finite in float32, and let through) overflowed the group mean or std in float32: the
    step's advantages were 0 (std inf) or NaN (mean inf: one update made every weight NaN). In float64 the
    statistics hold, and scaling rewards changes nothing in a std-normalised step but its eps: the same update as
    rewards of +-1."""
    base = make_samples(2, 4)
    results = []
    for scale in (1.0, 3e38):
        samples = [ScoredCompletion(s.prompt_index, s.sample_index, s.prompt_ids, s.response_ids,
                                    scale * (2 * s.reward - 1)) for s in base]
        policy = Policy(config(), model=tiny_qwen2())
        grpo_step(policy, samples, step=0)
        results.append([p.detach().clone() for p in policy.engine.module.parameters()])
    assert all(torch.isfinite(p).all() for p in results[1])
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*results))  # an update moves 1e-3
    # without the std division the advantages themselves pass float32: the step is refused, nothing trained
    from tlt.services.trainer.rewards import RewardError

    huge = [ScoredCompletion(s.prompt_index, s.sample_index, s.prompt_ids, s.response_ids,
                             3e38 if s.sample_index == 0 else -3e38) for s in base]  # centred: 4.5e38
    for kw in ({"advantage_estimator": "rloo"}, {"scale_adv_by_std": False}):
        policy = Policy(config(**kw), model=tiny_qwen2())
        before = [p.detach().clone() for p in policy.engine.module.parameters()]
        with pytest.raises(RewardError, match="overflow float32 with rewards up to 3e"):
            grpo_step(policy, huge, step=0)
        assert all(torch.equal(a, p) for a, p in zip(before, policy.engine.module.parameters()))


def test_kl_to_reference_and_features(tmp_path):
    model = tiny_qwen2()
    model.save_pretrained(tmp_path / "ref")
    policy = Policy(config(kl_beta=0.1), model=model)
    reference = ReferencePolicy(str(tmp_path / "ref"), policy.device, temperature=1.0)
    samples = make_samples(2, 4)
    r0 = grpo_step(policy, samples, step=0, reference=reference, with_features=True)
    assert r0.metrics.kl == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert r0.features is not None and len(r0.features) == 8
    ordered = sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
    assert r0.features[0].shape == (len(ordered[0].prompt_ids) + len(ordered[0].response_ids), 32)
    r1 = grpo_step(policy, samples, step=1, reference=reference)
    assert r1.metrics.kl > 0 and policy.version == 2


def test_response_logprobs_match_unpadded_forward():
    """Right padding and batching do not change any response token's logprob."""
    model = tiny_qwen2().eval()
    # shortest prompt has 3 tokens: logits are kept only from position 2 on
    prompts, responses = [(5, 6, 7), (9, 3, 4, 5, 6)], [(10, 11), (12, 13, 14, 15)]
    batched = response_logprobs(model, TokenBatch.build(prompts, responses), temperature=0.7)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([list(p) + list(r)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / 0.7
        want = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) - 1 + len(r)].gather(1, torch.tensor(r)[:, None])
        torch.testing.assert_close(batched.logprobs[i, : len(r)], want[:, 0], atol=1e-5, rtol=0)
        assert (batched.logprobs[i, len(r):] == 0).all()


def test_lr_schedule_by_hand():
    # warm-up 2 updates: (u + 1) / 2 -> 0.5, 1.0; cosine over the remaining 4 updates:
    # 0.5 * (1 + cos(pi * (u - 2) / 4)) -> u=2: 1.0, u=3: 0.853553, u=4: 0.5, u=5: 0.146447, u=6: 0.0
    f = lr_lambda(2, 6, "cosine")
    assert [round(f(u), 6) for u in range(7)] == [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0]
    assert [f(u) for u in (7, 8, 12)] == [0.0, 0.0, 0.0]  # past the planned updates it stays at 0, never climbs back
    assert [lr_lambda(3, 10, "constant")(u) for u in (0, 2, 3, 9)] == [1 / 3, 1.0, 1.0, 1.0]


def test_step_metrics_record_the_lr_its_updates_used():
    # 8 sequences, mini-batch 4: 2 optimizer updates per step, 6 over 3 steps; warm-up 2 then cosine to 0.
    # The LR multipliers the 6 updates use (test_lr_schedule_by_hand): 0.5, 1.0 | 1.0, 0.853553 | 0.5, 0.146447.
    # The scheduler moves on inside each update, so reading the LR after the step gave the NEXT update's
    # LR: 1.0, 0.5, 0.0 x peak (the last step of a cosine run showed lr 0; its updates used 0.5 and 0.15 x peak).
    policy = Policy(config(mini_batch_size=4, micro_batch_size=4, warmup_steps=2, lr_schedule="cosine"),
                    model=tiny_qwen2())
    samples = make_samples(2, 4)
    lrs = [grpo_step(policy, samples, step=k).metrics.lr for k in range(3)]
    want = [(0.5 + 1.0) / 2, (1.0 + 0.853553) / 2, (0.5 + 0.146447) / 2]  # mean over the step's 2 updates
    assert lrs == pytest.approx([1e-3 * w for w in want], rel=1e-5)


# ---- step-level aggregation and checks, each against a value computed by hand ---------------------------------


def test_a_step_must_be_whole_mini_batches_and_whole_groups():
    policy = Policy(config(), model=tiny_qwen2())
    # 12 sequences with mini_batch_size 8: the last mini-batch would be half a DeepSpeed accumulation
    with pytest.raises(ValueError, match="not a multiple of mini_batch_size"):
        grpo_step(policy, make_samples(3, 4), step=0)
    # samples 0..3 of n=4 split over two prompts: the sample indices look whole, the group is not
    split = [ScoredCompletion(0 if k < 2 else 1, k, (1, 2), (3,), float(k % 2)) for k in range(4)]
    with pytest.raises(ValueError, match="incomplete or duplicated"):
        grpo_step(policy, split + [ScoredCompletion(2, k, (1, 2), (3,), 0.0) for k in range(4)], step=0)


def test_step_metrics_by_hand():
    """One on-policy mini-batch (ratio 1): pg loss = -sum_i A_i * len_i / tokens; accuracy counts `correct`
    (the verifier), not reward > 0; a zero-signal group is one whose n rewards are all equal; the rollout
    logprob check reports the largest difference over every sequence."""
    groups = [[2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 1.0, 1.0]]
    lens = [[1, 2, 3, 4], [5, 1, 7, 2]]
    prompt = (3, 4, 5)
    # the rollout's logprobs: the policy's own, except 1.0 too low on the first (shortest) sequence trained on
    with torch.no_grad():
        lp = response_logprobs(tiny_qwen2().eval(), TokenBatch.build([prompt] * 8, [
            tuple(range(10, 10 + n)) for row in lens for n in row]), temperature=1.0).logprobs
    samples = [ScoredCompletion(g, k, prompt, tuple(range(10, 10 + lens[g][k])), groups[g][k], correct=k == 0,
                                rollout_logprobs=tuple(float(x) - (g == 0 and k == 0)
                                                       for x in lp[4 * g + k, : lens[g][k]]))
               for g in range(2) for k in range(4)][::-1]
    policy = Policy(config(), model=tiny_qwen2())
    m = grpo_step(policy, samples, step=0).metrics
    # group 1: mean 0.75, sample std sqrt(0.75 / 3) = 0.5 -> A = -1.5, 0.5, 0.5, 0.5 (eps 1e-6 aside); group 0: A = 0
    tokens = sum(map(sum, lens))
    want = -(-1.5 * 5 + 0.5 * 1 + 0.5 * 7 + 0.5 * 2) / tokens
    assert m.tokens == tokens == 25
    assert m.pg_loss == pytest.approx(want, rel=1e-4) and m.loss == pytest.approx(want, rel=1e-4)
    assert m.accuracy == pytest.approx(2 / 8)  # reward > 0 would give 7 / 8
    assert m.zero_signal_groups == pytest.approx(0.5)  # grouped [G, n]: group 0 only
    assert m.rollout_logprob_max_diff == pytest.approx(1.0, abs=1e-4)  # the max over every sequence, not the last


def test_reward_std_is_the_sample_std_with_and_without_dynamic_sampling():
    """reward_std is the sample standard deviation (Bessel, n - 1) of the step's rewards, as group_advantages'
    std is; with dynamic sampling it is over every completion generated, all rounds, and "means the same with and
    without" it (dynamic_sampling.Selection): one round of the same completions gives the step's value."""
    import dataclasses

    from tlt.services.trainer.dynamic_sampling import select_groups
    from tlt.services.trainer.types import PromptItem

    # rewards 2, 0, 0, 0 | 2, 2, 0, 2: mean 1, every deviation +-1, sum of squares 8 -> sample std sqrt(8 / 7)
    # (1.069); the population std (/ 8) is 1
    groups = [[2.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 2.0]]
    samples = [dataclasses.replace(s, reward=groups[s.prompt_index][s.sample_index]) for s in make_samples(2, 4)]
    m = grpo_step(Policy(config(), model=tiny_qwen2()), samples, step=0).metrics
    assert m.reward_mean == pytest.approx(1.0) and m.reward_std == pytest.approx((8 / 7) ** 0.5, rel=1e-6)
    prompts = [PromptItem(index=i, prompt=f"p{i}", answer="") for i in range(2)]
    one_round = select_groups([(prompts, samples)], want=2, n=4)
    assert one_round.reward_std == pytest.approx(m.reward_std, rel=1e-9)
    # a second round's groups 1, 1, 1, 1 | 1, 3, 1, -1: 16 rewards, mean 1, squares 8 + 0 + 4 + 4 = 16 -> sqrt(16 / 15)
    more = [dataclasses.replace(s, reward=[[1.0] * 4, [1.0, 3.0, 1.0, -1.0]][s.prompt_index][s.sample_index])
            for s in samples]
    two_rounds = select_groups([(prompts, samples), (prompts, more)], want=2, n=4)
    assert two_rounds.reward_mean == pytest.approx(1.0)
    assert two_rounds.reward_std == pytest.approx((16 / 15) ** 0.5, rel=1e-9)


def test_clip_fraction_and_grad_norm_are_step_means(monkeypatch):
    """Two mini-batches (two updates): clip_fraction is the token-weighted mean of the micro-batches' clip
    fractions, grad_norm the mean of the two updates' norms."""
    import tlt.services.trainer.step as step_mod

    seen = []
    real_loss = step_mod.policy_loss

    def recording_loss(*a, **kw):
        out = real_loss(*a, **kw)
        seen.append((float(out.clip_fraction), float(a[3].sum())))
        return out

    monkeypatch.setattr(step_mod, "policy_loss", recording_loss)
    policy = Policy(config(mini_batch_size=4, micro_batch_size=2, lr=0.05), model=tiny_qwen2())
    norms = []
    real_step = policy.step

    def recording_step():
        done = real_step()
        if done:
            norms.append(policy.grad_norm)
        return done

    policy.step = recording_step
    m = grpo_step(policy, make_samples(2, 4), step=0).metrics
    assert len(norms) == 2 and norms[0] != pytest.approx(norms[1])
    assert m.grad_norm == pytest.approx((norms[0] + norms[1]) / 2)
    assert len(seen) == 4 and any(c > 0 for c, _ in seen), seen  # the second mini-batch is off-policy: clipped
    assert m.clip_fraction == pytest.approx(sum(c * t for c, t in seen) / sum(t for _, t in seen))


def test_kl_beta_zero_ignores_the_reference(tmp_path):
    model = tiny_qwen2()
    model.save_pretrained(tmp_path / "ref")
    policy = Policy(config(kl_beta=0.0, lr=1e-2), model=model)
    reference = ReferencePolicy(str(tmp_path / "ref"), policy.device, temperature=1.0)
    grpo_step(policy, make_samples(2, 4), step=0, reference=reference)
    assert grpo_step(policy, make_samples(2, 4), step=1, reference=reference).metrics.kl == 0.0


def test_gradient_clipping_is_applied():
    # AdamW's first update is lr * g / (|g| + eps), eps 1e-8: about lr for any |g| >> 1e-8. Clipped to a global
    # norm of 1e-12, every |g| <= 1e-12 and the update is at most lr * 1e-4.
    lr = 1e-3
    samples = make_samples(2, 4)
    moved = []
    for clip in (1.0, 1e-12):
        policy = Policy(config(grad_clip=clip, lr=lr), model=tiny_qwen2())
        before = {k: p.detach().clone() for k, p in policy.module.named_parameters()}
        grpo_step(policy, samples, step=0)
        moved.append(max(float((p.detach() - before[k]).abs().max()) for k, p in policy.module.named_parameters()))
    assert moved[0] == pytest.approx(lr, rel=0.01)
    assert moved[1] < lr * 1e-3


def test_a_model_with_dropout_still_takes_an_on_policy_first_mini_batch():
    # old logprobs come from an eval-mode pass, the update from a train-mode one: a checkpoint whose config keeps
    # dropout (attention_dropout here) made the first mini-batch off-policy (approx_kl 1.25e-4, not 0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        attention_dropout=0.3))
    policy = Policy(config(mini_batch_size=8, micro_batch_size=8), model=model)
    m = grpo_step(policy, make_samples(2, 4, seed=3), step=0).metrics
    assert m.clip_fraction == 0.0 and m.approx_kl == pytest.approx(0.0, abs=1e-7)
    assert policy.module.config.attention_dropout == 0.3  # the saved checkpoints keep the model's config


def test_a_reference_of_another_vocabulary_is_refused(tmp_path):
    # its KL compared unrelated token ids (a larger vocabulary) or failed after a whole rollout (a smaller one)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tlt.services.trainer.policy import ModelMismatchError

    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).save_pretrained(tmp_path)
    with pytest.raises(ModelMismatchError, match="vocabulary of 64 tokens, the policy 48"):
        ReferencePolicy(str(tmp_path), torch.device("cpu"), 1.0, vocab_size=VOCAB)
    assert ReferencePolicy(str(tmp_path), torch.device("cpu"), 1.0, vocab_size=64).model.config.vocab_size == 64


def _with_own_logprobs(samples: list[ScoredCompletion], shift: dict[int, float] | None = None) -> list[ScoredCompletion]:
    """`samples` carrying the random init's logprobs as their rollout logprobs (scored in one padded batch, so
    not bit-equal to the trainer's micro-batches), each row `i` in `shift` moved by shift[i]."""
    import dataclasses

    with torch.no_grad():
        lp = response_logprobs(tiny_qwen2().eval(), TokenBatch.build([s.prompt_ids for s in samples],
                                                                     [s.response_ids for s in samples])).logprobs
    shift = shift or {}
    return [dataclasses.replace(s, rollout_logprobs=tuple(float(x) + shift.get(i, 0.0)
                                                          for x in lp[i, : len(s.response_ids)]))
            for i, s in enumerate(samples)]


def _step_params(samples: list[ScoredCompletion], ref_dir, **kw):  # noqa: ANN001
    """Two updates (mini-batches of 4, micro-batches of 2, with a KL reference): the second update's ratio needs
    the old logprobs. Returns (metrics, trained parameters)."""
    if not (ref_dir / "config.json").exists():
        tiny_qwen2(seed=1).save_pretrained(ref_dir)
    cfg = config(mini_batch_size=4, micro_batch_size=2, kl_beta=0.1, **kw)
    policy = Policy(cfg, model=tiny_qwen2())
    reference = ReferencePolicy(str(ref_dir), policy.device, temperature=1.0)
    m = grpo_step(policy, samples, step=0, reference=reference).metrics
    return m, {k: p.detach().clone() for k, p in policy.module.named_parameters()}


def _by_length(samples: list[ScoredCompletion]) -> list[int]:
    """Indices of `samples` shortest first, as the step's micro-batches order them (length, then index)."""
    return sorted(range(len(samples)), key=lambda i: (len(samples[i].prompt_ids) + len(samples[i].response_ids), i))


def test_old_logprobs_from_the_rollout_train_as_the_recomputed_ones(tmp_path):
    """old_logprobs = 'rollout': the rollout's logprobs (the same weights, another batch) stand in for the trainer's
    no-grad pass on every micro-batch but the checked one, and the step trains to the same weights (1e-5)."""
    samples = _with_own_logprobs(make_samples(2, 4, seed=5))
    m_re, p_re = _step_params(samples, tmp_path)
    m_ro, p_ro = _step_params(samples, tmp_path, old_logprobs="rollout")
    assert m_re.optimizer_updates == m_ro.optimizer_updates == 2
    assert m_re.old_logprobs_from_rollout == 0 and m_ro.old_logprobs_from_rollout == 6  # 4 chunks of 2, 1 checked
    assert m_ro.rollout_logprob_max_diff < 1e-5
    assert m_ro.clip_fraction == pytest.approx(m_re.clip_fraction, abs=1e-6)
    assert m_ro.kl == pytest.approx(m_re.kl, abs=1e-6)
    for k, v in p_re.items():
        torch.testing.assert_close(p_ro[k], v, rtol=0, atol=1e-5, msg=k)
    moved = max(float((v - tiny_qwen2().state_dict()[k]).abs().max()) for k, v in p_re.items())
    assert moved > 1e-4  # the comparison above is not between two untrained models


def test_old_logprobs_check_falls_back_to_recompute(tmp_path):
    """A rollout logprob off by 0.5 in the checked (longest) micro-batch: the whole step's old logprobs are
    recomputed, so it trains exactly as 'recompute' does. Off in another micro-batch, it goes unseen (the check is
    one micro-batch a step) and the step trains otherwise: what the check can and cannot catch."""
    base = make_samples(2, 4, seed=5)
    m_re, p_re = _step_params(_with_own_logprobs(base), tmp_path)
    caught = _with_own_logprobs(base, {_by_length(base)[-1]: 0.5})  # in the checked micro-batch
    m, p = _step_params(caught, tmp_path, old_logprobs="rollout")
    assert m.old_logprobs_from_rollout == 0 and m.rollout_logprob_max_diff == pytest.approx(0.5, abs=1e-4)
    for k, v in p_re.items():
        assert torch.equal(p[k], v), k
    unseen = _with_own_logprobs(base, {_by_length(base)[0]: 0.5})
    m, p = _step_params(unseen, tmp_path, old_logprobs="rollout")
    assert m.old_logprobs_from_rollout == 6 and m.rollout_logprob_max_diff < 1e-5
    assert any(not torch.allclose(p[k], v, atol=1e-6) for k, v in p_re.items())


def test_old_logprobs_of_another_policy_version_are_recomputed(tmp_path):
    """Completions stamped with another policy version than the trainer's (a replica the push did not reach, or
    weight_push = "none"): their logprobs are another policy's, so the step recomputes them all."""
    import dataclasses

    samples = [dataclasses.replace(s, policy_version=3) for s in _with_own_logprobs(make_samples(2, 4, seed=5))]
    m, _ = _step_params(samples, tmp_path, old_logprobs="rollout")
    assert m.old_logprobs_from_rollout == 0 and m.rollout_logprob_max_diff < 1e-5


def test_bf16_without_zero_takes_the_same_first_updates_as_with_zero():
    """bf16 with zero_stage 0 (the trainer's defaults on a GPU): DeepSpeed's FP16_UnfusedOptimizer ran one AdamW
    step on zero gradients as it was built, so Adam's step count started at 1 (the first update 0.74x its size) and the
    weight decay shrank the fp32 master weights once before training. ZeRO-1 does neither; one rank, the same maths:
    after two steps the master weights of both agree, and the first update is Adam's first, lr in size."""
    masters = {}
    for zero_stage in (0, 1):
        policy = Policy(config(zero_stage=zero_stage, bf16=True, lr=1e-2, weight_decay=0.5, micro_batch_size=8),
                        model=tiny_qwen2())
        inner = policy.optimizer.optimizer  # the torch AdamW the trainer built
        assert not inner.state, "AdamW has a step before any training"
        master = [p for g in inner.param_groups for p in g["params"]]
        start = torch.cat([p.detach().flatten().float() for p in master]).clone()
        model_start = torch.cat([p.detach().flatten().float() for p in policy.module.parameters()])
        assert torch.equal(start, model_start)  # the fp32 master weights are the model's, not decayed
        for step in range(2):
            grpo_step(policy, make_samples(2, 4, seed=step + 1), step=step)
        masters[zero_stage] = torch.cat([p.detach().flatten().float() for p in master])
    assert torch.allclose(masters[0], masters[1], atol=1e-6), (masters[0] - masters[1]).abs().max()


def test_a_mini_batch_that_the_ranks_cannot_split_is_a_config_error():
    """Under the DeepSpeed launcher with 2 ranks, mini_batch_size 4 with micro_batch_size 4 (a mini-batch is one
    micro-batch per rank) ended `tlt train` in a ValueError traceback; a ConfigError is its one line."""
    from tlt.services.common.config import ConfigError
    from tlt.services.trainer.policy import deepspeed_config

    cfg = config(mini_batch_size=4, micro_batch_size=4)
    assert deepspeed_config(cfg, 1, False)["gradient_accumulation_steps"] == 1
    with pytest.raises(ConfigError, match=r"multiple of micro_batch_size x ranks \(4 x 2\)"):
        deepspeed_config(cfg, 2, False)


def test_a_group_with_a_sample_twice_and_one_missing_is_refused():
    """Prompt 0's group of n=4 holds sample 1 twice and no sample 2: the count is whole, the group is not (a
    stream that re-sent a sample under the index of a lost one); its advantages would be taken over the wrong
    members."""
    policy = Policy(config(), model=tiny_qwen2())
    twice = [ScoredCompletion(0, k, (1, 2), (3,), float(k % 2)) for k in (0, 1, 1, 3)]
    with pytest.raises(ValueError, match="group starting at prompt 0 is incomplete or duplicated"):
        grpo_step(policy, twice + [ScoredCompletion(1, k, (1, 2), (3,), 0.0) for k in range(4)], step=0)


def test_tokens_count_every_response_token_the_rollout_generated_under_overlong_filter():
    """`tokens` is the step's response tokens as the rollout generated them: a truncated response that
    overlong_filter leaves out of the loss still counts (it was generated, and it is in response_len_mean)."""
    import dataclasses

    samples = make_samples(2, 4, seed=7)
    cut = {(0, 1), (1, 2)}
    samples = [dataclasses.replace(s, finish_reason="length" if (s.prompt_index, s.sample_index) in cut else "stop")
               for s in samples]
    m = grpo_step(Policy(config(overlong_filter=True), model=tiny_qwen2()), samples, step=0).metrics
    assert m.overlong_filtered_fraction == 2 / 8
    assert m.tokens == sum(len(s.response_ids) for s in samples)


def test_each_step_shuffles_its_sequences_into_mini_batches_of_its_own(monkeypatch):
    """The mini-batch shuffle is seeded by the run and the step: step 0's and step 1's batches are split
    differently (a shuffle seeded by the run alone put the same positions together at every step)."""
    policy = Policy(config(mini_batch_size=4, micro_batch_size=4), model=tiny_qwen2())
    real = policy.logprobs
    splits: list[list[frozenset]] = []

    def recording(batch, with_entropy=False, with_hidden=False, entropy_grad=False):  # noqa: ANN001, ANN202
        if with_entropy:  # a training micro-batch: one mini-batch here
            splits[-1].append(frozenset(tuple(int(t) for t, m in zip(ids, mk) if m)
                                        for ids, mk in zip(batch.response_ids, batch.response_mask)))
        return real(batch, with_entropy=with_entropy, with_hidden=with_hidden, entropy_grad=entropy_grad)

    monkeypatch.setattr(policy, "logprobs", recording)
    monkeypatch.setattr(policy, "step", lambda: False)  # the same weights each step: only the shuffle differs
    monkeypatch.setattr(policy, "backward", lambda loss: None)
    samples = make_samples(2, 4, seed=11)
    assert len({s.response_ids for s in samples}) == 8
    found = []
    for step in range(3):
        splits.append([])
        grpo_step(policy, samples, step=step)
        found.append(frozenset(splits[-1]))
    assert len(set(found)) > 1, "every step split its sequences into the same mini-batches"


def test_with_several_epochs_each_rank_shares_its_old_logprobs_with_the_others(monkeypatch):
    """ppo_epochs = 2 over 2 ranks: each rank computes the old logprobs of its own first-pass share only, and the
    second pass trains it on the other rank's rows too; those rows are summed in from every rank (all_reduce_sum),
    or the second pass would take 0 for their old logprobs. Ranks 0 and 1 are played one after the other: each hands
    the sum its own rows (non-zero on its share, zero elsewhere), and the two shares make up the whole batch."""
    samples = make_samples(2, 4, seed=5)
    shared: dict[int, torch.Tensor] = {}
    for rank in (0, 1):
        policy = Policy(config(mini_batch_size=8, micro_batch_size=2, ppo_epochs=2), model=tiny_qwen2())
        monkeypatch.setattr(policy, "world_size", 2)
        monkeypatch.setattr(policy, "rank", rank)
        monkeypatch.setattr(policy, "backward", lambda loss: None)
        monkeypatch.setattr(policy, "step", lambda: False)
        monkeypatch.setattr(policy, "all_reduce_stats", lambda sums, tokens, diff: (sums, tokens, diff))
        monkeypatch.setattr(policy, "all_reduce_sum", lambda t, rank=rank: shared.setdefault(rank, t.clone()))
        grpo_step(policy, samples, step=0)
    assert sorted(shared) == [0, 1], "the old logprobs were not summed over the ranks"
    rows = [{int(i) for i in torch.nonzero(shared[r].abs().sum(dim=1)).flatten()} for r in (0, 1)]
    assert rows[0] and rows[1] and not rows[0] & rows[1] and rows[0] | rows[1] == set(range(8))
