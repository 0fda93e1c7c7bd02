"""Reward sources behind one interface: score completions as they arrive.

    source.begin() -> RewardBatch
    batch.submit(key, prompt, completion, answer, extra,    # called as each completion streams in
                 messages=, completion_ids=)
    batch.results() -> {key: RewardResult}                  # waits for the rest; raises RewardError
    batch.cancel()                                          # the step failed or is redone: drop what is not scored yet

`extra` is the data row's other columns (PromptItem.extra: JSON values); `messages` the row's chat messages when
its prompt was a list of them (PromptItem.messages; `prompt` is then their rendered text); `completion_ids` the
completion's token ids, as the rollout returned them.

Two sources:
- `FunctionRewards`: in-process Python functions with TRL's contract
  `f(prompts, completions, **kw) -> list[float]`, called once per step on the
  whole batch (the contract is batch-shaped) with the reference answers as
  keyword arguments `answer` / `answers`, and each extra column of the data
  as a keyword list aligned with the completions (TRL's convention; None
  where a row lacks the column). Only the keywords the function names are
  passed, unless it takes **kw; by keyword, as TRL calls them, when the
  function names a `completions` parameter. Several functions are summed
  with weights; a function may return None for a completion it does not
  score (TRL's multi-task convention), but each completion needs a score
  from at least one. As TRL's GRPOTrainer does (trl/trainer/grpo_trainer.py,
  `_generate_and_score_completions`), a chat-message row's function gets
  `prompts` as the message lists and each completion as
  `[{"role": "assistant", "content": text}]`, and `completion_ids` (each
  completion's token ids) when it names that keyword or takes **kw. As TRL does, it
  gets `trainer_state` (`TrainerState`: `global_step`, `max_steps`) for a
  curriculum, and an `async def` function is awaited, on `reward_loop()`, watched by
  the reward server's `LoopWatchdog` (a blocking call inside one logs `reward_loop_blocked`).
- `GrpcRewards`: any `tlt.v1.Reward` server through `RewardClient`; each
  completion is submitted the moment it arrives from the rollout stream, so
  scoring overlaps the long tail of decoding. The client bounds concurrency,
  retries transport failures and times a call out only when the server has
  answered none of its calls for the timeout: a busy server, whose queue holds
  a step's completions for longer, is waited for (services/reward/client.py).
  Extra columns travel
  in `ScoreRequest.metadata`: a text value as is, any other value as JSON
  (its key listed in `json_metadata_keys`).
  A server always gets text: a chat row's prompt as the rendered chat
  template, the completion as its text; no messages, no token ids.

A reward that cannot be had (after retries: the server unreachable, or
answering nothing for the timeout; a call refused, `ok=false` in a response, a function that raises or returns the
wrong number of values or a non-finite value) fails the step with a `RewardError` that names
the completion and the cause. No reward is ever defaulted to 0.

Loading the user's function (`load_function`) is rewards_load.py's; its names are importable from here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import numbers
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from tlt.services.trainer.data import is_prefill
from tlt.services.trainer.rewards_load import RewardFn, RewardFunctionError, _is_signal, load_function
from tlt.services.trainer.types import PromptItem

__all__ = ["FunctionRewards", "GrpcRewards", "RewardBatch", "RewardError", "RewardFn", "RewardFunctionError",
           "RewardFunctionFailed", "RewardResult", "RewardSource", "TrainerState", "load_function",
           "make_reward_source", "reward_loop", "task_reference_problem", "task_rewards"]


class RewardError(RuntimeError):
    """A completion could not be scored; the RL step cannot proceed without it."""


class RewardFunctionFailed(RewardError):
    """The user's reward function raised (chained as __cause__): `tlt train` prints that traceback with its line."""


@dataclass
class TrainerState:
    """What TRL's GRPOTrainer passes reward functions as `trainer_state` (its transformers TrainerState), reduced
    to the fields a curriculum reads: `global_step` (steps done before this one: 0 at the first step; the trainer's
    loop sets it before each step's rollout) and `max_steps` ([trainer] steps). A served function has none (the
    reward server does not know the trainer's step): None when it names `trainer_state`, else not passed."""

    global_step: int = 0
    max_steps: int = 0


@dataclass(frozen=True)
class RewardResult:
    reward: float
    correct: bool  # the verifier's verdict when the source gives one, else reward > 0


Messages = Sequence[Mapping[str, Any]]  # a chat prompt: [{"role": ..., "content": ...}, ...]


