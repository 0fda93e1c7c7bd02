"""A dropped rollout attempt's reward work is cancelled: queued items never sent, in-flight calls cancelled.

The trainer drops a step's partial rollout and rolls it out again (collect_retrying: a replica died, a busy rollout
server), and its reward batch is cancelled (`_GrpcBatch.cancel`, which cancels each item's future). Only the items
still in the client's queue were dropped: a call already sent went on, the reward server scored it (or kept it in
its queue, ahead of the redo's items) and its answer was thrown away; with an expensive verifier that is the
server's capacity spent on nothing. Now cancelling a submitted item's future cancels its gRPC call too (the server
skips an item it has not begun) and stops its retries; the other items of the client are untouched.

Real reward servers on 127.0.0.1 (RewardServer, as `tlt reward serve` runs it) with a verifier of the test's own.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from tlt.services.reward.client import RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.services.trainer.rewards import GrpcRewards
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest


class Slow:
    """A verifier that records each completion it begins and takes `seconds` over it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.begun: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, prompt: str, completion: str, reference: str) -> bool:
        with self._lock:
            self.begun.append(completion)
        time.sleep(self.seconds)
        return completion == reference


def _server(verifier: Slow, workers: int) -> RewardServer:
    return RewardServer(RewardConfig(host="127.0.0.1", port=0, workers=workers, grace_s=0.5, item_timeout_s=0),
                        verifier=verifier)


def _wait_for(predicate, timeout_s: float = 3.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_a_dropped_batch_s_calls_in_flight_are_cancelled_and_the_kept_batch_is_scored_whole() -> None:
    """One worker, 0.2 s an item; a batch of 6 is sent (all in flight: concurrency 16), the server begins the first,
    then the batch is dropped. Before: the server scored all 6 (1.2 s of its worker), the kept batch's 4 waiting
    behind them. Now the one begun finishes, the other 5 are never begun, and the kept batch is scored right after."""
    slow = Slow(0.2)
    with _server(slow, workers=1) as s:
        source = GrpcRewards(s.address, concurrency=16, timeout_s=10, retries=1, retry_window_s=0)
        try:
            dropped = source.begin()
            for i in range(6):
                dropped.submit(f"d{i}", "q", f"dropped{i}", "x")
            _wait_for(lambda: len(slow.begun) >= 1)
            time.sleep(0.05)  # every call of the batch has reached the server
            t0 = time.monotonic()
            dropped.cancel()
            kept = source.begin()
            for i in range(4):
                kept.submit(f"k{i}", "q", f"kept{i}", f"kept{i}")
            results = kept.results()
            took = time.monotonic() - t0
        finally:
            source.close()
    assert sorted(results) == [f"k{i}" for i in range(4)] and all(r.reward == 1.0 for r in results.values())
    begun_dropped = [c for c in slow.begun if c.startswith("dropped")]
    assert len(begun_dropped) == 1, f"the reward server scored {begun_dropped} of the dropped batch"
    assert sorted(c for c in slow.begun if c.startswith("kept")) == [f"kept{i}" for i in range(4)]  # each once
    assert took < 1.3, f"the kept batch took {took:.2f} s behind the dropped one's items"


def test_cancelling_a_submitted_item_touches_no_other_and_a_queued_one_is_never_sent() -> None:
    """concurrency 2: items a and b in flight (one begun on the server's one worker, the other in its queue), c in
    the client's queue. Cancelling the one not begun and c: its call is cancelled (never begun), c never sent; the
    one begun and a later d are answered."""
    slow = Slow(0.3)
    with _server(slow, workers=1) as s:
        client = RewardClient(s.address, concurrency=2, timeout_s=10, retries=2)
        try:
            sent = {k: client.submit(Req(id=k, completion=k, reference=k)) for k in "abc"}
            _wait_for(lambda: len(slow.begun) == 1)
            first = slow.begun[0]
            waiting = "b" if first == "a" else "a"
            time.sleep(0.05)
            assert sent[waiting].cancel() and sent["c"].cancel()
            assert sent[waiting].cancelled() and sent["c"].cancelled()
            with pytest.raises(CancelledError):
                sent[waiting].result(timeout=1)
            d = client.submit(Req(id="d", completion="d", reference="d"))
            assert sent[first].result(timeout=3).reward == 1.0 and d.result(timeout=3).reward == 1.0
        finally:
            client.close()
    assert slow.begun == [first, "d"]


def test_a_cancelled_item_waiting_to_retry_is_not_retried() -> None:
    """An item whose first call was refused (no server yet) waits out its back-off before the next attempt;
    cancelled meanwhile it makes none: the server that comes up on the port never sees it, the next item is scored."""
    from tlt.services.common.ports import free_port

    port = free_port()
    slow = Slow(0.0)
    client = RewardClient(f"127.0.0.1:{port}", concurrency=1, timeout_s=5, retries=5, backoff_s=0.4)
    try:
        item = client.submit(Req(id="a", completion="a", reference="a"))
        time.sleep(0.2)  # the first attempt was refused: the item sleeps its back-off
        assert item.cancel()
        with RewardServer(RewardConfig(host="127.0.0.1", port=port, workers=1, grace_s=0.5, item_timeout_s=0),
                          verifier=slow):
            nxt = client.submit(Req(id="b", completion="b", reference="b"))
            assert nxt.result(timeout=4).reward == 1.0
            time.sleep(0.6)  # past the cancelled item's next attempt, had it made one
    finally:
        client.close()
    assert slow.begun == ["b"]


def test_a_client_closed_with_items_in_flight_ends_every_future() -> None:
    """close() still ends each submitted future (queued: cancelled; in flight: an error), none left waiting."""
    slow = Slow(0.5)
    with _server(slow, workers=1) as s:
        client = RewardClient(s.address, concurrency=1, timeout_s=10, retries=0)
        futures = [client.submit(Req(id=f"i{i}", completion="x", reference="x")) for i in range(3)]
        _wait_for(lambda: len(slow.begun) == 1)
        client.close()
        _wait_for(lambda: all(f.done() for f in futures), 2.0)
    assert not futures[0].cancelled() and isinstance(futures[0].exception(), RewardUnavailableError)
    assert futures[1].cancelled() and futures[2].cancelled()
