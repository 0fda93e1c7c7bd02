"""DAPO's dynamic sampling (`[trainer] dynamic_sampling`): a step trains on groups whose rewards differ.

A GRPO group whose rewards are all equal has advantage 0 for every sample: it adds tokens to the token-mean's
denominator and nothing to the gradient. With dynamic sampling the loop rolls out further rounds of fresh prompts
until `prompts_per_step` groups with a reward spread are in hand (or `dynamic_sampling_max_rounds` ran), as DAPO
(Yu et al. 2025, section 3.2) and verl's `algorithm.filter_groups` do.

The selection is checked by hand on built groups; the loop runs against a real rollout server (replica process,
native engine, gRPC on 127.0.0.1) with a real in-process reward function whose groups are informative only for
prompts with an odd answer, so which groups a step must train on is known in advance.
"""

from __future__ import annotations

import json

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.trainer.dynamic_sampling import select_groups
from tlt.services.trainer.types import PromptItem, ScoredCompletion


def item(i: int) -> PromptItem:
    return PromptItem(index=i, prompt=f"p{i}", answer=str(i))


def group(g: int, rewards: list[float]) -> list[ScoredCompletion]:
    return [ScoredCompletion(prompt_index=g, sample_index=k, prompt_ids=(1,), response_ids=(2, 3), reward=r,
                             correct=r > 0) for k, r in enumerate(rewards)]


def test_select_by_hand():
    rounds = [([item(10), item(11)], group(0, [1, 1]) + group(1, [0, 1])),
              ([item(12), item(13)], group(0, [0.5, 0]) + group(1, [1, 0]))]
    sel = select_groups(rounds, want=2, n=2)
    # informative in draw order: 11 (round 1, group 1), 12 (round 2, group 0); 13 is beyond what the step needs
    assert [p.index for p in sel.prompts] == [11, 12]
    assert sorted((s.prompt_index, s.sample_index, s.reward) for s in sel.samples) == [
        (0, 0, 0.0), (0, 1, 1.0), (1, 0, 0.5), (1, 1, 0.0)]
    assert (sel.groups_generated, sel.informative_groups, sel.rounds) == (4, 3, 2)
    assert sel.reward_mean == pytest.approx((1 + 1 + 0 + 1 + 0.5 + 0 + 1 + 0) / 8)  # every generated completion
    assert sel.accuracy == pytest.approx(5 / 8) and sel.zero_signal_groups == pytest.approx(1 / 4)


def test_a_step_short_of_informative_groups_fills_up_with_flat_ones_in_draw_order():
    rounds = [([item(1), item(2), item(3)], group(0, [0, 0]) + group(1, [0, 1]) + group(2, [1, 1]))]
    sel = select_groups(rounds, want=3, n=2)
    assert [p.index for p in sel.prompts] == [2, 1, 3]  # the informative one first, then the flat ones as drawn
    assert sel.informative_groups == 1 and len(sel.samples) == 6
    assert sorted({s.prompt_index for s in sel.samples}) == [0, 1, 2]


def test_rewards_equal_in_float32_are_a_flat_group_as_in_the_advantages():
    # summed reward functions: 0.1 + 0.2 is 0.30000000000000004, not 0.3; the step's advantages (float32) call
    # the group flat (all 0), so dynamic sampling must not keep it as informative
    from tlt.services.trainer.grpo import group_advantages

    rewards = [0.1 + 0.2, 0.3, 0.3, 0.3]
    assert group_advantages(torch.tensor([rewards]), eps=1e-6).abs().max() == 0
    sel = select_groups([([item(1), item(2)], group(0, rewards) + group(1, [0, 1, 0, 0]))], want=1, n=4)
    assert [p.index for p in sel.prompts] == [2] and sel.informative_groups == 1
    assert sel.zero_signal_groups == pytest.approx(1 / 2)


def test_select_refuses_incomplete_groups():
    with pytest.raises(ValueError, match="prompt 0 has 1 samples, expected 2"):
        select_groups([([item(1)], group(0, [1, 0])[:1])], want=1, n=2)


# -- the loop ---------------------------------------------------------------------------------------------------

REWARD = """
def reward(prompts, completions, answer, **kw):
    # informative (one 1.0, the rest 0.0) exactly for prompts with an odd answer; flat 0.0 for even answers
    seen, out = set(), []
    for p, a in zip(prompts, answer):
        first = p not in seen
        seen.add(p)
        out.append(1.0 if int(a) % 2 and first else 0.0)
    return out
"""


