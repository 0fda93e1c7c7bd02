"""`kind = "python"`: a user's TRL-style reward function served per item.

    f(prompts, completions, **kw) -> list[float]       # [reward] function = "module:function"

The function is loaded when the server starts (`load_function`, as `[trainer] reward = "python"` loads it: the
module on PYTHONPATH or in the current directory) and called per item as the trainer calls it in-process
(`tlt.services.trainer.rewards._call`: by keyword when it names `completions`, else positionally), with
one-element lists: `prompts=[prompt]`, `completions=[completion]`, `answer` / `answers` = `[reference]`, and
each `ScoreRequest.metadata` entry as a one-element keyword list. Metadata values are decoded as the trainer's
`GrpcRewards` encodes a data row's columns: a text value as is, any other value (a number, true / false / null,
a list, a dict) as its JSON text with its key in `ScoreRequest.json_metadata_keys`. So a key listed there arrives
decoded and any other as its text: a text column "42" stays "42", a number column 42 arrives as 42.
No `completion_ids`: a request has text only.

The value becomes the reward (a finite number; `correct` is reward > 0, as in-process); a function that
returns None for the item (TRL's "does not apply"), anything but one finite number, or raises answers that
item ok=false with the reason: one item has no other function to score it.

The server calls the function from `workers` threads at once: it must be thread-safe, or set `workers = 1`.

An `async def` function's coroutines, every worker's, run on the process's one event loop (`reward_loop`: a
module-level semaphore or client must see one loop), so a blocking call inside one (`time.sleep`, `requests.get`, a
CPU-bound loop) holds up every item being scored. Nothing can pre-empt it; `LoopWatchdog` says so: when the loop has
not run for `[reward] async_block_warn_s` it logs `reward_loop_blocked` with the function and the line it is stuck
on, then `reward_loop_unblocked` with how long it was. The fix is the function's: `await asyncio.to_thread(call)`
for a blocking call, or a plain `def` function, which the workers run in parallel.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from tlt.services.common.logging import get_logger
from tlt.services.trainer.rewards import RewardError, RewardFn, _FunctionBatch, load_function
from tlt.v1 import reward_pb2

log = get_logger("reward")


class ItemError(Exception):
    """The function gave this item no reward; the message is the item's `error`."""


def decode_metadata(item: reward_pb2.ScoreRequest) -> dict[str, Any]:
    """The request's metadata as the data row held it (see the docstring)."""
    json_keys = set(item.json_metadata_keys)
    columns: dict[str, Any] = {}
    for key, value in item.metadata.items():
        if key not in json_keys:
            columns[key] = value
            continue
        try:
            columns[key] = json.loads(value)
        except ValueError as e:
            raise ItemError(f"metadata {key!r} is listed in json_metadata_keys but is not JSON: {e}") from None
    return columns


class FunctionScorer:
    """Scores one ScoreRequest with a TRL-style reward function: (reward, correct), or ItemError.

    The item goes through the trainer's own in-process path (`_FunctionBatch`, a batch of one), so a served
    function is called, checked and its errors worded exactly as `[trainer] reward = "python"` does."""

    def __init__(self, spec: str, fn: RewardFn | None = None) -> None:
        self.spec = spec
        self.fn = fn if fn is not None else load_function(spec)  # RewardFunctionError: a config error

    def __call__(self, item: reward_pb2.ScoreRequest) -> tuple[float, bool]:
        extra = decode_metadata(item)
        batch = _FunctionBatch([(self.fn, 1.0)], names=[self.spec])
        batch.submit(item.id, item.prompt, item.completion, item.reference, extra=extra)
        try:
            result = batch.results()[item.id]
        except RewardError as e:  # raised, returned None (no other function scores the item), or no finite number
            raise ItemError(str(e)) from e
        return result.reward, result.correct


def is_async_function(fn: Any) -> bool:
    """`async def` (a function, a partial of one, or an object whose `__call__` is one): it runs on `reward_loop`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


class LoopWatchdog:
    """Logs when `loop` has not run a callback for `threshold_s`: a blocking call in a coroutine of `name`.

    A daemon thread posts a beat to the loop every `threshold_s / 4`; a beat not run within `threshold_s` means a
    callback is holding the loop. It logs `reward_loop_blocked` (the function, the innermost line outside the
    standard library and site-packages that the loop's thread is running: the user's blocking line), calls
    `on_block`, and once the beat runs logs `reward_loop_unblocked` with how long the loop was held (from the
    beat's posting: at most `threshold_s / 4` short)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threshold_s: float, name: str,
                 on_block: Callable[[], None] = lambda: None) -> None:
        self.loop, self.threshold_s, self.name, self.on_block = loop, threshold_s, name, on_block
        self._stop = threading.Event()
        self._loop_thread: int | None = None
        self._thread = threading.Thread(target=self._run, name="reward-loop-watchdog", daemon=True)

    def start(self) -> LoopWatchdog:
        first = threading.Event()  # learn the loop's thread now: an item may block it before the first beat
        self.loop.call_soon_threadsafe(self._beat, first)
        first.wait(self.threshold_s)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self, done: threading.Event) -> None:
        self._loop_thread = threading.get_ident()
        done.set()

    def where(self) -> str:
        """`file:line in function` the loop's thread is running now (its innermost frame of the user's code)."""
        ident = self._loop_thread if self._loop_thread is not None else getattr(self.loop, "_thread_id", None)
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return "unknown"
        stack = traceback.extract_stack(frame)
        own = [f for f in stack if not f.filename.startswith(_LIBRARY_DIRS)]
        f = (own or stack)[-1]
        return f"{f.filename}:{f.lineno} in {f.name}"

    def _run(self) -> None:
        while not self._stop.wait(self.threshold_s / 4):
            beat = threading.Event()
            posted = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(self._beat, beat)
            except RuntimeError:  # the loop is closed
                return
            if beat.wait(self.threshold_s):
                continue
            where = self.where()
            self.on_block()
            log.warning("reward_loop_blocked", function=self.name, blocked_s=round(time.monotonic() - posted, 2),
                        where=where, hint="a blocking call inside an async def reward function holds up every item "
                        "being scored: await it with asyncio.to_thread, or make the function a plain def")
            while not beat.wait(0.1):
                if self._stop.is_set():
                    return
            log.warning("reward_loop_unblocked", function=self.name, blocked_s=round(time.monotonic() - posted, 2),
                        where=where)
