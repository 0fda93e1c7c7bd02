"""The reward client against servers that answer wrongly: a batch answer of the wrong size or order, ids that do not
name one item each, a server answering UNAVAILABLE (attempts bounded by `retries`, the backoff). Real gRPC servers
on 127.0.0.1, written here from the generated stubs. (Moved from test_reward_service.py, which reached 600 lines.)"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from tlt.services.reward.client import RewardCallError, RewardClient, RewardUnavailableError
from tlt.v1 import reward_pb2, reward_pb2_grpc

Req = reward_pb2.ScoreRequest


class _MiscountingReward(reward_pb2_grpc.RewardServicer):
    """A reward server (written here, outside the package, from the generated stubs) whose Score answers
    one result too few ("drop"), one too many ("extra"), or every result in reverse order ("reverse")."""

    def Score(self, request: reward_pb2.ScoreBatchRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreBatchResponse:
        results = [reward_pb2.ScoreResponse(id=i.id, ok=True, reward=float(len(i.completion)), correct=True)
                   for i in request.items]
        mode = request.items[0].prompt if request.items else ""
        if mode == "drop":
            results = results[:-1]
        elif mode == "extra":
            results = results + results[:1]
        elif mode == "reverse":
            results = results[::-1]
        return reward_pb2.ScoreBatchResponse(results=results)


@pytest.fixture
def miscounting() -> Iterator[str]:
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    reward_pb2_grpc.add_RewardServicer_to_server(_MiscountingReward(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_client_refuses_a_batch_answer_of_the_wrong_size(miscounting: str) -> None:
    """Score answered fewer or more results than items sent and the client returned them as they were: `score()`
    callers zipped results onto the wrong items, `submit()` raised a bare IndexError (not a reward error) for an
    empty answer and took the first of two."""
    from tlt.services.trainer.rewards import GrpcRewards, RewardError

    with RewardClient(miscounting, timeout_s=5, retries=2, backoff_s=0.01) as client:
        for mode, got in (("drop", 2), ("extra", 4)):
            start = time.monotonic()
            with pytest.raises(RewardCallError, match=f"{got} results for 3 items"):
                client.score([Req(id=f"{mode}{i}", prompt=mode, completion="x" * i) for i in range(3)])
            assert time.monotonic() - start < 1.0  # a server bug: not retried
        with pytest.raises(RewardCallError, match="0 results for 1 items"):
            client.submit(Req(id="a", prompt="drop")).result(timeout=10)
        # answers in another order are matched back to their items by id
        out = client.score([Req(id=f"r{i}", prompt="reverse", completion="x" * i) for i in range(3)])
        assert [(r.id, r.reward) for r in out] == [("r0", 0.0), ("r1", 1.0), ("r2", 2.0)]
    source = GrpcRewards(miscounting, concurrency=2, timeout_s=5, retries=0)
    try:
        batch = source.begin()
        batch.submit("k0", "drop", "c", "a")
        with pytest.raises(RewardError, match="no reward for completion k0: .*0 results for 1 items"):
            batch.results()
    finally:
        source.close()


def test_a_reordered_answer_to_items_sharing_an_id_is_refused(miscounting: str) -> None:
    """Items [d, d, e] answered [e, d, d]: matched by id, both d items would get the one result kept under d (one
    of them another completion's reward) and one d answer would be lost. Ids that do not name one item each cannot
    be matched back: a RewardCallError, as any answer that cannot be matched. In order, they are returned as they
    came."""
    with RewardClient(miscounting, timeout_s=5, retries=0) as client:
        with pytest.raises(RewardCallError, match="answered ids"):
            client.score([Req(id="d", prompt="reverse", completion="x"), Req(id="d", prompt="reverse", completion="xx"),
                          Req(id="e", prompt="reverse", completion="xxx")])
        out = client.score([Req(id="d", prompt="in order", completion="x"), Req(id="d", completion="xx")])
        assert [r.reward for r in out] == [1.0, 2.0]


class _Unavailable(reward_pb2_grpc.RewardServicer):
    """Answers every Score with UNAVAILABLE (a server shedding load, a proxy before a pod down) and counts them."""

    def __init__(self) -> None:
        self.calls = 0

    def Score(self, request, context):  # noqa: ANN001
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "try again later")


@pytest.mark.parametrize("retries", [0, 2])
def test_retries_bound_the_attempts_on_a_single_address_answering_unavailable(retries: int) -> None:
    """`retries` = N: N + 1 calls reach a server that answers UNAVAILABLE, backing off 0.1 s doubling in between. A
    target of one address has no other to pass the failure over to: none is free of the count."""
    from concurrent.futures import ThreadPoolExecutor

    servicer = _Unavailable()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    reward_pb2_grpc.add_RewardServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with RewardClient(f"127.0.0.1:{port}", timeout_s=5, retries=retries) as client:
            assert [client._backoff(n) for n in (1, 2, 3, 5, 6)] == pytest.approx([0.1, 0.2, 0.4, 1.6, 2.0])
            with pytest.raises(RewardUnavailableError, match=f"after {retries + 1} attempt"):
                client.score([Req(id="a", reference="1")])
        assert servicer.calls == retries + 1
    finally:
        server.stop(0)