def config(model_dir, address, out, **kw):
    from tlt.services.trainer.config import TrainerConfig

    base = dict(model_dir=str(model_dir), rollout_addresses=[address], output_dir=str(out), prompts_per_step=2,
                n_samples=4, max_tokens=8, mini_batch_size=8, micro_batch_size=4, lr=1e-3, steps=2,
                checkpoint_interval=1, synthetic_problems=64, torch_threads=1, connect_timeout_s=30,
                reward="python", reward_function="dyn_reward:reward", dynamic_sampling=True,
                dynamic_sampling_max_rounds=4)
    base.update(kw)
    return TrainerConfig(**base)


def expected_draws(steps: int, max_rounds: int = 4) -> list[list]:
    """The prompts each step must draw, by the rule alone: rounds of 2 fresh prompts until 2 have an odd answer
    (an informative group under REWARD) or `max_rounds` rounds ran; replayed from a fresh sampler."""
    from tlt.services.trainer.data import PromptSampler, synthetic_prompts

    sampler = PromptSampler(synthetic_prompts(64, 0), seed=0)
    out = []
    for _ in range(steps):
        prompts = sampler.next_batch(2)
        while sum(int(p.answer) % 2 for p in prompts) < 2 and len(prompts) < 2 * max_rounds:
            prompts += sampler.next_batch(2)
        out.append(prompts)
    return out


def test_the_loop_rolls_out_more_prompts_until_the_step_has_informative_groups(random_model_dir, tmp_path,
                                                                               monkeypatch):
    torch.set_num_threads(1)
    (tmp_path / "dyn_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    from tlt.services.trainer.loop import train

    out = tmp_path / "run"
    with ServerThread(random_model_dir, replicas=1) as server:
        train(config(random_model_dir, server.grpc_address, out, steps=1))
        summary = train(config(random_model_dir, server.grpc_address, out, steps=3))  # resumes after step 0
    assert summary.resumed_from == 1 and summary.steps_done == 3
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    # what each step had to draw follows from the data alone (expected_draws), across the resume too
    for m, prompts in zip(lines, expected_draws(3)):
        odd = [p.index for p in prompts if int(p.answer) % 2]
        even = [p.index for p in prompts if not int(p.answer) % 2]
        assert m["groups_generated"] == len(prompts) == 2 * m["sampling_rounds"]
        assert m["prompt_indices"] == (odd + even)[:2]  # informative groups first, in draw order; flat ones fill up
        assert m["zero_signal_groups_trained"] == (0.0 if len(odd) >= 2 else 1 - len(odd) / 2)
        # reward and accuracy describe every completion the step generated, not only the kept groups
        assert m["reward_mean"] == pytest.approx(len(odd) / (4 * len(prompts)))
        assert m["zero_signal_groups"] == pytest.approx(len(even) / len(prompts))
    rounds = [m["sampling_rounds"] for m in lines]
    assert sum(rounds) > 3  # the synthetic answers are not all odd: some step needed a second round


def test_dynamic_sampling_off_draws_one_round(random_model_dir, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    (tmp_path / "dyn_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    from tlt.services.trainer.loop import train

    with ServerThread(random_model_dir, replicas=1) as server:
        train(config(random_model_dir, server.grpc_address, tmp_path / "run", steps=1, dynamic_sampling=False))
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["sampling_rounds"] == 1 and m["groups_generated"] == 2
    assert m["prompt_indices"] == [p.index for p in expected_draws(1, max_rounds=1)[0]]


def test_the_rounds_generated_tokens_are_summed_for_the_sd_share() -> None:
    # the SD counters cover every round; so must the share's denominator (it was the trained groups' tokens)
    from tlt.services.trainer.collect import RolloutResult, SpecTotals
    from tlt.services.trainer.dynamic_sampling import roll_out_rounds
    from tlt.services.trainer.types import PromptItem, ScoredCompletion

    def collect_round(prompts, r):  # noqa: ANN001, ANN202
        samples = [ScoredCompletion(i, j, (1, 2), tuple(range(10)), float(j % 2) if r == 1 else 0.0)
                   for i in range(len(prompts)) for j in range(2)]
        spec = SpecTotals(5 * len(samples), 10 * len(samples), 0, 3, 10 * len(samples))
        return RolloutResult(samples, {"rollout_s": 1.0}, spec)

    items = [PromptItem(k, f"p{k}", "1") for k in range(6)]
    rest = iter([items[2:4]])
    res = roll_out_rounds(items[:2], lambda: next(rest), collect_round, 2, 2, 4)
    assert res.rounds == 2 and res.spec.response_tokens == res.spec.accepted_tokens == 80
    assert sum(len(s.response_ids) for s in res.samples) == 40  # what the step trains on: half