class RewardBatch(Protocol):
    def submit(self, key: str, prompt: str, completion: str, answer: str,
               extra: Mapping[str, Any] | None = None, messages: Messages | None = None,
               completion_ids: Sequence[int] | None = None) -> None: ...
    def results(self) -> dict[str, RewardResult]: ...
    def cancel(self) -> None: ...


class RewardSource(Protocol):
    def begin(self) -> RewardBatch: ...
    def close(self) -> None: ...


FLOAT32_MAX = 3.4028234663852886e38  # the step holds rewards in float32: a larger one is inf there


def _check_value(key: str, value: object, origin: str) -> float:
    # numbers.Real also admits numpy scalars (a function returning list(np_array)); bools are refused. Finite in
    # float32 too: 1e39 was finite here, inf in the step, and one update later every weight was NaN.
    # float() first: a huge int or Fraction (10**400) raised OverflowError in isfinite(), not this RewardError
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        try:
            number = float(value)
        except (OverflowError, ValueError):
            pass
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX:
        raise RewardError(f"{origin} returned {_shown(value)} for completion {key}; a finite number (float32) is "
                          "required")
    return number


def _shown(value: object) -> str:
    """repr(value), cut to 80 characters; an int too long for repr (over 4300 digits) by its size."""
    try:
        text = repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


# -- in-process functions ----------------------------------------------------------------


def _call(fn: RewardFn, prompts: list[Any], completions: list[Any], answers: list[str],
          columns: Mapping[str, list[Any]], completion_ids: list[list[int]] | None = None,
          trainer_state: TrainerState | None = None) -> list[float]:
    """Call `fn` as TRL does, by keyword, when it names a `completions` parameter, else positionally.

    TRL's functions take `completions` first (`think_format_reward(completions, **kwargs)`) and get
    `prompts` among the keywords, so a positional (prompts, completions) call fails on them.
    `columns` (the data's extra columns, one list each) go as keywords, like the answers, the
    completions' token ids (`completion_ids`, when every completion came with them) and `trainer_state`.
    What it returns is returned: for an `async def` function, its coroutine (run on `reward_loop()` by the batch).
    """
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in columns.items() if takes_any or k in params}
    kw.update({k: answers for k in ("answer", "answers") if takes_any or k in params})
    if completion_ids is not None and (takes_any or "completion_ids" in params):
        kw["completion_ids"] = completion_ids
    # TRL passes it to every function; a served one has none: None only where the function names it
    if "trainer_state" in params or (takes_any and trainer_state is not None):
        kw["trainer_state"] = trainer_state
    if "completions" in params and all(
        params[k].kind is not inspect.Parameter.POSITIONAL_ONLY for k in ("prompts", "completions") if k in params
    ):
        if takes_any or "prompts" in params:
            kw["prompts"] = prompts
        return fn(completions=completions, **kw)
    return fn(prompts, completions, **kw)


_loop: asyncio.AbstractEventLoop | None = None  # reward_loop(): this process's loop for `async def` functions
_loop_pid = 0
_loop_lock = threading.Lock()


