"""The reward server's ScoreStream: answers in completion order matched by id, per-item errors, and its memory
bounds (only the items in flight are kept; a client that stops reading holds the stream at
`max_unsent_per_stream`; a cancelled stream leaves no thread behind). Real servers and gRPC clients on 127.0.0.1;
some tests plug in a verifier of their own (slow, blocking or counting) to make timing deterministic, the
server's extension point, not a fake of any process boundary. Split out of tests/test_reward_service.py."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc
import pytest

from test_reward_service import Req, _config, _stub
from tlt.services.reward.server import RewardServer
from tlt.v1 import reward_pb2, reward_pb2_grpc


def _delay_verifier(prompt: str, completion: str, reference: str) -> bool:
    time.sleep(float(prompt or 0))
    return completion == reference


def test_score_stream_answers_out_of_order_matched_by_id() -> None:
    with RewardServer(_config(), verifier=_delay_verifier) as s:
        items = [
            Req(id="slow", prompt="0.6", completion="x", reference="x"),
            Req(id="fast1", prompt="0", completion="x", reference="y"),
            Req(id="fast2", prompt="0.05", completion="z", reference="z"),
        ]
        out = list(_stub(s).ScoreStream(iter(items), timeout=10))
        assert [r.id for r in out][-1] == "slow"  # finished last although sent first
        by_id = {r.id: r for r in out}
        assert set(by_id) == {"slow", "fast1", "fast2"}
        assert (by_id["slow"].correct, by_id["fast1"].correct, by_id["fast2"].correct) == (True, False, True)


def test_stream_with_malformed_and_failing_items() -> None:
    def flaky(prompt: str, completion: str, reference: str) -> bool:
        if prompt == "boom":
            raise RuntimeError("verifier bug")
        return True

    with RewardServer(_config(), verifier=flaky) as s:
        items = [Req(id="1", prompt="boom", reference="r"), Req(id="", reference="r"), Req(id="3", reference="r")]
        out = {r.id: r for r in _stub(s).ScoreStream(iter(items), timeout=10)}
        assert not out["1"].ok and "RuntimeError: verifier bug" in out["1"].error
        assert not out[""].ok and "no id" in out[""].error
        assert out["3"].ok and out["3"].correct
        assert 'reason="verifier_error"} 1.0' in s.metrics.render().decode()


def test_a_long_stream_holds_only_the_items_in_flight() -> None:
    """ScoreStream kept every item's future (and with it its result) in a list until the stream ended, so
    a long-lived stream grew without bound. After 3000 items are answered on one stream that stays open,
    the server must still reference at most the in-flight items. Observed through weak references to what
    the real pool.submit returned (the wrapper only records; the real pool scores)."""
    limit, n = 8, 3000
    with RewardServer(_config(max_inflight_per_stream=limit)) as s:
        futures: list[weakref.ref] = []
        real_submit = s.servicer.pool.submit

        def recording_submit(*args: object, **kwargs: object) -> Future:
            fut = real_submit(*args, **kwargs)
            futures.append(weakref.ref(fut))
            return fut

        s.servicer.pool.submit = recording_submit  # type: ignore[method-assign]
        finish = threading.Event()

        def produce() -> Iterator[Req]:
            for i in range(n):
                yield Req(id=f"i{i}", completion=r"\boxed{1}", reference="1")
            finish.wait(30)  # the stream stays open while the server's state is inspected

        call = _stub(s).ScoreStream(produce(), timeout=60)
        got = [next(call) for _ in range(n)]
        gc.collect()
        alive = sum(ref() is not None for ref in futures)
        finish.set()
        assert list(call) == []
    assert len(got) == n and all(r.ok and r.correct for r in got) and len(futures) == n
    assert alive <= limit + 1, f"{alive} futures of {n} answered items still held by the stream"


def _counting_verifier(seen: list[str]) -> Callable[[str, str, str], bool]:
    def verify(prompt: str, completion: str, reference: str) -> bool:
        seen.append(prompt)  # list.append is atomic: a count of the items the server read and scored
        return completion == reference

    return verify


def _wait_until_still(seen: list[str], quiet_s: float = 0.3, limit_s: float = 5.0) -> None:
    """Return once `seen` has not grown for `quiet_s` (the server has stopped reading)."""
    deadline, last = time.monotonic() + limit_s, -1
    while len(seen) != last and time.monotonic() < deadline:
        last = len(seen)
        time.sleep(quiet_s)


def _no_bdp_channel(address: str) -> grpc.Channel:
    """A channel whose HTTP/2 receive window stays at grpc's 64 KiB (no BDP probing to grow it to MBs), so
    what the client's transport absorbs of the responses it does not read is small and known."""
    return grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])


