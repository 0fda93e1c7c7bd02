"""A blocking call inside an `async def` reward function served by `tlt reward serve` (kind python).

Every worker's coroutine runs on the process's one event loop (services/trainer/rewards.py `reward_loop`, kept so a
module-level semaphore or client works on every call), so a `time.sleep` or a synchronous HTTP call inside one holds
up every other item's scoring, and nothing said so. The server now watches the loop: when it has not run for
`[reward] async_block_warn_s` it logs `reward_loop_blocked` naming the function and the line it is stuck on, then
`reward_loop_unblocked` with how long, and counts `tlt_reward_async_loop_blocked_total`. A real server on 127.0.0.1
and a real client; the function is a module written here.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import time

import pytest

from tlt.services.reward.client import RewardClient
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.v1 import reward_pb2


BLOCKING = textwrap.dedent("""
    import asyncio
    import time


    async def judge(completions, **kw):
        if completions[0] == "block":
            time.sleep(1.5)  # the mistake: a blocking call inside a coroutine
        else:
            await asyncio.sleep(0.01)
        return [1.0]
""")


@pytest.fixture
def blocking_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "blocking_judge.py").write_text(BLOCKING)
    yield importlib.import_module("blocking_judge")
    sys.modules.pop("blocking_judge", None)


def _blocked_total(server: RewardServer) -> float:
    for line in server.metrics.render().decode().splitlines():
        if line.startswith("tlt_reward_async_loop_blocked_total "):
            return float(line.split()[1])
    raise AssertionError("no tlt_reward_async_loop_blocked_total metric")


def test_a_blocking_call_in_an_async_function_is_named_and_counted(blocking_module, capsys) -> None:
    config = RewardConfig(kind="python", function="blocking_judge:judge", port=0, workers=4,
                          async_block_warn_s=0.6)
    with RewardServer(config) as server, RewardClient(server.address, timeout_s=20, retries=0) as client:
        fast = [reward_pb2.ScoreRequest(id=f"f{i}", completion="fine", reference="1") for i in range(8)]
        assert all(r.ok for r in client.score(fast))
        assert _blocked_total(server) == 0  # a well-behaved coroutine raises no alarm
        items = [reward_pb2.ScoreRequest(id="b", completion="block", reference="1"), *fast]
        assert all(r.ok for r in client.score(items))
        logged = ""
        for _ in range(60):  # the unblocked line is written once the watchdog's beat has run (just after the item)
            logged += capsys.readouterr().err
            if "reward_loop_unblocked" in logged:
                break
            time.sleep(0.05)
        assert _blocked_total(server) == 1
    assert "reward_loop_blocked" in logged and "blocking_judge:judge" in logged
    assert "blocking_judge.py:8" in logged  # the line it is stuck on: time.sleep
    assert "reward_loop_unblocked" in logged


def test_a_sync_function_is_not_watched(blocking_module) -> None:
    config = RewardConfig(port=0, workers=1)
    with RewardServer(config) as server:
        assert server.servicer.watchdog is None


CALLABLE = '''
import asyncio


class Judge:
    async def __call__(self, completions, **kw):
        await asyncio.sleep(0)
        return [1.0]


judge = Judge()
'''


def test_an_object_with_an_async_call_is_watched_like_an_async_function(tmp_path, monkeypatch) -> None:
    """A reward "function" that is an object whose `__call__` is `async def` (a judge client with its own state) runs
    on the same event loop as an `async def` function, so its blocking calls hold up every item the same way: it is
    watched too. A partial of one is async as well; a plain function is not."""
    import functools

    from tlt.services.reward.function import is_async_function

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "callable_judge.py").write_text(CALLABLE)
    from callable_judge import judge

    async def f(completions, **kw):  # noqa: ANN001, ANN202
        return [1.0]

    assert is_async_function(judge) and is_async_function(functools.partial(f))
    assert not is_async_function(lambda completions, **kw: [1.0])
    try:
        config = RewardConfig(kind="python", function="callable_judge:judge", port=0, workers=1,
                              async_block_warn_s=0.6)
        with RewardServer(config) as server:
            assert server.servicer.watchdog is not None
    finally:
        sys.modules.pop("callable_judge", None)
