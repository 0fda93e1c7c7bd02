"""The GRPO step climbs the exact expected reward: a sceptic's check of the whole update's direction.

Responses of one token on a tiny random Qwen2 (real DeepSpeed over gloo, CPU, a torch AdamW), so each
prompt's expected reward, E_pi[r] = sum of pi(t | prompt) over the prompt's rewarded tokens t, is computed
exactly from the logits before and after a step: nothing in the measurement is sampled. The step's
completions are drawn from the policy itself, n per prompt, as the rollout draws them, with the reward 1 on a
random half of the vocabulary (a different half per prompt). The step (group advantages, PPO-clip,
mini-batches, DeepSpeed's optimizer) must raise the mean expected reward, and the same step on the flipped
rewards (r -> 1 - r) must lower it: a sign error anywhere on the way (advantages, loss, logprob alignment,
which sequence gets which reward) fails one of the two. Measured (session 42): the mean expected reward
0.502 -> 0.514-0.518 with the rewards, -> 0.485-0.486 flipped; with each group's rewards shuffled over its
sequences (an ad-hoc mutation: rewards reaching the wrong completions) it moved by -0.005 to +0.001.
"""

from __future__ import annotations

import pytest
import torch

from test_trainer_step import VOCAB, config, tiny_qwen2
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step
from tlt.services.trainer.types import ScoredCompletion

PROMPTS, N = 8, 8


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(int(t) for t in torch.randint(1, VOCAB, (3,), generator=g)) for _ in range(PROMPTS)]
    rewarded = torch.zeros(PROMPTS, VOCAB)
    for i in range(PROMPTS):
        rewarded[i, torch.randperm(VOCAB, generator=g)[: VOCAB // 2]] = 1.0
    return prompts, rewarded


@torch.no_grad()
def _next_token_probs(model: torch.nn.Module, prompts) -> torch.Tensor:
    ids = torch.tensor(prompts)  # every prompt has 3 tokens: no padding
    return model(input_ids=ids).logits[:, -1].float().softmax(-1)


def _step(flip: bool, seed: int) -> tuple[float, float]:
    prompts, rewarded = _setup()
    policy = Policy(config(prompts_per_step=PROMPTS, n_samples=N, mini_batch_size=32, micro_batch_size=16, lr=3e-3),
                    model=tiny_qwen2())
    probs = _next_token_probs(policy.module, prompts)
    before = float((probs * rewarded).sum(-1).mean())
    draws = torch.multinomial(probs, N, replacement=True, generator=torch.Generator().manual_seed(seed))
    samples = []
    for i, p in enumerate(prompts):
        for k in range(N):
            t = int(draws[i, k])
            r = float(rewarded[i, t])
            r = 1.0 - r if flip else r
            samples.append(ScoredCompletion(i, k, p, (t,), r, correct=r == 1.0))
    grpo_step(policy, samples[::-1], step=0)  # arrival order is arbitrary
    after = float((_next_token_probs(policy.module, prompts) * rewarded).sum(-1).mean())
    return before, after


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_raises_the_exact_expected_reward_and_flipped_rewards_lower_it(seed) -> None:
    before, up = _step(flip=False, seed=seed)
    same, down = _step(flip=True, seed=seed)
    assert same == before  # the same start: a seeded model, the same draws
    assert up > before + 0.008, (before, up)  # measured +0.012 to +0.016
    assert down < before - 0.008, (before, down)  # measured -0.015 to -0.016
