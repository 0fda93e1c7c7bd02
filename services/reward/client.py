"""`RewardClient`: score completions against any `tlt.v1.Reward` server, as each one finishes.

    client = RewardClient("127.0.0.1:50061", concurrency=8, timeout_s=30, retries=3)
    fut = client.submit(ScoreRequest(id="p0-s3", completion=text, reference="52"))  # returns at once
    ...
    fut.result().reward          # 1.0 / 0.0; ok=false responses come back as they are
    for r in client.score_stream(item_generator): ...   # one stream, answers in completion order
    client.score(items)          # one Score call, answers in request order

Threads, not asyncio: `submit` returns a `concurrent.futures.Future` (an
asyncio caller wraps it with `asyncio.wrap_future`). At most `concurrency`
calls are in flight; more submissions wait in the client's queue, never in
the caller.

Timeouts are judged by progress, not per call: a call has no gRPC deadline and times out only when the server
has answered nothing of this client's for `timeout_s` since the call began (the rule `score_stream` applies to
its items). A busy, healthy server answers others meanwhile, so an item waiting in its queue is neither failed
nor scored twice; with a per-call deadline the queue's wait counted against it, an item being scored when its
deadline passed was thrown away and scored again at the back of the queue, and a server with one worker failed
16 half-second items at timeout_s = 3 (audit, session 47). So a call waits as long as the server keeps answering
the client's others (in a trainer's step: until the step's other items are scored), then at most `timeout_s`; on a
server that answers nothing each call times out `timeout_s` after it began. (Unary calls rather than a step's items
over one stream: each call is balanced round robin over the server's replicas, and a stall resends one item.)
"The server" is each address apart (services/reward/replicas.py): a target whose name resolves to several (a
headless Service's pods, an `ipv4:a,b` list) gets a channel and a progress clock per address, so a stuck replica's
calls time out `timeout_s` after they began and are retried on another while a healthy one answers the rest (one
clock for all waited until the healthy one had scored everything). The client resolves a name itself, every
`resolve_every_s` (5 s): a pod added is called within that, one removed is dropped once its calls end.
A timed-out call (DEADLINE_EXCEEDED) or a transport failure (UNAVAILABLE, ABORTED) is retried up to `retries`
times with exponential backoff (0.1 s doubling, at most 2 s; so a server answering nothing fails a call in about
(retries + 1) x timeout_s), and UNAVAILABLE (connections refused: a server restarting) on until `retry_window_s`
from the first failure (the trainer's `reward_retry_window_s`, 30 s: a reward pod's restart), then raises
`RewardUnavailableError` naming the address (and the replica's, for a name of several), what happened ("timed out":
reachable or not, nothing answered; "unavailable ... unreachable": connections refused or broken) and the last error.
A name's address refusing connections is passed over for another without counting as a failed attempt. Other gRPC errors
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED for a message over the size limit, ...) are not retried and raise
`RewardCallError`, as does a Score answer whose results cannot be matched to its items (results in another order
are matched by id). `close()` cancels queued and in-flight calls rather than waiting out their timeouts.
Cancelling one future of `submit` (`fut.cancel()`, as the trainer does for a dropped rollout attempt's items) drops
that item alone: queued, it is never sent; in flight, its call is cancelled (the server skips the item if it has not
begun it; one it is scoring runs to its end, its answer unread); waiting to retry, it is not retried. Such a future
stays pending (not `running()`) until it ends, so `cancel()` succeeds while its call is out.
A stream that breaks or stalls is reopened and the unanswered items are sent
again; answers that arrive twice are dropped, and one under an id never sent is
a `RewardCallError` (a fault of the server, which re-sending would not mend).

Reconnecting: each client has its own connection and a reconnect back-off capped at
`max_reconnect_backoff_s` (1 s), so a reward server restarted on the same port is reached again
within about that (services/common/channels.py says why).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TypeVar

import grpc

from tlt.services.common.channels import client_options
from tlt.services.common.logging import get_logger
from tlt.services.reward.replicas import NoAddress, Replica, Replicas, Resolver
from tlt.v1 import reward_pb2

ScoreRequest = reward_pb2.ScoreRequest
ScoreResponse = reward_pb2.ScoreResponse
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})
T = TypeVar("T")
log = get_logger("reward.client")


class RewardCallError(RuntimeError):
    """The reward server refused a call (not a transport problem; retrying would not help)."""


class RewardUnavailableError(RuntimeError):
    """The reward server could not be reached or did not answer, after every retry."""


class _Dropped(Exception):
    """The caller cancelled a submitted item's future: no attempt of it is made or waited for any more."""