def reward_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for `async def` reward functions, run on a daemon thread started at first use.

    One loop for every call, as TRL's GRPOTrainer keeps one (`start_event_loop_in_daemon`): what a function's module
    binds to the loop it is first used on (an `asyncio.Semaphore` rate limit, an `httpx.AsyncClient`, an aiohttp
    session) works on every later step. A fresh loop per call (`asyncio.run`) failed every step after the first
    ("bound to a different event loop"), and a reward server's threads, each on its own loop, hung on such a
    semaphore. The trainer and every reward-server worker thread submit to this loop; a forked child starts its own.
    """
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="reward-async-loop", daemon=True).start()
        return _loop


async def _awaiting(awaitable: Any) -> Any:
    return await awaitable


class _FunctionBatch:
    def __init__(self, fns: Sequence[tuple[RewardFn, float]], names: Sequence[str] | None = None,
                 trainer_state: TrainerState | None = None, on_async: Callable[[], None] | None = None) -> None:
        self._fns = fns
        self._state = trainer_state
        self._on_async = on_async  # called before a coroutine is submitted to reward_loop() (FunctionRewards._watch)
        # how errors name each function: its qualified name, or what the user wrote (a served "module:function")
        self._names = list(names) if names is not None else [getattr(fn, "__qualname__", repr(fn)) for fn, _ in fns]
        self._keys: list[str] = []
        self._prompts: list[str] = []
        self._completions: list[str] = []
        self._answers: list[str] = []
        self._extras: list[Mapping[str, Any]] = []
        self._messages: list[Messages | None] = []
        self._ids: list[Sequence[int] | None] = []

    def submit(self, key: str, prompt: str, completion: str, answer: str,
               extra: Mapping[str, Any] | None = None, messages: Messages | None = None,
               completion_ids: Sequence[int] | None = None) -> None:
        self._keys.append(key)
        self._prompts.append(prompt)
        self._completions.append(completion)
        self._answers.append(answer)
        self._extras.append(extra or {})
        self._messages.append(messages)
        self._ids.append(completion_ids)

    def _trl_inputs(self) -> tuple[list[Any], list[Any]]:
        """(prompts, completions) as TRL hands them to a function: texts, or for a chat-message row its messages and
        `[{"role": "assistant", "content": text}]`. Fresh lists per call: a function may edit them (TRL's own trainer
        pops a prefill off a prompt), and the row's messages are read again by every later step."""
        prompts: list[Any] = []
        completions: list[Any] = []
        for p, c, m in zip(self._prompts, self._completions, self._messages):
            if m is None:
                prompts.append(p)
                completions.append(c)
                continue
            # a prefill (a final assistant message, continued by the model) leaves the prompt and opens the
            # completion, as TRL's `bootstrap = prompt.pop()["content"]` does
            opening = m[-1]["content"] if is_prefill(m) else ""
            prompts.append([dict(x) for x in (m[:-1] if is_prefill(m) else m)])
            completions.append([{"role": "assistant", "content": opening + c}])
        return prompts, completions

    def _columns(self) -> dict[str, list[Any]]:
        """Each extra column as one list aligned with the completions; None where a row lacks it."""
        names = dict.fromkeys(k for e in self._extras for k in e)
        return {k: [e.get(k) for e in self._extras] for k in names}

    @contextlib.contextmanager
    def _boundary(self, name: str) -> Iterator[None]:
        """What the user's function `name` raises becomes a RewardFunctionFailed naming it (chained).

        The contract is batch-shaped, so one bad completion fails the whole call: the step fails with the
        function's name and error, as for every other reward that cannot be had."""
        try:
            yield
        except RewardError:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's code: SystemExit, a timeout library's BaseException too
            if _is_signal(e):
                raise
            raise RewardFunctionFailed(f"reward function {name} raised {type(e).__name__}: {e} "
                              f"(scoring {len(self._keys)} completions, first {self._keys[:1]})") from e

    def _start(self, fn: RewardFn, name: str, columns: Mapping[str, list[Any]]) -> list[object] | Future:
        """Call `fn`: a plain function's values, or an `async def` one's coroutine submitted to `reward_loop()`
        (a Future), so the batch's async functions run there together, as TRL gathers them."""
        with self._boundary(name):
            ids = None if any(i is None for i in self._ids) else [list(i) for i in self._ids]
            values = _call(fn, *self._trl_inputs(), self._answers, columns, ids, self._state)
            if not inspect.isawaitable(values):
                return self._listed(values, name)
        if self._on_async is not None:
            self._on_async()
        return asyncio.run_coroutine_threadsafe(_awaiting(values), reward_loop())

    def _values(self, started: list[object] | Future, name: str) -> list[object]:
        """The function's values: `started`, or what its coroutine returns (waited for here)."""
        if not isinstance(started, Future):
            return started
        with self._boundary(name):
            return self._listed(started.result(), name)

    def _listed(self, values: Any, name: str) -> list[object]:
        """`values` as a list; RewardError when they are no sequence. Read inside the boundary: a generator
        function's code runs only as they are read."""
        # a mapping or a set is iterable too: its keys, or an order of its own, were taken for the rewards
        if isinstance(values, (str, bytes, Mapping, AbstractSet)) or not isinstance(values, Iterable):
            raise RewardError(f"reward function {name} returned {values!r}; a list of {len(self._keys)} "
                              "numbers is required")
        return list(values)

    def results(self) -> dict[str, RewardResult]:
        """The weighted sum of the functions' values per completion. A function may return None for a completion
        it does not score (TRL's multi-task convention: the others' values make its reward); a completion that no
        function scored has no reward, and the step fails (TRL sums it to 0 with a warning)."""
        columns = self._columns()
        started: list[list[object] | Future] = []
        try:  # every function is called before any is waited for: the async ones run meanwhile, all at once
            for (fn, _), name in zip(self._fns, self._names):
                started.append(self._start(fn, name, columns))
            return self._summed([self._values(s, name) for s, name in zip(started, self._names)])
        finally:  # a failed function (or Ctrl-C) fails the step: the coroutines still running are cancelled
            for s in started:
                if isinstance(s, Future):
                    s.cancel()

    def _summed(self, per_fn: list[list[object]]) -> dict[str, RewardResult]:
        totals = [0.0] * len(self._keys)
        scored = [False] * len(self._keys)
        for (_, weight), name, values in zip(self._fns, self._names, per_fn):
            if len(values) != len(self._keys):
                raise RewardError(f"reward function {name} returned {len(values)} values for {len(self._keys)} completions")
            for i, v in enumerate(values):
                if v is None:
                    continue
                totals[i] += weight * _check_value(self._keys[i], v, f"reward function {name}")
                scored[i] = True
        if not all(scored):
            key = self._keys[scored.index(False)]
            raise RewardError(f"no reward function scored completion {key}: each of {', '.join(self._names)} returned "
                              "None for it (None is for completions a function does not apply to; one of them "
                              "must score each completion)")
        return {k: RewardResult(t, t > 0) for k, t in zip(self._keys, totals)}

    def cancel(self) -> None:
        """Nothing runs before results(): a dropped batch is just never asked for them."""


