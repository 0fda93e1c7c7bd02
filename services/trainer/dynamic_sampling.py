"""DAPO's dynamic sampling: a step trains on prompt groups whose rewards differ.

A GRPO group whose n rewards are all equal (every sample right, or every one wrong) has advantage 0 for each
sample (grpo.group_advantages): under token-mean aggregation it adds its tokens to the denominator and nothing
to the gradient, so a batch of mostly flat groups is a small, noisy update. DAPO (Yu et al. 2025, "dynamic
sampling", section 3.2) over-samples and keeps only groups with a reward spread; verl calls it
`algorithm.filter_groups`.

    round 1: prompts_per_step prompts -> n samples each -> rewards
    while informative groups < prompts_per_step and rounds < dynamic_sampling_max_rounds:
        another round of prompts_per_step fresh prompts
    train on: the first prompts_per_step informative groups in draw order, then (when short) flat groups as drawn

Filling up with flat groups, rather than failing the step as verl does past its limit, keeps every step's batch
the configured size (whole mini-batches) and costs only the flat groups' share of the update: exactly what the
step would have trained on without dynamic sampling. The loop (loop.py) runs the rounds; `select_groups` is the
choice, a pure function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tlt.services.trainer.types import PromptItem, ScoredCompletion

if TYPE_CHECKING:
    from tlt.services.trainer.collect import RolloutResult

Round = tuple[Sequence[PromptItem], Sequence[ScoredCompletion]]  # a round's prompts and its scored samples


@dataclass(frozen=True)
class Selection:
    prompts: list[PromptItem]  # the kept groups' prompts, in their new order (prompt_index 0 .. want - 1)
    samples: list[ScoredCompletion]  # their samples, prompt_index renumbered to that order
    rounds: int
    groups_generated: int
    informative_groups: int  # among those generated
    # over every generated completion, so a reward curve means the same with and without dynamic sampling
    reward_mean: float
    reward_std: float
    accuracy: float
    zero_signal_groups: float  # share of generated groups whose rewards were all equal


def informative(samples: Sequence[ScoredCompletion]) -> bool:
    """True when the group's rewards are not all equal: some sample has a non-zero advantage.

    Compared in float32, as the step's advantages are (`grpo.group_advantages`): rewards that differ only past
    float32's precision (0.1 + 0.2 against 0.3, from summed reward functions) are a flat group there too.
    """
    rewards = np.asarray([s.reward for s in samples], dtype=np.float32)
    return bool(rewards.max() != rewards.min())


def select_groups(rounds: Sequence[Round], want: int, n: int) -> Selection:
    """The `want` groups a step trains on: informative ones in draw order, then flat ones as drawn (see above)."""
    groups: list[tuple[PromptItem, list[ScoredCompletion]]] = []
    for prompts, samples in rounds:
        by_prompt: dict[int, list[ScoredCompletion]] = {i: [] for i in range(len(prompts))}
        for s in samples:
            by_prompt[s.prompt_index].append(s)
        for i, prompt in enumerate(prompts):
            group = sorted(by_prompt[i], key=lambda s: s.sample_index)
            if len(group) != n:
                raise ValueError(f"prompt {i} has {len(group)} samples, expected {n}")
            groups.append((prompt, group))
    if len(groups) < want:
        raise ValueError(f"{len(groups)} groups generated, the step needs {want}")
    spread = [g for g in groups if informative(g[1])]
    flat = [g for g in groups if not informative(g[1])]
    kept = (spread + flat)[:want]
    rewards = [s.reward for _, group in groups for s in group]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5 if len(rewards) > 1 else 0.0
    return Selection(
        prompts=[p for p, _ in kept],
        samples=[dataclasses.replace(s, prompt_index=g) for g, (_, group) in enumerate(kept) for s in group],
        rounds=len(rounds),
        groups_generated=len(groups),
        informative_groups=len(spread),
        reward_mean=mean,
        reward_std=std,
        accuracy=sum(s.correct for _, group in groups for s in group) / len(rewards),
        zero_signal_groups=len(flat) / len(groups),
    )


def informative_groups(samples: Sequence[ScoredCompletion]) -> int:
    """How many of a round's groups have a reward spread."""
    groups: dict[int, list[ScoredCompletion]] = {}
    for s in samples:
        groups.setdefault(s.prompt_index, []).append(s)
    return sum(informative(g) for g in groups.values())


def roll_out_rounds(first: Sequence[PromptItem], more: Callable[[], Sequence[PromptItem]],
                    collect_round: Callable[[Sequence[PromptItem], int], RolloutResult], want: int, n: int,
                    max_rounds: int) -> RolloutResult:
    """The loop's side: round 1 on `first`, then rounds on `more()` while too few groups are informative; the
    rounds' results merged into one RolloutResult of the selected groups (times, retries and SD counters summed)."""
    from tlt.services.trainer.collect import RolloutResult, SpecTotals

    results = [collect_round(first, 0)]
    rounds: list[Round] = [(first, results[0].samples)]
    while sum(informative_groups(r.samples) for r in results) < want and len(rounds) < max_rounds:
        prompts = more()
        results.append(collect_round(prompts, len(rounds)))
        rounds.append((prompts, results[-1].samples))
    sel = select_groups(rounds, want, n)
    times: dict[str, float] = {}
    for r in results:
        for k, v in r.times.items():
            times[k] = times.get(k, 0.0) + v
    spec = SpecTotals(sum(r.spec.verify_steps for r in results), sum(r.spec.accepted_tokens for r in results),
                      sum(r.spec.plain_steps for r in results), max(r.spec.drafter_version for r in results),
                      sum(r.spec.response_tokens for r in results))
    return RolloutResult(sel.samples, times, spec, sum(r.retries for r in results), len(rounds), sel)
