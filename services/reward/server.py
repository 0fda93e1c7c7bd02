"""The gRPC reward server: `tlt.v1.Reward` over a verifier or a reward function, scoring items concurrently.

    ScoreRequest --check--> verifier(prompt, completion, reference) --> ScoreResponse(id, reward, ok, correct)
    ScoreRequest --check--> f(prompts=[prompt], completions=[completion], answer=[reference], **metadata)
                        --> ScoreResponse(id, reward=f's value, ok, correct=reward > 0)          (kind python)

`ScoreRequest.metadata` (the trainer sends a data row's other columns there) is
not read by the built-in verifiers; a reward function (`kind = "python"`,
services/reward/function.py) gets each entry as a keyword list. Its keys
and values count in the item's size (`max_item_bytes`). Items are scored on
`workers` threads at once: a verifier or function must be thread-safe (or
`workers = 1`). An `async def` function's calls from every worker run on the
process's one event loop (services/trainer/rewards.py `reward_loop`), as in
the trainer: a module-level `asyncio.Semaphore` or client is shared by them
all, and a blocking call inside one holds up the others; `LoopWatchdog`
(services/reward/function.py) logs `reward_loop_blocked` naming the function and
its line when the loop has not run for `async_block_warn_s`, and counts
`tlt_reward_async_loop_blocked_total`.

`Score` scores a batch on the worker pool and answers in request order; items
not begun when the call ends (its deadline passed: the client will retry it)
are skipped, counted as `errors_total{reason="call_ended"}`.
`ScoreStream` reads requests while earlier ones are being scored and sends
each response as soon as it is ready, so responses come back in completion
order and are matched by id; at most `max_inflight_per_stream` items of one
stream are in flight and at most `max_unsent_per_stream` are held unsent
(being scored, or scored and not yet sent: `StreamWindow`). At either bound
the stream stops reading requests, which is gRPC flow control for the client:
a client that sends without reading is held back instead of growing the
server's memory. grpc asks the handler for the next response only once the
previous one is sent, so a result counts as sent when it is asked for again.

An item still scoring after `item_timeout_s` is answered ok=false ("timed out") and its worker replaced, up to
`workers` stuck threads (services/reward/pool.py); once more are stuck the pool is wedged: the empty `Score` call of
the health check answers UNAVAILABLE, and an item that has waited `item_timeout_s` for a worker is answered ok=false
("timed out waiting for a worker") instead of waiting for the restart.

An item over `max_item_bytes` because of its completion (a degenerate run of long tokens) is scored
`oversized_reward` (0.0) with correct=false, unchecked, a warning and `tlt_reward_oversized_total`: answered
ok=false it failed the trainer's whole step. One whose prompt, reference and metadata alone are over it is a data
row too big for the server: ok=false (`errors_total{reason="oversized"}`).

Each item is its own error boundary: a malformed item (no id, a data row over the size
limit, no reference for a verifier) or a verifier that raises (a function that
raises or returns no finite number) gives that item ok=false with the reason,
counts an error, and never fails the call or its siblings.

A streamed message that is not a ScoreRequest at all ends its stream with
INVALID_ARGUMENT (after the items before it are answered), counted as
`errors_total{reason="undecodable"}`. ScoreStream decodes its own messages
for that reason (`_register`): when grpc's sync server fails to decode a
streamed request it sends INTERNAL itself, and when the handler then ends it
starts a second status that never completes, so the call never leaves the
server's books and `server.stop()` never returns (grpcio 1.85; the unary
`Score` is not affected: its handler never runs on an undecodable request).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
from google.protobuf.message import DecodeError

from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.common.ports import bind_grpc
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.function import FunctionScorer, ItemError, LoopWatchdog, is_async_function
from tlt.services.reward.pool import ScoringPool
from tlt.services.reward.verifiers import Verifier, get_verifier
from tlt.services.trainer.rewards import FLOAT32_MAX, reward_loop  # the proto's reward is a 32-bit float too
from tlt.v1 import reward_pb2, reward_pb2_grpc

log = get_logger("reward")
_DONE = object()
_STOP_TIMEOUT_S = 10.0  # beyond the grace period: stop() gives up waiting for grpc and says so


class UndecodableRequest(ValueError):
    """A streamed message is not a `tlt.v1.ScoreRequest`; ends the stream with INVALID_ARGUMENT."""


def _decoded(raw_requests: Iterator[bytes]) -> Iterator[reward_pb2.ScoreRequest]:
    """Parse a stream's raw messages, raising UndecodableRequest at the first that does not parse."""
    for i, raw in enumerate(raw_requests):
        try:
            yield reward_pb2.ScoreRequest.FromString(raw)
        except DecodeError as e:
            raise UndecodableRequest(f"message {i} of the stream is not a tlt.v1.ScoreRequest: {e}") from e


