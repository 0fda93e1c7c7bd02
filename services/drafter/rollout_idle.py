"""Is the whole rollout idle? The coordinator's own work waits for it, as the workers' training does.

    capacity events (SUB + snapshot, every replica) --> latest state per replica
    idle()  True when every live replica heard of is IDLE, at least one (and the feed is fresh)
    busy()  the opposite, for aborting work that started while idle

The coordinator's candidate evaluation (offline acceptance of candidate and serving drafter on the
held-out data) is a few CPU-seconds per round on a small model: run while replicas decode, it took
their cores (`tlt bench drafter-drift --overhead`, BENCHMARKS.md "Session 5": +57% rollout time on
the tiny model). Workers only train on their own idle replica; the coordinator is not tied to one
replica, so its heavy work waits until every replica is idle (between rollouts: the trainer's phase).

A replica LENT to a colocated trainer (Rollout.LendDevices) counts as idle here when its device is a GPU:
the evaluation runs on the coordinator's CPU and does not touch it, and in a colocated deployment the
trainer's phase is the only time the rollout is not decoding (a one-GPU box would otherwise never publish).
A LENT CPU replica is not idle: the trainer computes on those cores. Workers never train on LENT.

A DRAINING replica is left out: the pool publishes DRAINING when a replica dies (its counts cleared: it computes
nothing; its requests went to the others) and keeps repeating it while the replica restarts, or for good once
`max_restarts` is used up. Counted, one dead replica shut the gate for good while the live ones sat idle. A
DRAINING replica that still reports sequences (its server is stopping while they finish) counts as busy, and a
rollout with no IDLE replica left is not idle.

Without capacity endpoints (a coordinator with no rollout to watch) `idle()` is always True. When the
feed goes quiet for `stale_s` (heartbeats arrive about once a second), the last states are not
trusted: `idle()` is False until events arrive again, so a dead publisher never lets work through.
The same holds per replica: a state not repeated for `stale_s` (its publisher is gone, e.g. a rollout
restarted on the same endpoints under a new server_id) no longer counts, so a dead server's last BUSY
or DRAINING cannot keep the gate shut for good.

The events also carry the drafter version each replica serves and the drafter its rollout started with:
`drafter_behind` tells the coordinator a rollout restarted with its start drafter (version 0) while the coordinator
serves a newer one, and `start_drafters` which drafters those replicas started with (the coordinator pushes its
serving drafter again only to a rollout started on the drafter it grew from).
"""

from __future__ import annotations

import threading
import time

from tlt.services.common.events import STALE_S, CapacitySubscriber
from tlt.services.common.logging import get_logger
from tlt.v1 import common_pb2

log = get_logger("drafter.rollout_idle")

IDLE = common_pb2.REPLICA_STATE_IDLE
LENT = common_pb2.REPLICA_STATE_LENT
BUSY = common_pb2.REPLICA_STATE_BUSY
DRAINING = common_pb2.REPLICA_STATE_DRAINING
# While the rollout is busy, whoever waits for it to turn idle (this watcher, a drafter worker) reads the queued
# capacity events this often instead of waking for each (the replicas publish tens a second while they decode, and
# each wake-up is taken from a core the rollout uses); it learns of the idle rollout at most this much later. While
# the rollout is idle, this watcher reads every event as it comes: a BUSY must stop the coordinator's evaluation.
BUSY_POLL_S = 0.05


def all_idle(states: dict[tuple[str, int], int]) -> bool:
    """True when every live replica's last state is IDLE, and at least one is: DRAINING ones (dead, restarting, or
    stopped) are left out (see the module docstring)."""
    live = [s for s in states.values() if s != DRAINING]
    return bool(live) and all(s == IDLE for s in live)


def fresh_all_idle(states: dict[tuple[str, int], tuple[int, float]], now: float, stale_s: float) -> bool:
    """`all_idle` over the states heard within `stale_s` of `now` ((state, monotonic time last heard) per
    (server_id, replica)): a restarted rollout publishes under a new server_id, and its predecessor's last
    BUSY or DRAINING, never repeated, must stop counting. Shared by RolloutIdle and the workers."""
    return all_idle({k: st for k, (st, t) in states.items() if now - t < stale_s})


