"""In-process implementations of the event transports, for tests and single-process runs.

They follow the same contracts as the ZeroMQ ones in `events.py`:
`LocalCapacityBus.publish` numbers events per replica and keeps the current
state, `subscribe()` returns a feed whose `snapshot()` gives that state and
whose `recv()` gets later events; `LocalFeatureQueue` is a bounded queue whose
`push` never blocks and counts drops. No sockets, no threads of their own.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid

from tlt.v1 import events_pb2

CapacityEvent = events_pb2.CapacityEvent
FeatureBatch = events_pb2.FeatureBatch


def _copy(event: CapacityEvent) -> CapacityEvent:
    out = CapacityEvent()
    out.CopyFrom(event)
    return out


class LocalCapacityFeed:
    """One subscriber of a `LocalCapacityBus` (implements `CapacityFeed`)."""

    def __init__(self, bus: LocalCapacityBus) -> None:
        self._bus = bus
        self._queue: queue.Queue[CapacityEvent] = queue.Queue()

    def snapshot(self, timeout_s: float = 2.0) -> list[CapacityEvent]:
        return self._bus.current()

    def recv(self, timeout_s: float) -> CapacityEvent | None:
        try:
            return self._queue.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def _deliver(self, event: CapacityEvent) -> None:
        self._queue.put(_copy(event))


class LocalCapacityBus:
    """Publisher side (implements `CapacitySink`); `heartbeat()` re-sends every state on demand."""

    def __init__(self, server_id: str = "local") -> None:
        self.server_id = server_id
        self._lock = threading.Lock()
        self._state: dict[int, CapacityEvent] = {}
        self._feeds: list[LocalCapacityFeed] = []

    def subscribe(self) -> LocalCapacityFeed:
        feed = LocalCapacityFeed(self)
        with self._lock:
            self._feeds.append(feed)
        return feed

    def publish(self, event: CapacityEvent) -> CapacityEvent:
        with self._lock:
            sent = _copy(event)
            prev = self._state.get(sent.replica_id)
            sent.seq = (prev.seq if prev else 0) + 1
            sent.heartbeat = False
            sent.server_id = sent.server_id or self.server_id
            sent.timestamp = sent.timestamp or time.time()
            self._state[sent.replica_id] = sent
            for feed in self._feeds:
                feed._deliver(sent)
            return _copy(sent)

    def heartbeat(self) -> None:
        with self._lock:
            for event in self._state.values():
                beat = _copy(event)
                beat.heartbeat = True
                for feed in self._feeds:
                    feed._deliver(beat)

    def current(self) -> list[CapacityEvent]:
        with self._lock:
            return [_copy(e) for _, e in sorted(self._state.items())]


class LocalFeatureQueue:
    """Bounded feature queue: `push` (a `FeatureSink`) drops when full, `recv` (a `FeatureSource`) waits."""

    def __init__(self, maxsize: int = 4) -> None:
        self.dropped = 0
        self.dropped_batches = 0
        self.sender = uuid.uuid4().hex
        self._reported = 0  # `dropped` when the last batch went in
        self._lock = threading.Lock()
        self._queue: queue.Queue[FeatureBatch] = queue.Queue(maxsize=maxsize)

    def push(self, batch: FeatureBatch) -> bool:
        with self._lock:
            batch.dropped_before, batch.sender = self.dropped, self.sender
            batch.dropped_since = self.dropped - self._reported
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.dropped += len(batch.sequences)
                self.dropped_batches += 1
                return False
            self._reported = batch.dropped_before
            return True

    def recv(self, timeout_s: float) -> FeatureBatch | None:
        try:
            return self._queue.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def recv_frame(self, timeout_s: float) -> list[bytes] | None:
        """The next batch as the features socket would carry it (`parse` reads it back)."""
        batch = self.recv(timeout_s)
        return None if batch is None else [batch.SerializeToString()]

    def parse(self, frames: list[bytes]) -> FeatureBatch | None:
        return FeatureBatch.FromString(frames[0])
