"""`[trainer] adv_eps` reaches the step's advantages: A_i = (r_i - group mean) / (group std + adv_eps).

Dropping the argument in grpo_step left every run on group_advantages' own 1e-6 whatever the config said, and no
test saw it (the mutation audit's s2). Checked by hand on a real step (real DeepSpeed on CPU, a tiny Qwen2 built in
code): on-policy the first mini-batch's gradient is linear in the advantages, and with two groups of the same sample
std every advantage scales by the same (std + 1e-6) / (std + adv_eps) when adv_eps changes.
"""

from __future__ import annotations

import math

import pytest
import torch

from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step
from tlt.services.trainer.types import ScoredCompletion

from test_trainer_step import config, make_samples, tiny_qwen2

REWARDS = [[0.0, 1.0, 1.0, 0.5], [1.0, 0.0, 0.0, 0.5]]  # the second is 1 - the first: the same sample std


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def _samples() -> list[ScoredCompletion]:
    base = sorted(make_samples(2, 4, seed=7), key=lambda s: (s.prompt_index, s.sample_index))
    return [ScoredCompletion(s.prompt_index, s.sample_index, s.prompt_ids, s.response_ids,
                             REWARDS[s.prompt_index][s.sample_index]) for s in base]


def _grads(monkeypatch, **kw) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The gradient the step accumulates (no optimizer update)."""
    policy = Policy(config(mini_batch_size=8, **kw), model=tiny_qwen2())
    monkeypatch.setattr(policy, "step", lambda: False)
    grpo_step(policy, _samples(), step=0)
    return {k: p.grad.detach().clone() for k, p in policy.module.named_parameters() if p.grad is not None}


def test_adv_eps_divides_the_advantages_as_configured(monkeypatch):
    mean = sum(REWARDS[0]) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS[0]) / 3)  # 0.4787 (Bessel), both groups
    default = _grads(monkeypatch)  # adv_eps 1e-6
    wide = _grads(monkeypatch, adv_eps=0.5)
    factor = (std + 1e-6) / (std + 0.5)  # 0.489: every advantage, so the whole gradient
    assert default.keys() == wide.keys() and default
    scale = max(float(g.abs().max()) for g in default.values())
    assert scale > 0
    for k in default:
        torch.testing.assert_close(wide[k], default[k] * factor, atol=1e-5 * scale, rtol=1e-4, msg=k)
