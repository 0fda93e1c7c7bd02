"""A reward server whose scoring workers are stuck: each item past `item_timeout_s` is answered ok=false and its
worker replaced; once `workers` threads are stuck the health check (deploy/healthcheck.py grpc-reward, the compose
and Kubernetes probe) fails, and passes again when they come back.

Before, a stuck item held its worker for ever and the health check (an empty Score batch, which reaches no
worker) passed while nothing was scored. Real `RewardServer` on 127.0.0.1 with real gRPC and the real health check.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from tlt.services.reward.client import RewardClient
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest
ROOT = Path(__file__).resolve().parents[1]


def _healthcheck():
    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "deploy" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _hanging_module(folder, monkeypatch, name: str) -> None:
    """A reward module `name` whose `score` waits on its RELEASE event for a completion 'hang' (30 s at most)."""
    monkeypatch.syspath_prepend(str(folder))
    (folder / f"{name}.py").write_text(
        "import threading\n\nRELEASE = threading.Event()\n\n"
        "def score(completions, **kw):\n"
        "    if completions[0] == 'hang':\n"
        "        RELEASE.wait(30)\n"
        "    return [1.0]\n")


def test_stuck_items_time_out_replace_their_worker_and_a_wedged_pool_fails_the_health_check(
        tmp_path, monkeypatch, capsys) -> None:
    _hanging_module(tmp_path, monkeypatch, "hanging_reward")
    health = _healthcheck()
    config = RewardConfig(kind="python", function="hanging_reward:score", port=0, workers=2, item_timeout_s=0.5)
    server = RewardServer(config)  # loads the function: its module holds the event that ends its wait
    release = sys.modules["hanging_reward"].RELEASE
    try:
        with server, RewardClient(server.address, timeout_s=10, retries=0) as client:
            start = time.monotonic()
            first, = client.score([Req(id="h1", completion="hang", reference="1")])
            assert not first.ok and "hanging_reward:score timed out after 0.5 s" in first.error, first
            assert time.monotonic() - start < 3
            assert client.score([Req(id="a", completion="x", reference="1")])[0].ok  # one worker stuck, one scoring
            assert health(["--timeout", "2", "grpc-reward", server.address]) == 0
            streamed = list(client.score_stream([Req(id="h2", completion="hang", reference="1")]))
            assert not streamed[0].ok and "timed out" in streamed[0].error, streamed
            assert server.servicer.pool.stuck() == 2  # both replaced: up to `workers` stuck threads are
            assert health(["--timeout", "2", "grpc-reward", server.address]) == 0
            assert not client.score([Req(id="h3", completion="hang", reference="1")])[0].ok
            assert server.servicer.pool.stuck() == 3  # not replaced: one worker scores, the server needs a restart
            assert health(["--timeout", "2", "grpc-reward", server.address]) == 1
            assert "3 scoring threads are stuck" in capsys.readouterr().err
            # only the health check's empty call is refused: a call with items is answered item by item
            assert client.score([Req(id="w", completion="x", reference="1")])[0].ok
            release.set()  # the stuck calls return: their threads score again
            deadline = time.monotonic() + 5
            while server.servicer.pool.stuck() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health(["--timeout", "2", "grpc-reward", server.address]) == 0
            results = client.score([Req(id=f"b{i}", completion="x", reference="1") for i in range(4)])
            assert all(r.ok for r in results), results
            assert len([t for t in server.servicer.pool.threads() if t.is_alive()]) == 2
    finally:
        release.set()
        sys.modules.pop("hanging_reward", None)


def test_one_worker_is_replaced_once_and_items_queued_on_a_wedged_pool_time_out(tmp_path, monkeypatch) -> None:
    """workers = 1: the first stuck item wedged the pool at once (nothing replaced), and the items queued behind it
    were never answered (only running items timed out): a Score call waited for the liveness probe's restart."""
    _hanging_module(tmp_path, monkeypatch, "hanging_reward1")
    health = _healthcheck()
    config = RewardConfig(kind="python", function="hanging_reward1:score", port=0, workers=1, item_timeout_s=0.5)
    server = RewardServer(config)
    release = sys.modules["hanging_reward1"].RELEASE
    try:
        with server, RewardClient(server.address, timeout_s=5, retries=0) as client:
            assert not client.score([Req(id="h1", completion="hang", reference="1")])[0].ok
            assert client.score([Req(id="a", completion="x", reference="1")])[0].ok  # its replacement scores
            assert health(["--timeout", "2", "grpc-reward", server.address]) == 0
            start = time.monotonic()
            stuck, queued = client.score([Req(id="h2", completion="hang", reference="1"),
                                          Req(id="q", completion="x", reference="1")])
            assert not stuck.ok and "timed out after 0.5 s" in stuck.error, stuck
            assert not queued.ok and "timed out waiting for a worker" in queued.error, queued
            assert time.monotonic() - start < 3
            assert health(["--timeout", "2", "grpc-reward", server.address]) == 1
            release.set()
            deadline = time.monotonic() + 5
            while server.servicer.pool.stuck() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health(["--timeout", "2", "grpc-reward", server.address]) == 0
            assert all(r.ok for r in client.score([Req(id=f"b{i}", completion="x", reference="1") for i in range(3)]))
            assert len([t for t in server.servicer.pool.threads() if t.is_alive()]) == 1
    finally:
        release.set()
        sys.modules.pop("hanging_reward1", None)


def test_the_timeout_is_a_documented_field_and_0_turns_it_off() -> None:
    assert RewardConfig.model_fields["item_timeout_s"].default == 60.0
    assert "health check" in RewardConfig.model_fields["item_timeout_s"].description
    RewardConfig(item_timeout_s=0)
    with pytest.raises(ValueError):
        RewardConfig(item_timeout_s=-1)


def test_a_wedged_pool_still_scores_the_items_its_last_worker_reaches_in_time() -> None:
    """workers = 2 and three stuck items: the pool is wedged (no replacement for the third) and scores on one thread.
    Items queued behind a slow one on that thread wait less than the timeout: they are scored, not answered
    "timed out waiting for a worker" at the watcher's next look (only an item that waited `timeout_s` is)."""
    import threading

    from tlt.services.reward.pool import ScoringPool

    release = threading.Event()

    def score(item: str) -> str:
        if item.startswith("hang"):
            release.wait(30)
        elif item == "slow":
            time.sleep(0.3)
        return f"scored {item}"

    pool = ScoringPool(2, 1.0, lambda item, s, waiting: f"timeout {item} waiting={waiting}")
    try:
        hung = [pool.submit(score, f"hang{i}") for i in range(3)]
        assert [f.result(timeout=10) for f in hung] == [f"timeout hang{i} waiting=False" for i in range(3)]
        assert pool.wedged() and pool.stuck() == 3
        slow, *quick = [pool.submit(score, item) for item in ("slow", "q1", "q2")]
        assert slow.result(timeout=10) == "scored slow"
        assert [f.result(timeout=10) for f in quick] == ["scored q1", "scored q2"]
    finally:
        release.set()
        pool.shutdown()