class FunctionRewards:
    """Weighted sum of in-process TRL-style reward functions.

    An `async def` function's coroutines run on `reward_loop()`, so a blocking call inside one (`time.sleep`,
    `requests.get`) stalls the step's scoring. From the first step that awaits one, the reward server's `LoopWatchdog`
    (services/reward/function.py) watches that loop: when it has not run for `async_block_warn_s` ([trainer]
    reward_async_block_warn_s; 0: off) it logs `reward_loop_blocked` with the function ("module:function") and the
    line it is stuck on, then `reward_loop_unblocked` with how long, and counts it in `loop_blocked`."""

    def __init__(self, fns: Sequence[RewardFn], weights: Sequence[float] | None = None,
                 trainer_state: TrainerState | None = None, async_block_warn_s: float = 1.0) -> None:
        self.trainer_state = trainer_state or TrainerState()  # TRL's `trainer_state` keyword; the loop sets its step
        if not fns:
            raise ValueError("FunctionRewards needs at least one function")
        weights = list(weights) if weights is not None else [1.0] * len(fns)
        if len(weights) != len(fns):
            raise ValueError(f"{len(fns)} reward functions but {len(weights)} weights")
        self._fns = list(zip(fns, weights))
        self.async_block_warn_s = async_block_warn_s
        self.watchdog = None  # a LoopWatchdog once a step awaited a function, until close()
        self.loop_blocked = 0  # times an async def function held the loop past async_block_warn_s
        self._watch_lock = threading.Lock()

    def begin(self) -> _FunctionBatch:
        return _FunctionBatch(self._fns, trainer_state=self.trainer_state, on_async=self._watch)

    def _watch(self) -> None:
        """Watch `reward_loop()` (from the first coroutine on; once) unless async_block_warn_s is 0."""
        if self.async_block_warn_s <= 0 or self.watchdog is not None:  # every coroutine calls this: once is enough
            return
        from tlt.services.reward.function import LoopWatchdog, is_async_function

        with self._watch_lock:
            if self.watchdog is None:
                fns = [fn for fn, _ in self._fns if is_async_function(fn)] or [fn for fn, _ in self._fns]
                name = ", ".join(f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
                                 for fn in fns)
                self.watchdog = LoopWatchdog(reward_loop(), self.async_block_warn_s, name, self._blocked).start()

    def _blocked(self) -> None:
        self.loop_blocked += 1

    def close(self) -> None:
        with self._watch_lock:
            if self.watchdog is not None:
                self.watchdog.stop()
                self.watchdog = None


def task_rewards(trainer_state: TrainerState | None = None) -> FunctionRewards:
    """The built-in verifier of the synthetic task (1.0 for the exact answer, else 0.0), on text completions or
    chat-message ones (`[{"role": "assistant", "content": text}]`: the data's prompts were chat messages)."""
    from tlt.task import reward

    def task_reward(prompts: list[Any], completions: list[Any], answers: list[str]) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return reward(prompts, texts, answers)

    return FunctionRewards([task_reward], trainer_state=trainer_state)


def task_reference_problem(items: Sequence[PromptItem], source: str) -> str | None:
    """Why `reward = "task"` cannot score a data set with these items' reference answers, or None: it reads integers
    only (tlt/task/verify.py), so another reference failed a step whenever a completion wrote `answer: <integer>`.
    The message opens with the first bad reference's place in `source` (file:line) and value, and names the next."""
    from tlt.task.verify import NOT_AN_INTEGER, integer_reference

    bad = [it for it in items if integer_reference(it.answer) is None]
    if not bad:
        return None
    more = "".join(f"; {it.where or source} ({it.answer!r})" for it in bad[1:4]) + ("; ..." if len(bad) > 4 else "")
    return (f"{bad[0].where or source}: reference answer {bad[0].answer!r} is not an integer ({len(bad)} of "
            f"{len(items)} reference answers are not integers{more}); {NOT_AN_INTEGER}")


