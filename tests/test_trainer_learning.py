"""RL moves the policy toward the reward: the full loop on a toy reward, end to end.

Real rollout server (native engine, 127.0.0.1), real DeepSpeed, the weights
pushed after every step, the reward an in-process TRL-style function loaded
by name (`reward="python"`). The reward is the share of digit characters in
the completion: a random policy earns some of it, and only learning (sampled
from the rollout server, which must therefore be serving the pushed weights)
can raise it.
"""

from __future__ import annotations

import json

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train


def digits(prompts, completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


@pytest.mark.slow  # about a minute: 12 RL steps of 32 samples
def test_reward_rises_through_the_loop(random_model_dir, tmp_path):
    torch.set_num_threads(2)
    cfg = TrainerConfig(
        model_dir=str(random_model_dir), output_dir=str(tmp_path / "run"), reward="python",
        reward_function="test_trainer_learning:digits", prompts_per_step=8, n_samples=4, max_tokens=12,
        mini_batch_size=16, micro_batch_size=8, lr=3e-3, steps=12, checkpoint_interval=0, synthetic_problems=64,
        connect_timeout_s=60,
    )
    with ServerThread(random_model_dir, replicas=1) as server:
        train(cfg.model_copy(update={"rollout_addresses": [server.grpc_address]}))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["reward_mean"] for m in lines]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print("reward per step:", [round(r, 3) for r in rewards])
    assert last > 2.5 * first + 0.02, rewards  # measured: 0.034 -> 0.175 (5x) over 12 steps
    assert [m["policy_version"] for m in lines] == list(range(1, 13))