class StreamWindow:
    """The items one ScoreStream holds unsent: read from the client and not yet sent back.

    The stream's reader `take`s a place before it scores an item and the handler `give`s it back once the
    item's result is sent, so a client that stops reading stops the reader at `limit` items (a queue of
    finished results without this bound grew without limit). `peak` is the most it ever held.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cond = threading.Condition()

    def take(self, active: Callable[[], bool]) -> bool:
        """Wait for a place; False (and no place) once `active()` says the call is over."""
        with self._cond:
            while self.held >= self.limit:
                if not active():
                    return False
                self._cond.wait(0.5)
            self.held += 1
            self.peak = max(self.peak, self.held)
            return True

    def give(self) -> None:
        with self._cond:
            self.held -= 1
            self._cond.notify()


class RewardMetrics:
    """Prometheus metrics of one reward server."""

    def __init__(self) -> None:
        self.metrics = Metrics("tlt_reward")
        self.scored = self.metrics.counter("scored_total", "items scored", labels=("correct",))
        self.errors = self.metrics.counter("errors_total", "items answered ok=false", labels=("reason",))
        self.latency = self.metrics.histogram(
            "score_seconds", "time to score one item", buckets=(1e-4, 1e-3, 1e-2, 0.1, 1, 10)
        )
        self.inflight = self.metrics.gauge("inflight", "items being scored now")
        self.loop_blocked = self.metrics.counter(
            "async_loop_blocked_total", "times an async def function held the event loop past async_block_warn_s")
        self.oversized = self.metrics.counter(
            "oversized_total", "items whose completion put them over max_item_bytes, scored oversized_reward unchecked")


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Scores items with `verifier` (else config.kind's, or config.function's) on a shared thread pool.

    kind python loads the function here: RewardFunctionError when it cannot be imported."""

    def __init__(self, config: RewardConfig, verifier: Verifier | None = None) -> None:
        self.config = config
        self.function = FunctionScorer(config.function) if verifier is None and config.kind == "python" else None
        self.verifier = None if self.function is not None else (verifier or get_verifier(config.kind))
        self.m = RewardMetrics()
        self.pool = ScoringPool(config.workers, config.item_timeout_s, self._timed_out)
        self.watchdog = None  # an async def function's coroutines share one loop: say when one blocks it
        if self.function is not None and is_async_function(self.function.fn) and config.async_block_warn_s > 0:
            self.watchdog = LoopWatchdog(reward_loop(), config.async_block_warn_s, config.function,
                                         self.m.loop_blocked.inc).start()
        self.streams: set[StreamWindow] = set()  # the windows of the ScoreStream calls open now
        self._streams_lock = threading.Lock()

    def _check(self, item: reward_pb2.ScoreRequest) -> tuple[str, str] | None:
        """(reason label, message) when the item cannot be scored; ("oversized_completion", why) when its completion
        puts it over max_item_bytes (scored `oversized_reward`, unchecked)."""
        if not item.id:
            return "missing_id", "request has no id"
        limit = self.config.max_item_bytes
        texts = [item.prompt, item.reference, *item.metadata.keys(), *item.metadata.values()]
        row = sum(len(t.encode()) for t in texts)  # the metadata too: a huge map passed the limit
        if row > limit:
            return "oversized", (f"item's prompt, reference and metadata are {row} bytes, over the limit of {limit} "
                                 "(max_item_bytes) before its completion: the data row is too big for this server")
        if self.function is None and not item.reference.strip():  # a function decides what none means
            return "missing_reference", "request has no reference answer to check against"
        if (size := row + len(item.completion.encode())) > limit:
            return "oversized_completion", f"item of {size} bytes is over the limit of {limit} (max_item_bytes)"
        return None

    def score_one(self, item: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        """Score one item; the error boundary for that item."""
        problem = self._check(item)
        if problem is not None and problem[0] == "oversized_completion":
            # one degenerate completion (a long run of long tokens) must not fail the trainer's step, as ok=false
            # does: it is scored the minimum, never shown to a verifier that may be slow on it
            self.m.oversized.inc()
            self.m.scored.labels(correct="false").inc()
            log.warning("oversized_completion", id=item.id, why=problem[1], reward=self.config.oversized_reward)
            return reward_pb2.ScoreResponse(id=item.id, ok=True, correct=False, reward=self.config.oversized_reward)
        if problem is not None:
            self.m.errors.labels(reason=problem[0]).inc()
            return reward_pb2.ScoreResponse(id=item.id, ok=False, error=problem[1])
        start = time.perf_counter()
        self.m.inflight.inc()
        try:
            if self.function is not None:
                reward, correct = self.function(item)
            else:
                correct = bool(self.verifier(item.prompt, item.completion, item.reference))
                reward = 1.0 if correct else 0.0
        except ItemError as e:  # the function raised, returned None or no finite number: said in the message
            self.m.errors.labels(reason="function_error").inc()
            log.warning("function_failed", id=item.id, error=str(e))
            return reward_pb2.ScoreResponse(id=item.id, ok=False, error=str(e))
        except BaseException as e:  # noqa: BLE001 - a verifier bug (sys.exit too: a worker thread gets no signal)
            # must not take down the call: an uncaught BaseException here left the call unanswered until its deadline
            self.m.errors.labels(reason="verifier_error").inc()
            log.warning("verifier_failed", id=item.id, error=repr(e))
            return reward_pb2.ScoreResponse(id=item.id, ok=False, error=f"verifier failed: {type(e).__name__}: {e}")
        finally:
            self.m.inflight.dec()
            self.m.latency.observe(time.perf_counter() - start)
        if abs(reward) > FLOAT32_MAX:  # the proto's reward is a 32-bit float: 1e39 arrived as inf, with ok=true
            self.m.errors.labels(reason="function_error").inc()
            return reward_pb2.ScoreResponse(id=item.id, ok=False, error=f"reward {reward!r} is too large for the "
                                            "reward field (a 32-bit float, at most 3.4e38)")
        self.m.scored.labels(correct=str(correct).lower()).inc()
        return reward_pb2.ScoreResponse(id=item.id, ok=True, correct=correct, reward=reward)

    def _timed_out(self, item: reward_pb2.ScoreRequest, seconds: float, waiting: bool) -> reward_pb2.ScoreResponse:
        """The answer of an item still scoring after `item_timeout_s` (ScoringPool: its worker is replaced while
        the pool replaces stuck ones), or (`waiting`) one that waited that long for a worker on a wedged pool."""
        self.m.errors.labels(reason="timeout").inc()
        log.warning("item_timed_out", id=item.id, after_s=seconds, stuck_workers=self.pool.stuck(), waiting=waiting)
        if waiting:
            return reward_pb2.ScoreResponse(id=item.id, ok=False, error=f"timed out waiting for a worker after "
                                            f"{seconds:g} s (item_timeout_s): {self.pool.stuck()} scoring threads "
                                            "are stuck; the server needs a restart")
        what = f"reward function {self.config.function}" if self.function is not None else f"verifier {self.config.kind}"
        return reward_pb2.ScoreResponse(id=item.id, ok=False, error=f"{what} timed out after {seconds:g} s "
                                        "(item_timeout_s); its worker is abandoned to it")

    def score_unless_ended(self, context: grpc.ServicerContext, item: reward_pb2.ScoreRequest
                           ) -> reward_pb2.ScoreResponse:
        """`score_one`, or a refusal when the call already ended: past its deadline (or cancelled) nobody reads the
        answer, and the client retries it: scoring on would add the retry's load to the server that was too slow."""
        if not context.is_active():
            self.m.errors.labels(reason="call_ended").inc()
            return reward_pb2.ScoreResponse(id=item.id, ok=False, error="the call ended before this item was scored")
        return self.score_one(item)

    def Score(self, request: reward_pb2.ScoreBatchRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreBatchResponse:
        n = len(request.items)
        if n == 0 and self.pool.wedged():  # the health check's call (deploy/healthcheck.py): nothing is scored
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.pool.stuck()} scoring threads are stuck on items "
                          f"past item_timeout_s ({self.config.item_timeout_s:g} s), more than the "
                          f"{self.config.workers} workers the pool replaces; restart the server")
        if n > self.config.max_batch_items:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{n} items in one Score call, over the limit of {self.config.max_batch_items}; split the batch",
            )

        results = self.pool.map(functools.partial(self.score_unless_ended, context), request.items)
        return reward_pb2.ScoreBatchResponse(results=list(results))

    def ScoreStream(
        self, request_iterator: Iterator[reward_pb2.ScoreRequest], context: grpc.ServicerContext
    ) -> Iterator[reward_pb2.ScoreResponse]:
        ready: queue.Queue[object] = queue.Queue()  # bounded by `window`: every item in it holds a place
        window = StreamWindow(self.config.max_unsent_per_stream)
        slots = threading.BoundedSemaphore(self.config.max_inflight_per_stream)
        # how many submitted items have no result queued yet: a count, not their futures, so an item leaves
        # the stream's state once its result is queued (a list of every future kept every result for the
        # stream's whole life: memory grew with a long-lived stream)
        queued = threading.Condition()
        unqueued = 0
        failed: list[Exception] = []

        def deliver(fut: Future) -> None:
            nonlocal unqueued
            slots.release()
            try:
                ready.put(fut.result())
            finally:  # after the put: _DONE, queued once this count is 0, cannot overtake a result
                with queued:
                    unqueued -= 1
                    queued.notify_all()

        def read() -> None:
            nonlocal unqueued
            try:
                for item in request_iterator:
                    if not window.take(context.is_active):
                        return
                    while not slots.acquire(timeout=0.5):
                        if not context.is_active():
                            return
                    fut = self.pool.submit(functools.partial(self.score_unless_ended, context), item)
                    with queued:
                        unqueued += 1
                    fut.add_done_callback(deliver)
            except grpc.RpcError:
                pass  # the client went away; the call ends below
            except Exception as e:  # noqa: BLE001 - re-raised (or turned into a status) in the handler thread
                failed.append(e)
            finally:
                with queued:
                    queued.wait_for(lambda: unqueued == 0)  # every result is queued before _DONE
                ready.put(_DONE)

        with self._streams_lock:
            self.streams.add(window)
        try:
            reader = threading.Thread(target=read, name="reward-stream-reader", daemon=True)
            reader.start()
            while True:
                try:
                    out = ready.get(timeout=0.5)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if out is _DONE:
                    break
                yield out  # type: ignore[misc]
                window.give()  # grpc asks for the next response only once this one is sent
            if failed and isinstance(failed[0], UndecodableRequest):
                self.m.errors.labels(reason="undecodable").inc()
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(failed[0]))
            if failed:
                raise failed[0]
        finally:  # also when grpc drops the generator of a cancelled call
            with self._streams_lock:
                self.streams.discard(window)


