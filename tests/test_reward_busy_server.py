"""The trainer's reward calls on a busy but healthy server, a stuck one and an unreachable one (audit, session 47).

A healthy server with one worker and a slow function, sent a step's completions at once, made items wait in its
queue past the call's deadline (`reward_timeout_s`): they were retried at the back of the queue, one being
scored when its deadline passed was scored again, and after (retries + 1) x timeout_s the step failed with
"reward server ... unavailable ... DEADLINE_EXCEEDED", sending the user after a dead server. A call now fails
only when the server answers nothing of the client's for `timeout_s` (a stall), and the message says which:
timed out (reachable, answering nothing) or unreachable.

Real servers on 127.0.0.1 (RewardServer, as `tlt reward serve` runs it) with a slow or blocking verifier of the
test's own: the server's extension point, not a fake of a process boundary.
"""

from __future__ import annotations

import threading
import time

import pytest

from tlt.services.common.ports import free_port
from tlt.services.reward.client import RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.services.trainer.rewards import GrpcRewards, RewardError
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest


def _server(verifier, workers: int = 1) -> RewardServer:  # noqa: ANN001 - (prompt, completion, reference) -> bool
    return RewardServer(RewardConfig(port=0, workers=workers, grace_s=0.5, item_timeout_s=0), verifier=verifier)


def test_busy_server_scores_a_whole_step_each_item_once() -> None:
    """16 items of 0.2 s on one worker (3.2 s of work) with timeout_s = 1 and 1 retry: every item waits in the
    server's queue longer than (retries + 1) x timeout_s allows a call, yet the server answers every 0.2 s."""
    scored: list[str] = []
    lock = threading.Lock()

    def slow(prompt: str, completion: str, reference: str) -> bool:
        time.sleep(0.2)
        with lock:
            scored.append(completion)
        return completion == reference

    with _server(slow) as s:
        source = GrpcRewards(s.address, concurrency=32, timeout_s=1.0, retries=1, retry_window_s=0)
        try:
            batch = source.begin()
            for i in range(16):
                batch.submit(f"c{i}", "q", str(i % 2), "1")
            t0 = time.monotonic()
            results = batch.results()
            elapsed = time.monotonic() - t0
        finally:
            source.close()
    assert sorted(results) == sorted(f"c{i}" for i in range(16))
    assert [results[f"c{i}"].reward for i in range(4)] == [0.0, 1.0, 0.0, 1.0]
    assert len(scored) == 16  # none scored twice (a call that timed out mid-scoring was rescored)
    assert elapsed < 8


def test_stuck_server_times_out_in_bounded_time_and_says_so() -> None:
    """A server that takes calls and answers none: each attempt waits timeout_s, then the call fails naming a
    timeout, not an unavailable server."""
    release = threading.Event()

    def stuck(prompt: str, completion: str, reference: str) -> bool:
        return release.wait(20)

    with _server(stuck, workers=2) as s:
        try:
            with RewardClient(s.address, concurrency=4, timeout_s=0.5, retries=1, backoff_s=0.01) as client:
                t0 = time.monotonic()
                futures = [client.submit(Req(id=f"s{i}", reference="1")) for i in range(3)]
                errors = [f.exception(timeout=15) for f in futures]
                elapsed = time.monotonic() - t0
        finally:
            release.set()
    for e in errors:
        assert isinstance(e, RewardUnavailableError)
        assert "timed out" in str(e) and "after 2 attempts" in str(e) and "no answer" in str(e), e
        assert "unavailable" not in str(e) and "unreachable" not in str(e), e
    assert 1.0 <= elapsed < 6  # 2 attempts of 0.5 s each


def test_one_stuck_item_among_answered_ones_fails_once_the_rest_are_scored() -> None:
    """Answers to other calls keep a waiting call alive; once they stop, the stuck item fails timeout_s later."""
    release = threading.Event()

    def some_stuck(prompt: str, completion: str, reference: str) -> bool:
        if completion == "hang":
            return release.wait(20)
        time.sleep(0.15)
        return True

    with _server(some_stuck, workers=2) as s:
        try:
            with RewardClient(s.address, concurrency=16, timeout_s=0.6, retries=0) as client:
                t0 = time.monotonic()
                stuck = client.submit(Req(id="h", completion="hang", reference="1"))
                rest = [client.submit(Req(id=f"r{i}", completion="x", reference="1")) for i in range(10)]
                assert all(f.result(timeout=10).ok for f in rest)  # 1.5 s on one worker: past timeout_s
                done = time.monotonic() - t0
                with pytest.raises(RewardUnavailableError, match="timed out"):
                    stuck.result(timeout=10)
                failed = time.monotonic() - t0
        finally:
            release.set()
    assert done > 1.2 and failed < done + 3


def test_unreachable_server_is_named_unreachable() -> None:
    source = GrpcRewards(f"127.0.0.1:{free_port()}", concurrency=1, timeout_s=1.0, retries=1, retry_window_s=0)
    try:
        batch = source.begin()
        batch.submit("only", "q", "x", "1")
        with pytest.raises(RewardError, match="no reward for completion only: .*unreachable") as caught:
            batch.results()
        assert "timed out" not in str(caught.value)
    finally:
        source.close()


def test_a_stream_on_a_busy_server_that_answers_is_not_stalled() -> None:
    """8 streamed items of 0.2 s on one worker with timeout_s = 0.5 and no retry: the last waits 1.6 s in the server's
    queue, past timeout_s, but an answer comes every 0.2 s: the stream is not stalled (it times out only once
    nothing was answered for timeout_s), so nothing is reopened or sent again."""
    scored: list[str] = []

    def slow(prompt: str, completion: str, reference: str) -> bool:
        time.sleep(0.2)
        scored.append(completion)
        return completion == reference

    with _server(slow) as s, RewardClient(s.address, timeout_s=0.5, retries=0) as client:
        got = {r.id: r.ok for r in client.score_stream(Req(id=f"s{i}", completion=str(i), reference="1")
                                                        for i in range(8))}
    assert got == {f"s{i}": True for i in range(8)}
    assert sorted(scored) == [str(i) for i in range(8)]  # each once


def test_a_streams_answers_are_progress_for_a_unary_call_waiting_behind_it() -> None:
    """A unary call queued on a one-worker server behind a stream's items waits past timeout_s, while the stream's
    answers come every 0.2 s: the server is busy, not stuck, and the call is answered rather than timed out."""

    def slow(prompt: str, completion: str, reference: str) -> bool:
        time.sleep(0.2)
        return True

    with _server(slow) as s, RewardClient(s.address, timeout_s=0.5, retries=0) as client:
        first = threading.Event()
        streamed: list[str] = []

        def read() -> None:
            for r in client.score_stream(Req(id=f"s{i}", reference="1") for i in range(8)):
                streamed.append(r.id)
                first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(10)
        answer = client.score([Req(id="u", reference="1")])[0]  # behind the stream's other items: ~1.4 s
        reader.join(10)
    assert answer.ok and answer.id == "u", answer
    assert len(streamed) == 8
