"""`async def` reward functions share one long-lived event loop per process, as TRL's GRPOTrainer runs them (its
daemon-thread loop, `start_event_loop_in_daemon`): a module-level `asyncio.Semaphore` (an LLM judge's rate limit),
client session or lock is bound to the loop of its first use, and each call ran on a fresh loop, so every step after
the first failed with "Semaphore ... is bound to a different event loop". In-process (`FunctionRewards`, 3 steps)
and through a real `RewardServer` on 127.0.0.1 whose worker threads call it at once; nothing is faked.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from tlt.services.trainer.rewards import FunctionRewards

JUDGE = textwrap.dedent("""
    import asyncio

    LIMIT = asyncio.Semaphore(1)  # module-level rate limit, as LLM-judge rewards often have
    BOTH = asyncio.Barrier(2)


    async def judge(completions, **kw):
        async def one(c):
            async with LIMIT:
                await asyncio.sleep(0.001)
                return float(len(c))
        return list(await asyncio.gather(*(one(c) for c in completions)))


    async def meets_the_other(completions, **kw):
        await asyncio.wait_for(BOTH.wait(), 2)  # only returns when the other function is waiting at the same time
        return [1.0 for _ in completions]
""")


@pytest.fixture
def judge_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "async_judge.py").write_text(JUDGE)
    yield importlib.import_module("async_judge")
    sys.modules.pop("async_judge", None)


def test_a_module_level_semaphore_works_on_every_step(judge_module) -> None:
    source = FunctionRewards([judge_module.judge])
    for step in range(3):
        batch = source.begin()
        for i in range(3):
            batch.submit(f"k{step}.{i}", "p", "x" * (i + 1), "1")
        assert {k: r.reward for k, r in batch.results().items()} == {
            f"k{step}.0": 1.0, f"k{step}.1": 2.0, f"k{step}.2": 3.0}, step


def test_the_async_functions_of_one_batch_run_together(judge_module) -> None:
    source = FunctionRewards([judge_module.meets_the_other, judge_module.meets_the_other])
    batch = source.begin()
    batch.submit("k", "p", "c", "1")
    assert batch.results()["k"].reward == 2.0


def test_a_served_async_function_with_a_module_level_semaphore(judge_module) -> None:
    from tlt.services.reward.client import RewardClient
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer
    from tlt.v1 import reward_pb2

    config = RewardConfig(kind="python", function="async_judge:judge", port=0, workers=4)
    with RewardServer(config) as server, RewardClient(server.address, timeout_s=10, retries=0) as client:
        for step in range(3):
            results = client.score([reward_pb2.ScoreRequest(id=f"{step}.{i}", completion="x" * (i + 1), reference="1")
                                    for i in range(8)])
            assert [(r.ok, r.reward) for r in results] == [(True, float(i + 1)) for i in range(8)], results