# -- gRPC reward service --------------------------------------------------------------------


class _GrpcBatch:
    def __init__(self, client) -> None:  # noqa: ANN001 - RewardClient, imported lazily
        self._client = client
        self._futures: dict[str, Future] = {}

    def submit(self, key: str, prompt: str, completion: str, answer: str,
               extra: Mapping[str, Any] | None = None, messages: Messages | None = None,
               completion_ids: Sequence[int] | None = None) -> None:
        """One ScoreRequest: text only (`prompt` is a chat row's rendered template); messages and ids are not sent."""
        from tlt.v1 import reward_pb2

        if key in self._futures:
            raise ValueError(f"completion {key} submitted twice")
        # metadata is map<string, string>: a text column as is, any other JSON value as its JSON text, its key then
        # listed in json_metadata_keys (so a server tells the text "42" from the number 42)
        extra = extra or {}
        metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in extra.items()}
        json_keys = sorted(k for k, v in extra.items() if not isinstance(v, str))
        try:
            req = reward_pb2.ScoreRequest(id=key, prompt=prompt, completion=completion, reference=answer,
                                          metadata=metadata, json_metadata_keys=json_keys)
        except UnicodeEncodeError as e:  # text that is no valid Unicode (a lone surrogate) cannot go as UTF-8
            raise RewardError(f"completion {key} cannot be sent to the reward server: its prompt, answer or a column "
                              f"holds text that is not valid Unicode ({e}); fix the data row") from e
        self._futures[key] = self._client.submit(req)

    def results(self) -> dict[str, RewardResult]:
        from tlt.services.reward.client import RewardCallError, RewardUnavailableError

        out: dict[str, RewardResult] = {}
        try:
            for key, fut in self._futures.items():
                try:
                    resp = fut.result()
                except (RewardUnavailableError, RewardCallError) as e:
                    raise RewardError(f"no reward for completion {key}: {e}") from e
                if not resp.ok:
                    raise RewardError(f"reward server could not score completion {key}: {resp.error or 'no reason given'}")
                if resp.id != key:
                    raise RewardError(f"reward server answered id {resp.id!r} for completion {key}")
                out[key] = RewardResult(_check_value(key, resp.reward, "reward server"), bool(resp.correct))
        except RewardError:
            self.cancel()
            raise
        return out

    def cancel(self) -> None:
        """Drop every item not answered yet (RewardClient.submit's futures): queued ones are never sent (they wait in
        the client's queue, ahead of any later batch's), sent ones have their call cancelled, so the server skips
        those it has not begun (one it is scoring runs to its end, unread); none is retried. Another batch's items,
        a redo's, are untouched."""
        for fut in self._futures.values():
            fut.cancel()


class GrpcRewards:
    """A `tlt.v1.Reward` server: one call per completion, submitted as it arrives."""

    def __init__(self, address: str, concurrency: int = 32, timeout_s: float = 30.0, retries: int = 2,
                 retry_window_s: float = 30.0) -> None:
        from tlt.services.reward.client import RewardClient

        self.address = address
        self._client = RewardClient(address, concurrency=concurrency, timeout_s=timeout_s, retries=retries,
                                    retry_window_s=retry_window_s)

    def begin(self) -> _GrpcBatch:
        return _GrpcBatch(self._client)

    def wait_ready(self, timeout_s: float) -> None:
        """RewardError when the server cannot be reached within `timeout_s` (checked before the first rollout)."""
        from tlt.services.reward.client import RewardUnavailableError

        try:
            self._client.wait_ready(timeout_s)
        except RewardUnavailableError as e:
            raise RewardError(str(e)) from None

    def close(self) -> None:
        self._client.close()


def make_reward_source(cfg) -> RewardSource:  # noqa: ANN001 - TrainerConfig
    """The reward source a TrainerConfig asks for."""
    if cfg.reward == "grpc":
        return GrpcRewards(cfg.reward_address, cfg.reward_concurrency, cfg.reward_timeout_s, cfg.reward_retries,
                           cfg.reward_retry_window_s)
    state = TrainerState(max_steps=cfg.steps)
    if cfg.reward == "python":
        return FunctionRewards([load_function(cfg.reward_function)], trainer_state=state,
                               async_block_warn_s=cfg.reward_async_block_warn_s)
    return task_rewards(state)
