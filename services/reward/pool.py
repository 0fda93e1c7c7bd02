"""`ScoringPool`: the reward server's scoring threads, with a per-item timeout that frees a stuck worker.

    submit(fn, item) -> Future      # a worker runs fn(item); its result, or after `timeout_s` running:
                                    # on_timeout(item, s, waiting=False); waiting on a wedged pool: waiting=True
    map(fn, items) -> results in order
    stuck() -> threads abandoned to an item that never returned, still running
    wedged() -> True once more than `workers` threads are stuck: the health check answers UNAVAILABLE

A Python thread cannot be stopped, so an item past `timeout_s` (a reward function in an endless loop, a verifier
on a pathological input) is answered without it: its future gets `on_timeout(item)` (ok=false, "timed out"), the
thread is left to finish on its own (its result is dropped) and a new worker takes its place, so the pool keeps
`workers` threads scoring. Such threads are counted; up to `workers` of them are replaced (at most 2 x `workers`
threads: a function that hangs on every item must not grow threads without bound; `workers = 1` survives its first
stuck item). A stuck thread past that is not replaced, the pool scores with fewer threads (none at 2 x `workers`
stuck) and `wedged()` says so: the server's health check then fails and a liveness probe restarts it. While
wedged, an item that has waited `timeout_s` for a worker since it was submitted is answered
`on_timeout(item, s, waiting=True)` (ok=false) rather than left for the restart. Before this a stuck item held its
worker for ever, and the health check (an empty batch, which reaches no worker) stayed healthy while nothing was
scored. A thread that comes back scores again, in place of one not replaced, else it exits.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

_STOP = object()


class _Job:
    def __init__(self, fn: Callable[[Any], Any], item: Any) -> None:
        self.fn = fn
        self.item = item
        self.future: Future = Future()
        self.queued = time.monotonic()
        self.started = 0.0  # monotonic time a worker took it


class ScoringPool:
    def __init__(self, workers: int, timeout_s: float, on_timeout: Callable[[Any, float, bool], Any],
                 name: str = "reward-score") -> None:
        self.workers = workers
        self.timeout_s = timeout_s  # 0: no timeout
        self._on_timeout = on_timeout  # (item, seconds, waiting: never began) -> the item's answer
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, _Job] = {}  # worker -> the job it runs now
        self._waiting: dict[_Job, None] = {}  # submitted, not yet taken by a worker (nor answered on timeout)
        self._threads: list[threading.Thread] = []  # every worker started, stuck ones included
        self._abandoned: set[threading.Thread] = set()
        self._unreplaced = 0  # abandoned workers not replaced (the bound): one that comes back works on in their place
        self._started = 0
        self._closed = threading.Event()
        for _ in range(workers):
            self._start_worker()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    def _start_worker(self) -> None:
        t = threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True)
        self._started += 1
        self._threads = [*(x for x in self._threads if x.is_alive()), t]
        t.start()

    def submit(self, fn: Callable[[Any], Any], item: Any) -> Future:
        if self._closed.is_set():
            raise RuntimeError("the scoring pool is shut down")
        job = _Job(fn, item)
        with self._lock:
            self._waiting[job] = None
        self._jobs.put(job)
        return job.future

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        futures = [self.submit(fn, item) for item in items]
        return (f.result() for f in futures)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._jobs.get()
            if job is _STOP or me in self._abandoned:
                return
            with self._lock:
                taken = job in self._waiting  # else answered already: it waited too long on a wedged pool
                self._waiting.pop(job, None)
                if not taken or not job.future.set_running_or_notify_cancel():
                    continue
                job.started = time.monotonic()
                self._running[me] = job
            try:
                result: Any = job.fn(job.item)
                error: BaseException | None = None
            except BaseException as e:  # noqa: BLE001 - handed to the future's reader, as concurrent.futures does
                result, error = None, e
            with self._lock:
                self._running.pop(me, None)
                if me in self._abandoned:  # answered already, on timeout
                    self._abandoned.discard(me)
                    if self._unreplaced == 0:  # a replacement took this place
                        return
                    self._unreplaced -= 1  # none did: back to work
                    continue
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def _watch(self) -> None:
        tick = min(1.0, self.timeout_s / 4)
        while not self._closed.wait(tick):
            now = time.monotonic()
            late: list[_Job] = []
            waited: list[_Job] = []
            with self._lock:
                for thread, job in list(self._running.items()):
                    if now - job.started < self.timeout_s:
                        continue
                    del self._running[thread]
                    self._abandoned.add(thread)
                    late.append(job)
                    if len(self._abandoned) <= self.workers:  # bounded: past that the pool is wedged, see wedged()
                        self._start_worker()
                    else:
                        self._unreplaced += 1
                if len(self._abandoned) > self.workers:  # wedged: the queue may never drain before a restart
                    waited = [job for job in self._waiting if now - job.queued >= self.timeout_s]
                    for job in waited:
                        del self._waiting[job]
            for job in late:
                job.future.set_result(self._on_timeout(job.item, self.timeout_s, False))
            for job in waited:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_result(self._on_timeout(job.item, self.timeout_s, True))

    def stuck(self) -> int:
        """Workers abandoned to an item past the timeout that are still running it."""
        with self._lock:
            return len(self._abandoned)

    def wedged(self) -> bool:
        """More workers stuck than the pool replaces: it scores on fewer than `workers` threads (none at 2 x)."""
        return self.stuck() > self.workers

    def threads(self) -> list[threading.Thread]:
        return list(self._threads)

    def shutdown(self) -> None:
        """Stop taking items; cancel the ones not started; idle workers exit, a running item finishes on its own."""
        self._closed.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job.future.cancel()
                with self._lock:
                    self._waiting.pop(job, None)
        for _ in self._threads:
            self._jobs.put(_STOP)
