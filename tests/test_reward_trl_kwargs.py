"""Reward functions written for TRL's GRPOTrainer: the `trainer_state` keyword and `async def` functions.

TRL passes `trainer_state=self.state` to every reward function (trl/trainer/grpo_trainer.py `_calculate_rewards`,
"dynamic reward shaping based on training progress") and gathers `async def` functions with asyncio; here a
function naming `trainer_state` failed (missing argument), one reading `kwargs["trainer_state"]` raised KeyError,
and an async one returned a coroutine ("returned <coroutine ...>"). In-process (`FunctionRewards`) and through
a real `RewardServer` on 127.0.0.1.
"""

from __future__ import annotations

import textwrap

import pytest

from tlt.services.trainer.rewards import FunctionRewards, TrainerState

TRL_STYLE = textwrap.dedent("""
    import asyncio


    def curriculum(completions, answer, trainer_state, **kwargs):
        weight = 1.0 if trainer_state is None or trainer_state.global_step < 100 else 0.5
        return [weight * float(c.strip() == a) for c, a in zip(completions, answer)]


    def uses_state_via_kwargs(completions, answer, **kwargs):
        step = kwargs["trainer_state"].global_step
        return [float(c.strip() == a) + step for c, a in zip(completions, answer)]


    async def async_accuracy(completions, answer, **kwargs):
        await asyncio.sleep(0)
        return [float(c.strip() == a) for c, a in zip(completions, answer)]
""")


@pytest.fixture
def trl_style(tmp_path, monkeypatch):
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "trl_style_rewards.py").write_text(TRL_STYLE)
    yield importlib.import_module("trl_style_rewards")
    sys.modules.pop("trl_style_rewards", None)


def _score(source: FunctionRewards, completion: str = "7", answer: str = "7") -> float:
    batch = source.begin()
    batch.submit("k", "prompt", completion, answer)
    return batch.results()["k"].reward


def test_trainer_state_is_passed_and_follows_the_step(trl_style) -> None:
    source = FunctionRewards([trl_style.curriculum], trainer_state=TrainerState(max_steps=200))
    assert _score(source) == 1.0
    source.trainer_state.global_step = 150  # as the trainer's loop sets it before each step's rollout
    assert _score(source) == 0.5
    assert _score(FunctionRewards([trl_style.uses_state_via_kwargs])) == 1.0  # global_step 0 by default


def test_an_async_reward_function_is_awaited(trl_style) -> None:
    assert _score(FunctionRewards([trl_style.async_accuracy])) == 1.0
    assert _score(FunctionRewards([trl_style.async_accuracy]), completion="8") == 0.0


def test_served_an_async_function_scores_and_trainer_state_is_none(trl_style) -> None:
    from tlt.services.reward.client import RewardClient
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer
    from tlt.v1 import reward_pb2

    req = reward_pb2.ScoreRequest(id="a", completion="7", reference="7")
    for name, want in (("async_accuracy", 1.0), ("curriculum", 1.0)):
        config = RewardConfig(kind="python", function=f"trl_style_rewards:{name}", port=0, workers=1)
        with RewardServer(config) as server, RewardClient(server.address, timeout_s=10, retries=0) as client:
            result, = client.score([req])
        assert result.ok and result.reward == want, (name, result)


def test_the_trainer_makes_a_state_with_its_steps() -> None:
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.rewards import make_reward_source

    source = make_reward_source(TrainerConfig(reward="task", steps=37))
    assert source.trainer_state == TrainerState(global_step=0, max_steps=37)


def test_the_loop_sets_the_step_before_each_steps_rewards(random_model_dir, tmp_path, monkeypatch) -> None:
    """train() for 2 steps with a python reward function: it sees global_step 0, then 1, and max_steps 2."""
    import sys

    from rollout_helpers import ServerThread
    from test_trainer_loop import config
    from tlt.services.trainer.loop import train

    (tmp_path / "state_probe.py").write_text(
        "SEEN = []\n\n"
        "def reward(completions, trainer_state, **kw):\n"
        "    SEEN.append((trainer_state.global_step, trainer_state.max_steps))\n"
        "    return [float(len(c) % 2) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with ServerThread(random_model_dir, replicas=1) as server:
            cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", steps=2, reward="python",
                         reward_function="state_probe:reward", eval_problems=0, checkpoint_interval=0)
            assert train(cfg).steps_done == 2
        assert sorted(set(sys.modules["state_probe"].SEEN)) == [(0, 2), (1, 2)]
    finally:
        sys.modules.pop("state_probe", None)