def test_a_client_that_does_not_read_holds_the_stream_at_the_bound() -> None:
    """ScoreStream queued every finished result until the client read it, with no bound: a client sending
    without reading made the server read, score and keep all of them (here all 2000; memory without limit).
    Now the server holds at most `max_unsent_per_stream` unsent items and stops reading the stream, so gRPC
    flow control holds the client back; once the client reads, every id comes back exactly once."""
    limit, n = 16, 2000
    seen: list[str] = []
    with RewardServer(_config(max_unsent_per_stream=limit), verifier=_counting_verifier(seen)) as s:
        with _no_bdp_channel(s.address) as channel:
            ids = [f"i{i}".ljust(1000, ".") for i in range(n)]  # 1 KB responses fill the 64 KiB window fast
            call = reward_pb2_grpc.RewardStub(channel).ScoreStream(
                (Req(id=i, completion="1", reference="1") for i in ids), timeout=30
            )
            _wait_until_still(seen)
            scored = len(seen)
            # what the server holds, plus at most ~64 results in the client's 64 KiB window, plus slack
            assert scored <= limit + 200, f"the server read and scored {scored} of {n} items nobody read"
            (window,) = s.servicer.streams
            assert window.held == limit and window.peak == limit
            got = [r.id for r in call]
    assert sorted(got) == sorted(ids) and len(got) == n  # every id exactly once
    assert window.peak == limit and not s.servicer.streams


def test_the_tightest_bound_does_not_stall_a_client_that_reads() -> None:
    """One unsent item per stream (below the in-flight bound) with items finishing out of order."""
    with RewardServer(_config(max_unsent_per_stream=1), verifier=_delay_verifier) as s:
        items = [Req(id=f"t{i}", prompt=str(0.002 * (i % 3)), completion="x", reference="x") for i in range(300)]
        out = list(_stub(s).ScoreStream(iter(items), timeout=20))
    assert sorted(r.id for r in out) == sorted(i.id for i in items) and all(r.ok and r.correct for r in out)


@pytest.mark.parametrize("client", ["stops_reading", "stops_sending"])
def test_a_cancelled_stream_leaves_nothing_behind(client: str) -> None:
    """A client cancelling mid-stream ends the call on the server: its reader thread exits (from waiting for
    a place in the window, or for the next request), the handler returns, and the server still serves."""
    readers_before = {t for t in threading.enumerate() if t.name == "reward-stream-reader"}
    seen: list[str] = []
    with RewardServer(_config(max_unsent_per_stream=8), verifier=_counting_verifier(seen)) as s:
        quiet = threading.Event()

        def produce() -> Iterator[Req]:
            for i in range(2000 if client == "stops_reading" else 5):
                yield Req(id=f"c{i}".ljust(1000, "."), completion="1", reference="1")
            quiet.wait(30)  # the client neither sends nor ends its side

        with _no_bdp_channel(s.address) as channel:
            call = reward_pb2_grpc.RewardStub(channel).ScoreStream(produce(), timeout=30)
            if client == "stops_sending":
                assert len([next(call) for _ in range(5)]) == 5
            _wait_until_still(seen)
            assert len(s.servicer.streams) == 1
            call.cancel()
            deadline = time.monotonic() + 10  # a bound for a failure, not a speed target (CI runs slower)
            while time.monotonic() < deadline and (
                s.servicer.streams
                or {t for t in threading.enumerate() if t.name == "reward-stream-reader"} - readers_before
            ):
                time.sleep(0.05)
            quiet.set()
            assert not s.servicer.streams, "the handler of the cancelled stream did not return"
            left = {t for t in threading.enumerate() if t.name == "reward-stream-reader"} - readers_before
            assert not left, f"{len(left)} reader thread(s) of the cancelled stream still alive"
        assert [r.id for r in _stub(s).ScoreStream(iter([Req(id="after", reference="1")]), timeout=10)] == ["after"]
        start = time.monotonic()
        assert s.stop(0) and time.monotonic() - start < 10  # not held by the cancelled stream's 30 s wait

# ---- the client -------------------------------------------------------------------------------


def test_score_stream_sends_each_item_once() -> None:
    # the client's first attempt sent every item twice (from its resend list and again from its queue): the
    # server scored 200 items for 100 answers
    from tlt.services.reward.client import RewardClient

    scored: list[str] = []
    lock = threading.Lock()

    def counting(prompt: str, completion: str, reference: str) -> bool:
        with lock:
            scored.append(completion)
        return True

    with RewardServer(_config(), verifier=counting) as s, RewardClient(s.address, timeout_s=10, retries=0) as c:
        out = list(c.score_stream(Req(id=f"i{k}", completion=f"i{k}", reference="1") for k in range(100)))
    assert len(out) == 100 and sorted(scored) == sorted(f"i{k}" for k in range(100))