class _NoAnswer(Exception):
    """A call timed out: the server answered nothing of the client's for `timeout_s` since it began."""


class RewardClient:
    """Thread-safe client of one reward server (every replica its address names). `resolver`: target -> its
    addresses ("ip:port"), in place of getaddrinfo (tests; a name a process of its own knows)."""

    def __init__(
        self,
        address: str,
        concurrency: int = 8,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_message_bytes: int = 64 << 20,
        max_reconnect_backoff_s: float = 1.0,
        retry_window_s: float = 0.0,
        resolver: Resolver | None = None,
        resolve_every_s: float = 5.0,
    ) -> None:
        if (concurrency < 1 or retries < 0 or timeout_s <= 0 or max_reconnect_backoff_s <= 0
                or retry_window_s < 0):
            raise ValueError(
                "RewardClient needs concurrency >= 1, retries >= 0, timeout_s > 0, max_reconnect_backoff_s > 0 "
                "and retry_window_s >= 0"
            )
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_window_s = retry_window_s
        self.backoff_s = backoff_s
        # one channel per address the target resolves to (a headless Service's pods), each with its own progress
        # clock, calls round robin over them (services/reward/replicas.py); round_robin stays the policy of a channel
        # whose target is left to gRPC
        options = [*client_options(max_message_bytes, max_reconnect_backoff_s), ("grpc.lb_policy_name", "round_robin")]
        self._replicas = Replicas(address, options, timeout_s, resolver, resolve_every_s)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward-client")
        self._closing = threading.Event()

    # ---- retries -------------------------------------------------------------------------

    def _backoff(self, failures: int) -> float:
        return min(self.backoff_s * 2 ** (failures - 1), 2.0)

    def _may_retry(self, failures: int, code: object, since: float) -> bool:
        """After `failures` failed attempts in a row, the first at `since`: `retries` of them always; past that,
        UNAVAILABLE (the server refuses connections: a restart) until `retry_window_s` from the first."""
        if failures <= self.retries:
            return True
        return (code == grpc.StatusCode.UNAVAILABLE
                and time.monotonic() - since + self._backoff(failures) <= self.retry_window_s)

    def _pause(self, seconds: float, dropped: threading.Event | None) -> bool:
        """Wait `seconds` before a retry; True (at once) when the client closes meanwhile, `_Dropped` (within 50 ms)
        when the item's future is cancelled meanwhile."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._closing.wait(min(left, 0.05)):
                return True
            if dropped is not None and dropped.is_set():
                raise _Dropped
        return self._closing.is_set()

    def _with_retries(self, what: str, call: Callable[[Replica], T], dropped: threading.Event | None = None) -> T:
        """`call(replica)` on a replica the client picks, retried as the class docstring says (a retry on another
        replica than the failed attempt's where one is as good); `_Dropped` once `dropped` is set (a submitted item
        whose future was cancelled: its call was cancelled with it), instead of another attempt."""
        last: BaseException | None = None
        failures, since = 0, 0.0
        failed: Replica | None = None
        skipped = 0  # addresses of a name refusing connections, passed over without counting a failed attempt
        while True:
            if failures and self._pause(self._backoff(failures), dropped):
                raise RewardUnavailableError(f"reward client of {self.address} closed during {what}") from last
            try:
                with self._replicas.use(failed) as replica:
                    failed = replica
                    return call(replica)
            except (grpc.RpcError, grpc.FutureCancelledError, _NoAnswer, NoAddress) as e:
                if dropped is not None and dropped.is_set():  # the caller cancelled the item (and so its call)
                    raise _Dropped from e
                if self._closing.is_set():  # close() cancelled the call
                    raise RewardUnavailableError(f"reward client of {self.address} closed during {what}") from e
                code, detail = _status(e)
                at = self._replicas.named(None if isinstance(e, NoAddress) else failed)
                if code not in RETRYABLE:
                    raise RewardCallError(f"reward server {at} refused {what}: {code} {detail}") from e
                if code == grpc.StatusCode.UNAVAILABLE:
                    self._replicas.resolve_soon()
                    if isinstance(e, grpc.RpcError) and skipped < self._replicas.count() - 1:
                        skipped += 1  # another address may answer (gRPC's round_robin calls only connected ones)
                        continue
                last = e
                failures += 1
                since = since or time.monotonic()
                if not self._may_retry(failures, code, since):
                    raise self._gave_up(what, failures, since, code, detail, at=at) from e
                log.debug("reward_retry", what=what, attempt=failures, code=str(code), address=at)

    def _gave_up(self, what: str, failures: int, since: float, code: object, detail: str,
                 unanswered: str = "", at: str = "") -> RewardUnavailableError:
        """The error of a call that failed every attempt: timed out (the server answered nothing) or, on
        UNAVAILABLE, unreachable, so the user looks for a stuck function or for a server that is down. `at`: the
        target, and the address of the last attempt where the target is a name of several."""
        at = at or self.address
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RewardUnavailableError(
                f"reward server {at} timed out on {what} after {_attempts(failures)}{unanswered}: {detail} "
                "(DEADLINE_EXCEEDED); a server that is up but answers nothing has a reward function stuck or slower "
                "than timeout_s an item (see its log)")
        unreachable = code == grpc.StatusCode.UNAVAILABLE
        why = f"unreachable (tried for {time.monotonic() - since:.1f} s): " if unreachable else ""
        return RewardUnavailableError(f"reward server {at} unavailable for {what} after "
                                      f"{_attempts(failures)}{unanswered}: {why}{code} {detail}")

    def _answer(self, replica: Replica, call: grpc.Future) -> object:
        """A unary call's response. It times out (`_NoAnswer`; the call is cancelled) only once its replica has
        answered nothing of this client's for `timeout_s` since the call began: while it answers others, the call
        is waiting in a busy server's queue, not stalled. Another replica's answers do not count: they would hide
        a stuck one beside it."""
        began = time.monotonic()
        try:
            while True:
                left = max(began, replica.last_answer) + self.timeout_s - time.monotonic()
                if left <= 0:
                    replica.timed_out(self.timeout_s)
                    raise _NoAnswer(_quiet(self.timeout_s))
                try:
                    response = call.result(timeout=left)
                except grpc.FutureTimeoutError:
                    continue
                replica.answered()
                return response
        finally:
            call.cancel()  # nothing once it is done; else the server skips the item if it has not begun it

    # ---- calls ---------------------------------------------------------------------------

    def score(self, items: Iterable[ScoreRequest]) -> list[ScoreResponse]:
        """Score a batch in one call; results in request order."""
        request = reward_pb2.ScoreBatchRequest(items=list(items))
        response = self._with_retries(
            f"Score({len(request.items)} items)", lambda r: self._answer(r, r.stub.Score.future(request))
        )
        return _in_request_order(self.address, list(request.items), list(response.results))

    def submit(self, item: ScoreRequest) -> Future[ScoreResponse]:
        """Queue one item; the future gets its response, or RewardUnavailableError / RewardCallError.

        `fut.cancel()` drops the item, queued or in flight (its call is cancelled, no retry follows), and nothing
        else: the future is the caller's, not the pool's, and stays pending until it ends, so a running item can be
        cancelled too (a pool future refuses once running). `close()` cancels the queued ones'."""
        fut: Future[ScoreResponse] = Future()
        submitted = _Submitted(fut)
        request = reward_pb2.ScoreBatchRequest(items=[item])

        def attempt(r: Replica) -> reward_pb2.ScoreBatchResponse:
            return self._answer(r, submitted.start(lambda: r.stub.Score.future(request)))  # type: ignore[return-value]

        def run() -> None:
            if fut.done():  # cancelled while queued: never sent
                return
            try:
                response = self._with_retries("Score(1 items)", attempt, submitted.dropped)
                answer = _in_request_order(self.address, [item], list(response.results))[0]
                outcome: tuple[object, BaseException | None] = (answer, None)
            except _Dropped:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the future's reader, as the pool's own futures do
                outcome = (None, e)
            _settle(fut, *outcome)

        queued = self._pool.submit(run)
        queued.add_done_callback(lambda f: f.cancelled() and fut.cancel())  # close() cancelled it, still queued
        fut.add_done_callback(lambda f: f.cancelled() and queued.cancel())  # frees its place in the queue at once
        return fut

    def score_stream(self, items: Iterable[ScoreRequest]) -> Iterator[ScoreResponse]:
        """Send items as `items` yields them; yield responses as they come (any order, matched by id).

        `items` is consumed in a helper thread, so it may block (e.g. while it
        waits for the next finished completion). Ids must be unique. An item
        unanswered `timeout_s` after it was read counts as a stalled stream; a
        stalled or broken stream is reopened (up to `retries` times in a row)
        and every unanswered item is sent again; duplicate answers are dropped.
        An answer under an id that was never sent is a RewardCallError.
        """
        stream = _StreamState(items)
        failures, since = 0, 0.0
        failed: Replica | None = None
        skipped = 0  # addresses whose stream ended UNAVAILABLE before any answer, passed over (as `_with_retries`)
        while True:
            if stream.finished():
                stream.raise_source_error()
                return
            error: grpc.RpcError | None = None
            stalled = answered = False
            try:
                with self._replicas.use(failed) as replica:
                    failed = replica
                    attempt = self._stream_attempt(stream, replica)
                    try:
                        while True:
                            try:
                                out = next(attempt)
                            except StopIteration as done:
                                error, stalled = done.value
                                break
                            failures, skipped, answered = 0, 0, True
                            yield out
                    finally:
                        attempt.close()  # the caller stopped reading: the call is cancelled now, not when collected
            except NoAddress as e:
                error = e  # type: ignore[assignment]
            stream.raise_source_error()
            if error is None and not stalled and stream.finished():
                return
            at = self._replicas.named(None if isinstance(error, NoAddress) else failed)
            if stalled:
                code, detail = grpc.StatusCode.DEADLINE_EXCEEDED, _quiet(self.timeout_s)
            elif error is not None:
                code, detail = _status(error)
                code = code or grpc.StatusCode.UNKNOWN
            else:
                code, detail = grpc.StatusCode.UNAVAILABLE, "stream closed with items unanswered"
            if code not in RETRYABLE:
                raise RewardCallError(f"reward server {at} refused ScoreStream: {code} {detail}") from error
            if code == grpc.StatusCode.UNAVAILABLE:
                self._replicas.resolve_soon()
                if isinstance(error, grpc.RpcError) and not answered and skipped < self._replicas.count() - 1:
                    skipped += 1  # another address may answer: not a failed attempt
                    continue
            failures += 1
            since = since if failures > 1 else time.monotonic()
            if not self._may_retry(failures, code, since):
                raise self._gave_up("ScoreStream", failures, since, code, detail,
                                    f" ({stream.pending()} items unanswered)", at=at) from error
            log.debug("reward_stream_retry", attempt=failures, code=str(code), unanswered=stream.pending(), address=at)
            time.sleep(self._backoff(failures))

    def _stream_attempt(self, stream: _StreamState, replica: Replica,
                        ) -> Generator[ScoreResponse, None, tuple[grpc.RpcError | None, bool]]:
        """One ScoreStream call on `replica`: yields its new answers; returns (its error, whether it stalled: none of
        its items answered for `timeout_s`, which marks the replica timed out as a unary call's silence does)."""
        attempt_over = threading.Event()
        call = replica.stub.ScoreStream(stream.feed(attempt_over))
        responses: queue.Queue[object] = queue.Queue()
        threading.Thread(target=_drain, args=(call, responses), daemon=True).start()
        try:
            while True:
                try:
                    out = responses.get(timeout=0.1)
                except queue.Empty:
                    if stream.stalled(self.timeout_s):
                        replica.timed_out(self.timeout_s)
                        return None, True
                    continue
                if out is _END:
                    return None, False
                if isinstance(out, grpc.RpcError):
                    return out, False
                if stream.answered(out):  # type: ignore[arg-type]
                    replica.answered()  # progress for the client's unary calls on it too
                    yield out  # type: ignore[misc]
                elif not stream.was_answered(answer_id := out.id):  # type: ignore[attr-defined]
                    # a server fault (as Score()'s mismatched ids), not a silence: re-sending would not mend it
                    raise RewardCallError(
                        f"reward server {self._replicas.named(replica)} answered id {answer_id!r}, which it was never "
                        f"sent (items unanswered: {stream.unanswered_ids(5)}); a server must answer each item under "
                        "its id")
        finally:
            attempt_over.set()
            call.cancel()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the server's channel is connected; RewardUnavailableError after `timeout_s`.

        A trainer checks this before its first rollout: otherwise a reward server that is down is only
        found once the first completion is scored, after the whole rollout was decoded for nothing.
        """
        if not self._replicas.wait_ready(timeout_s):
            raise RewardUnavailableError(
                f"reward server {self.address} not reachable within {timeout_s}s{self._replicas.why_none()}; start it "
                "(tlt reward serve --kind math --port PORT) or fix reward_address")

    def addresses(self, including_draining: bool = False) -> list[str]:
        """The addresses calls go to now: every one the target's name resolves to (or the target itself);
        `including_draining`: also those the name no longer has whose calls have not ended yet."""
        return self._replicas.addresses(including_draining)

    def close(self) -> None:
        """Cancel queued calls and cut off in-flight ones (closing the channel cancels them), then join the threads.

        Not waiting for in-flight calls to end on their own: against a stuck server that is (retries + 1) x
        timeout_s, which a trainer exiting after a failed step (or Ctrl-C) sat through.
        """
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._replicas.close()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Submitted:
    """One submitted item: the gRPC call of its current attempt, cancelled when its future is (thread-safe: the
    caller cancels from its thread while a pool thread starts the attempts)."""

    def __init__(self, future: Future) -> None:
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self.dropped = threading.Event()
        future.add_done_callback(self._ended)

    def _ended(self, future: Future) -> None:
        if not future.cancelled():
            return
        with self._lock:
            self.dropped.set()
            call = self._call
        if call is not None:
            call.cancel()  # the server skips the item if it has not begun it

    def start(self, begin: Callable[[], grpc.Future]) -> grpc.Future:
        """`begin()`'s call, the one a cancel now cuts off; `_Dropped` instead when the future was cancelled."""
        with self._lock:  # a cancel either sees this call or is seen here: none slips between
            if self.dropped.is_set():
                raise _Dropped
            self._call = begin()
            return self._call