class RolloutIdle:
    def __init__(self, capacity_pub: str, capacity_snapshot: str, stale_s: float = STALE_S, token: str = "") -> None:
        """`token`: the control token the capacity sockets are secured with (zmq_auth.py; empty: TLT_AUTH_TOKEN)."""
        self.enabled = bool(capacity_pub and capacity_snapshot)
        self._token = token
        self.stale_s = stale_s
        self._states: dict[tuple[str, int], tuple[int, float]] = {}  # -> (state, monotonic time last heard)
        self._drafters: dict[tuple[str, int], int] = {}  # -> the drafter version its last event carried
        self._starts: dict[tuple[str, int], str] = {}  # -> the drafter its rollout started with ("": not said)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._pub, self._snap = capacity_pub, capacity_snapshot
            self._thread = threading.Thread(target=self._watch, name="drafter-rollout-idle", daemon=True)
            self._thread.start()

    def idle(self) -> bool:
        """Every live replica heard of is IDLE, at least one (always True without capacity endpoints)."""
        if not self.enabled:
            return True
        with self._lock:
            return fresh_all_idle(self._states, time.monotonic(), self.stale_s)

    def busy(self) -> bool:
        return not self.idle()

    def drafter_behind(self, version: int) -> int | None:
        """The oldest drafter version a live replica heard within `stale_s` serves, when it is older than `version`
        (and a version: -1 is a rollout drafting with n-grams, which takes no drafter); else None."""
        with self._lock:
            now = time.monotonic()
            seen = [self._drafters.get(k, -1) for k, (st, t) in self._states.items()
                    if now - t < self.stale_s and st != DRAINING]
        oldest = min((v for v in seen if v >= 0), default=version)
        return oldest if oldest < version else None

    def start_drafters(self, version: int) -> set[str]:
        """The start drafters ("sha256:...", "" when a rollout did not say) of the live replicas serving a drafter
        older than `version` (those `drafter_behind` counts)."""
        with self._lock:
            now = time.monotonic()
            return {self._starts.get(k, "") for k, (st, t) in self._states.items()
                    if now - t < self.stale_s and st != DRAINING and 0 <= self._drafters.get(k, -1) < version}

    def see(self, server_id: str, replica_id: int, state: int, device: str = "", sequences: int = 0,
            drafter: int = -1, start_drafter: str = "") -> None:
        """Record one replica's state (the watcher thread calls this for every event), the drafter version it
        serves and the drafter its rollout started with. LENT on a GPU counts as IDLE, DRAINING with `sequences` (running + queued) still on it as BUSY (see
        the module docstring); an unknown device is taken for a CPU."""
        if state == LENT and device and not device.startswith("cpu"):
            state = IDLE
        elif state == DRAINING and sequences > 0:
            state = BUSY
        with self._lock:
            self._states[(server_id, replica_id)] = (state, time.monotonic())
            self._drafters[(server_id, replica_id)] = drafter
            self._starts[(server_id, replica_id)] = start_drafter

    def _watch(self) -> None:
        sub = CapacitySubscriber(self._pub, self._snap, token=self._token)
        try:
            while not self._stop.is_set():
                try:
                    for e in sub.snapshot(timeout_s=2.0):
                        self._see(e)
                    break
                except (TimeoutError, ValueError) as e:  # the rollout is not up yet: ask again
                    log.debug("capacity_snapshot_retry", error=str(e))
            while not self._stop.is_set():
                if self.busy():  # nothing waits on the next event: read what queued every BUSY_POLL_S
                    if self._stop.wait(BUSY_POLL_S):
                        break
                    for e in sub.events(0):
                        self._see(e)
                    continue
                e = sub.recv(0.2)  # idle: a BUSY must stop an evaluation at once
                if e is not None:
                    self._see(e)
        finally:
            sub.close()

    def _see(self, e: object) -> None:
        self.see(e.server_id, e.replica_id, e.state, e.device, e.running + e.queued,  # type: ignore[attr-defined]
                 e.versions.drafter if e.HasField("versions") else -1, e.start_drafter)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
