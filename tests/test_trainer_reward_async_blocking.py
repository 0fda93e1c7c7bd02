"""A blocking call inside an `async def` reward function run in-process by the trainer (`reward = "python"`).

The trainer's `FunctionRewards` awaits every `async def` function on the process's one event loop (services/trainer/
rewards.py `reward_loop`), as a reward server does, so a `time.sleep` or a synchronous HTTP call inside one stalled the
step's scoring and nothing said why. The trainer now watches that loop with the reward server's `LoopWatchdog`: when
it has not run for `[trainer] reward_async_block_warn_s` it logs `reward_loop_blocked` naming the function and the line
it is stuck on, then `reward_loop_unblocked` with how long, and counts it (`FunctionRewards.loop_blocked`). The
source is the trainer's own (`make_reward_source` of a TrainerConfig); the function is a module written here.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import time

import pytest

from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.rewards import FunctionRewards, make_reward_source

BLOCKING = textwrap.dedent("""
    import asyncio
    import time


    async def judge(completions, **kw):
        if "block" in completions:
            time.sleep(1.5)  # the mistake: a blocking call inside a coroutine
        else:
            await asyncio.sleep(0.01)
        return [1.0 for _ in completions]


    def plain(completions, **kw):
        return [1.0 for _ in completions]
""")


@pytest.fixture
def blocking_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "trainer_blocking_judge.py").write_text(BLOCKING)
    yield importlib.import_module("trainer_blocking_judge")
    sys.modules.pop("trainer_blocking_judge", None)


def _score(source, completions: list[str]) -> dict[str, float]:  # noqa: ANN001 - a RewardSource
    batch = source.begin()
    for i, c in enumerate(completions):
        batch.submit(f"k{i}", "p", c, "1")
    return {k: r.reward for k, r in batch.results().items()}


def test_a_blocking_call_in_an_in_process_async_function_is_named_and_counted(blocking_module, capsys) -> None:
    source = make_reward_source(TrainerConfig(reward="python", reward_function="trainer_blocking_judge:judge",
                                              reward_async_block_warn_s=0.6))
    try:
        assert _score(source, ["fine"] * 4) == {f"k{i}": 1.0 for i in range(4)}
        assert source.loop_blocked == 0  # a well-behaved coroutine raises no alarm
        assert "reward_loop_blocked" not in capsys.readouterr().err
        assert _score(source, ["fine", "block", "fine"]) == {"k0": 1.0, "k1": 1.0, "k2": 1.0}
        logged = ""
        for _ in range(60):  # the unblocked line is written once the watchdog's beat has run (just after the step)
            logged += capsys.readouterr().err
            if "reward_loop_unblocked" in logged:
                break
            time.sleep(0.05)
        assert source.loop_blocked == 1
    finally:
        source.close()
    assert "reward_loop_blocked" in logged and "trainer_blocking_judge:judge" in logged
    assert "trainer_blocking_judge.py:8" in logged  # the line it is stuck on: time.sleep
    assert "reward_loop_unblocked" in logged


def test_the_trainer_watches_as_the_reward_server_does_and_only_async_functions(blocking_module) -> None:
    from tlt.services.reward.config import RewardConfig

    default = TrainerConfig.model_fields["reward_async_block_warn_s"].default
    assert default == RewardConfig.model_fields["async_block_warn_s"].default == 1.0
    plain = FunctionRewards([blocking_module.plain])
    off = FunctionRewards([blocking_module.judge], async_block_warn_s=0)
    try:
        assert _score(plain, ["x"]) == {"k0": 1.0} and _score(off, ["x"]) == {"k0": 1.0}
        assert plain.watchdog is None and off.watchdog is None  # a plain def, or 0: nothing watches
    finally:
        plain.close()
        off.close()
    watched = FunctionRewards([blocking_module.judge])
    assert watched.watchdog is None  # started with the first step that awaits the function
    _score(watched, ["x"])
    assert watched.watchdog is not None and watched.watchdog.threshold_s == 1.0
    watched.close()
    assert watched.watchdog is None


STALLING = textwrap.dedent("""
    import asyncio
    import time

    calls = []


    async def judge(completions, **kw):
        calls.append(len(completions))
        if len(calls) == 1:
            time.sleep(0.9)  # the first step's scoring holds the loop once
        await asyncio.sleep(0)
        return [1.0 for _ in completions]
""")


def test_the_stalls_of_a_step_s_reward_loop_are_a_metric_of_the_step(random_model_dir, tmp_path, monkeypatch) -> None:
    """`loop_blocked` was counted on the reward source alone: the log said it, the run's metrics did not. Each
    step's line of metrics.jsonl now has `reward_loop_blocked`, the stalls during its rollout's scoring (read when
    the rollout ends: a count that moves during the update is not the step's)."""
    import json

    import torch

    from rollout_helpers import ServerThread
    from tlt.services.trainer.loop import train

    import tlt.services.trainer.rewards as rewards_mod
    import tlt.services.trainer.step as step_mod

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "trainer_stalling_judge.py").write_text(STALLING)
    sources = []
    make_source, update = rewards_mod.make_reward_source, step_mod.grpo_step

    def keep(cfg):  # noqa: ANN001, ANN202
        sources.append(make_source(cfg))
        return sources[-1]

    def stalled_during_update(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        sources[0].loop_blocked += 5  # a late wake-up of the watchdog while the step trains: not the rollout's
        return update(*args, **kwargs)

    monkeypatch.setattr(rewards_mod, "make_reward_source", keep)
    monkeypatch.setattr(step_mod, "grpo_step", stalled_during_update)
    torch.set_num_threads(1)
    out = tmp_path / "run"
    try:
        with ServerThread(random_model_dir, replicas=1) as server:
            train(TrainerConfig(model_dir=str(random_model_dir), rollout_addresses=[server.grpc_address],
                                output_dir=str(out), prompts_per_step=2, n_samples=2, max_tokens=8, mini_batch_size=4,
                                micro_batch_size=4, steps=2, checkpoint_interval=0, synthetic_problems=16,
                                torch_threads=1, connect_timeout_s=30, reward="python",
                                reward_function="trainer_stalling_judge:judge", reward_async_block_warn_s=0.3))
    finally:
        sys.modules.pop("trainer_stalling_judge", None)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_loop_blocked"] for m in lines] == [1, 0], lines