def test_items_of_an_ended_stream_are_not_scored_ahead_of_live_calls() -> None:
    # a stream cut by its deadline left its queued items on the shared pool, scored for nobody while a live call
    # waited behind them; Score already skipped such items (call_ended)
    scored: list[str] = []

    def slow(prompt: str, completion: str, reference: str) -> bool:
        if completion != "fast":
            time.sleep(0.3)
            scored.append(completion)
        return True

    with RewardServer(_config(workers=1), verifier=slow) as s:
        def items() -> Iterator:
            yield from (Req(id=f"s{i}", completion=f"s{i}", reference="1") for i in range(12))
            time.sleep(30)  # the stream stays open; its deadline ends it

        with pytest.raises(grpc.RpcError) as e:
            list(_stub(s).ScoreStream(items(), timeout=0.5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        t = time.monotonic()
        live = _stub(s).Score(reward_pb2.ScoreBatchRequest(items=[Req(id="f", completion="fast", reference="1")]),
                              timeout=10)
        waited = time.monotonic() - t
    assert live.results[0].ok and waited < 1.5, f"a live item waited {waited:.2f} s behind the ended stream's"
    assert len(scored) <= 4, scored


def test_an_id_reused_after_its_answer_is_sent_in_the_same_attempt() -> None:
    # the attempt's de-dup of resent items kept every id for its whole life: a later item reusing an answered id
    # (the client allows it once the first is answered) waited for the stall timeout and a new attempt
    from tlt.services.reward.client import _StreamState

    go = threading.Event()

    def items() -> Iterator:
        yield Req(id="a", completion="first")
        go.wait(5)
        yield Req(id="a", completion="second")

    state = _StreamState(items())
    time.sleep(0.2)  # the pump has read the first item
    over = threading.Event()
    feed = state.feed(over)
    assert next(feed).completion == "first" and state.answered(reward_pb2.ScoreResponse(id="a", ok=True))
    go.set()
    assert next(feed).completion == "second"
    over.set()


class _AnswersUnderOtherIds(reward_pb2_grpc.RewardServicer):
    """A faulty server: answers each streamed item at once, under the id `rename` gives it (twice when `twice`)."""

    def __init__(self, rename: Callable[[str], str], twice: bool = False) -> None:
        self.rename, self.twice, self.received = rename, twice, 0

    def ScoreStream(self, request_iterator, context):  # noqa: ANN001, ANN201, N802
        for r in request_iterator:
            self.received += 1
            for _ in range(2 if self.twice else 1):
                yield reward_pb2.ScoreResponse(id=self.rename(r.id), ok=True, reward=1.0, correct=True)


def _serve(servicer: reward_pb2_grpc.RewardServicer) -> tuple[grpc.Server, str]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(4))
    reward_pb2_grpc.add_RewardServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_stream_answer_under_an_id_never_sent_is_the_server_s_fault_not_a_silence() -> None:
    # answers under unknown ids were dropped as duplicates: the client waited out its timeout, re-sent every item
    # (retries + 1) times, and blamed an unavailable server ("stream closed with items unanswered"); Score() reports
    # the same fault as a RewardCallError naming the ids
    from tlt.services.reward.client import RewardCallError, RewardClient

    servicer = _AnswersUnderOtherIds(lambda i: i + "-x")
    server, address = _serve(servicer)
    try:
        with RewardClient(address, timeout_s=2.0, retries=2) as c:
            t0 = time.monotonic()
            with pytest.raises(RewardCallError, match=rf"reward server {address} answered id 'a-x', which it was never "
                                                      r"sent \(items unanswered: \['a'"):
                list(c.score_stream(Req(id=i, completion="x", reference="1") for i in "abc"))
            took = time.monotonic() - t0
    finally:
        server.stop(0)
    assert took < 1.5 and servicer.received <= 3, (took, servicer.received)  # at the first answer, nothing re-sent


def test_a_stream_answer_sent_twice_is_dropped() -> None:
    from tlt.services.reward.client import RewardClient

    server, address = _serve(_AnswersUnderOtherIds(lambda i: i, twice=True))
    try:
        with RewardClient(address, timeout_s=2.0, retries=0) as c:
            out = list(c.score_stream(Req(id=i, completion="x", reference="1") for i in "abc"))
    finally:
        server.stop(0)
    assert sorted(r.id for r in out) == ["a", "b", "c"]