def _register(servicer: RewardServicer, server: grpc.Server) -> None:
    """`add_RewardServicer_to_server`, except that ScoreStream gets raw bytes and decodes them (`_decoded`).

    See the module docstring for why grpc must not decode the stream itself.
    """
    handlers = {
        "Score": grpc.unary_unary_rpc_method_handler(
            servicer.Score,
            request_deserializer=reward_pb2.ScoreBatchRequest.FromString,
            response_serializer=reward_pb2.ScoreBatchResponse.SerializeToString,
        ),
        "ScoreStream": grpc.stream_stream_rpc_method_handler(
            lambda raw, context: servicer.ScoreStream(_decoded(raw), context),
            request_deserializer=None,
            response_serializer=reward_pb2.ScoreResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tlt.v1.Reward", handlers),))
    server.add_registered_method_handlers("tlt.v1.Reward", handlers)


class RewardServer:
    """A running gRPC reward server: `start()` binds (port 0 picks one), `stop()` drains."""

    def __init__(self, config: RewardConfig, verifier: Verifier | None = None) -> None:
        self.config = config
        self.servicer = RewardServicer(config, verifier)
        opts = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not shared with another server
        ]
        self._server = grpc.server(ThreadPoolExecutor(max_workers=config.workers + 16), options=opts)
        _register(self.servicer, self._server)
        self.port = 0

    @property
    def metrics(self) -> Metrics:
        return self.servicer.m.metrics

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> RewardServer:
        self.port = bind_grpc(self._server, self.config.host, self.config.port, "the reward server")
        self._server.start()
        log.info("reward_serving", host=self.config.host, port=self.port, kind=self.config.kind,
                 **({"function": self.config.function} if self.servicer.function is not None else {}),
                 workers=self.config.workers)
        return self

    def stop(self, grace_s: float | None = None) -> bool:
        """Refuse new calls, let in-flight ones finish for up to `grace_s`, then stop the workers.

        Returns whether grpc finished every call. Never waits more than `grace_s` + 10 s: past the grace
        grpc cancels what is left, so a call still open then is stuck in grpc and is logged, not waited on.
        """
        grace = self.config.grace_s if grace_s is None else grace_s
        stopped = self._server.stop(grace).wait(grace + _STOP_TIMEOUT_S)
        self.servicer.pool.shutdown()  # a stuck verifier must not hang stop()
        if self.servicer.watchdog is not None:
            self.servicer.watchdog.stop()
        if stopped:
            log.info("reward_stopped", port=self.port)
        else:
            log.error("reward_stop_incomplete", port=self.port, waited_s=grace + _STOP_TIMEOUT_S)
        return stopped

    def stuck_calls(self, wait_s: float = 1.0) -> int:
        """After `stop`: the scoring threads still running a call (a function that never returns). They are daemon
        threads (ScoringPool), but the grpc handler thread of the call that sent the item waits for its answer,
        and interpreter exit joins grpc's threads (concurrent.futures): a process that has any can only end with
        os._exit."""
        deadline = time.monotonic() + wait_s
        threads = self.servicer.pool.threads()
        for t in threads:  # idle workers exit at once after shutdown
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in threads)

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(0)
