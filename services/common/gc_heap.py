"""The garbage collector in long-lived service processes: freeze the startup heap, measure the pauses.

A serving process holds 360,000-410,000 GC-tracked objects once torch, transformers, gRPC and FastAPI are
imported and the model and the KV block pool are built (`tlt rollout serve`'s front and replicas, measured in
BENCHMARKS.md "Rollout server under load"). None of them ever becomes garbage, yet every full (generation 2)
collection walks them all: 0.16-0.30 s on the 2-core CI machine, during which no other Python thread runs. In
the rollout front that stalls every open stream; the 64-client load test saw 16 such pauses in 35 s.

`freeze_heap()` moves everything alive once a process is up into the permanent generation (`gc.freeze`), so later
collections walk only what came after. It returns, and keeps for `GcPauses.snapshot`, how many objects that froze:
`gc.get_freeze_count()` walks the whole permanent generation, 20-37 ms for a serving process's heap. A replica
answered every status query with a fresh count, and `tlt run` asks up to 10 times a second, so the replica's step
loop stood still for about a fifth of each rollout (session 32, cProfile of a CPU replica: 5.6 s in
`gc.get_freeze_count` against 2.2 s in engine steps over a 3-step run).

Frozen objects are still freed by reference counting; only a reference cycle among them would never be
collected, so freeze once, in a process's entry point after its startup, never in a library call a test makes
in-process. `GcPauses` counts each generation's collections and their seconds
(`gc.callbacks`), for /metrics (`GcMetrics`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

GENERATIONS = (0, 1, 2)


_frozen = 0  # what the last freeze_heap() / unfreeze_heap() left in the permanent generation


def freeze_heap() -> int:
    """Collect what startup left as garbage, then freeze every object alive -> how many are frozen now."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()  # counted once, here: the count walks every frozen object
    return _frozen


def unfreeze_heap() -> None:
    """Undo `freeze_heap` (a bench that froze for its timed runs only)."""
    global _frozen
    gc.unfreeze()
    _frozen = 0


def frozen_objects() -> int:
    """How many objects `freeze_heap` froze (0 if it did not run, or after `unfreeze_heap`), without walking them."""
    return _frozen


class GcPauses:
    """Per generation: collections, seconds spent in them, the longest one. `install()` hooks `gc.callbacks`
    (the callback runs in whichever thread collects, with the GIL held, so start and stop always pair).
    `clock`: what the seconds are (wall time by default; `tlt bench rollout --clock cpu` passes process time)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.reset()
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = self.clock()
            return
        g = int(info["generation"])
        dt = self.clock() - self._t0
        self.collections[g] += 1
        self.seconds[g] += dt
        self.max_seconds[g] = max(self.max_seconds[g], dt)

    def reset(self) -> None:
        """Start counting again (after a process's startup, whose collections are not what serving costs)."""
        self.collections, self.seconds, self.max_seconds = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def snapshot(self) -> dict[str, Any]:
        """{"frozen_objects", "collections": [3], "seconds": [3], "max_seconds": [3]}: plain values (pickled over
        the replica pipe)."""
        return {"frozen_objects": frozen_objects(), "collections": list(self.collections),
                "seconds": list(self.seconds), "max_seconds": list(self.max_seconds)}


class GcMetrics:
    """The GC view on a service's /metrics, per process (`front`, `replica-0`, ...): frozen objects, and per
    generation the collections, their total seconds and the longest pause since the process began serving (after
    its startup and freeze), from `GcPauses.snapshot()`s read at scrape time. The totals are gauges: a restarted
    replica's start again from zero."""

    def __init__(self, metrics: Any) -> None:
        p, pg = ("process",), ("process", "generation")
        self.frozen = metrics.gauge("gc_frozen_objects", "objects frozen after startup (gc.freeze; full "
                                    "collections skip them), counted at the freeze", p)
        self.collections = metrics.gauge("gc_collections", "garbage collections since the process began serving", pg)
        self.seconds = metrics.gauge("gc_pause_seconds", "seconds the process spent in garbage collections since it "
                                     "began serving (its other threads wait too, but for a finaliser that drops "
                                     "the GIL)", pg)
        self.max_seconds = metrics.gauge("gc_max_pause_seconds", "the longest garbage collection pause", pg)

    def update(self, process: str, snap: dict[str, Any]) -> None:
        if not snap:
            return
        self.frozen.labels(process).set(snap.get("frozen_objects", 0))
        for g in GENERATIONS:
            self.collections.labels(process, str(g)).set(snap["collections"][g])
            self.seconds.labels(process, str(g)).set(snap["seconds"][g])
            self.max_seconds.labels(process, str(g)).set(snap["max_seconds"][g])