def _settle(fut: Future, result: object, error: BaseException | None) -> None:
    """End `fut` with `result` or `error`, unless the caller cancelled it meanwhile (then nobody reads it)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _in_request_order(address: str, items: list[ScoreRequest], results: list[ScoreResponse]) -> list[ScoreResponse]:
    """One result per item, in the items' order; RewardCallError when the server's answer cannot be matched.

    A server that answers fewer or more results than items (a bug there, so not retried) must not have its
    results zipped onto the wrong completions; results in another order are put back in order by id.
    """
    if len(results) != len(items):
        raise RewardCallError(f"reward server {address} answered {len(results)} results for {len(items)} items")
    ids = [item.id for item in items]
    if [r.id for r in results] == ids:
        return results
    by_id = {r.id: r for r in results}
    if len(set(ids)) != len(ids) or set(by_id) != set(ids):
        raise RewardCallError(f"reward server {address} answered ids {sorted(by_id)} for items {sorted(set(ids))}")
    return [by_id[i] for i in ids]


def _attempts(n: int) -> str:
    return f"{n} attempt" if n == 1 else f"{n} attempts"


def _details(e: grpc.RpcError | None) -> str:
    return e.details() if isinstance(e, grpc.Call) and e.details() else ""


def _status(e: BaseException) -> tuple[object, str]:
    """(status code, details) of a failed attempt; a timed-out call (`_NoAnswer`) is DEADLINE_EXCEEDED, a name
    with no address (`NoAddress`) UNAVAILABLE."""
    if isinstance(e, _NoAnswer):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
    if isinstance(e, NoAddress):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    if isinstance(e, grpc.FutureCancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled"
    return (e.code() if isinstance(e, grpc.Call) else None), _details(e)  # type: ignore[arg-type]


def _quiet(timeout_s: float) -> str:
    return f"no answer from the server for {timeout_s:g} s (timeout_s)"


_END = object()


def _drain(call: Iterator[ScoreResponse], out: queue.Queue[object]) -> None:
    """Move a response stream into a queue: responses, then _END or the RpcError."""
    try:
        for response in call:
            out.put(response)
        out.put(_END)
    except grpc.RpcError as e:
        out.put(e)


class _StreamState:
    """Items read from the caller and not yet answered, shared by every attempt of one score_stream."""

    def __init__(self, items: Iterable[ScoreRequest]) -> None:
        self._lock = threading.Lock()
        self._unanswered: dict[str, tuple[ScoreRequest, float]] = {}
        # every id answered: tells a duplicate answer (dropped) from one under an id never sent (the server's fault);
        # one id per item for the stream's life
        self._answered: set[str] = set()
        self._incoming: queue.Queue[object] = queue.Queue()
        self._source_done = threading.Event()
        self._source_error: list[Exception] = []
        self._last_answer = time.monotonic()
        threading.Thread(target=self._pump, args=(iter(items),), daemon=True).start()

    def _pump(self, source: Iterator[ScoreRequest]) -> None:
        try:
            for item in source:
                with self._lock:
                    if item.id in self._unanswered:
                        raise ValueError(f"duplicate id {item.id!r} among unanswered items")
                    self._unanswered[item.id] = (item, time.monotonic())
                self._incoming.put(item)
        except Exception as e:  # noqa: BLE001 - the caller's iterator failed: re-raised in score_stream
            self._source_error.append(e)
        finally:
            self._source_done.set()
            self._incoming.put(_END)

    def feed(self, attempt_over: threading.Event) -> Iterator[ScoreRequest]:
        """One attempt's request stream: every unanswered item, then new ones as they are read (each item once: an
        unanswered item is also still queued in `_incoming` when this attempt starts).

        grpc keeps reading an ended attempt's stream in its own thread; once `attempt_over` is set that
        thread stops taking items and puts back one it took, else the item went to the dead call and was
        sent again only when the stream stalled (`timeout_s`) or the caller's items ended.
        """
        with self._lock:
            now = time.monotonic()  # a resent item gets a fresh `timeout_s`
            self._unanswered = {k: (item, now) for k, (item, _) in self._unanswered.items()}
            resend = [item for item, _ in self._unanswered.values()]
        sent = {item.id for item in resend}
        yield from resend
        while not attempt_over.is_set():
            try:
                item = self._incoming.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is _END or attempt_over.is_set():
                self._incoming.put(item)  # for the next attempt (all of them must see _END)
                return
            if item.id in sent:  # type: ignore[attr-defined]
                sent.discard(item.id)  # type: ignore[attr-defined]  # once: a later item may reuse an answered id
                continue
            yield item  # type: ignore[misc]

    def answered(self, response: ScoreResponse) -> bool:
        """Record an answer; False for an id that is not pending (a duplicate, or an id never sent: `was_answered`)."""
        with self._lock:
            if self._unanswered.pop(response.id, None) is None:
                return False
            self._answered.add(response.id)
            self._last_answer = time.monotonic()
            return True

    def was_answered(self, item_id: str) -> bool:
        with self._lock:
            return item_id in self._answered

    def unanswered_ids(self, limit: int) -> list[str]:
        with self._lock:
            return sorted(self._unanswered)[:limit]

    def stalled(self, timeout_s: float) -> bool:
        now = time.monotonic()
        with self._lock:
            oldest = min((t for _, t in self._unanswered.values()), default=None)
            return oldest is not None and now - oldest > timeout_s and now - self._last_answer > timeout_s

    def finished(self) -> bool:
        with self._lock:
            return self._source_done.is_set() and not self._unanswered

    def pending(self) -> int:
        with self._lock:
            return len(self._unanswered)

    def raise_source_error(self) -> None:
        if self._source_error:
            raise self._source_error[0]
