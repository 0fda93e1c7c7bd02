"""ZeroMQ transports for capacity events and drafter features; every frame is a `tlt.v1.Envelope`.

    rollout --CapacityPublisher (PUB "cap" + REP snapshot)--> CapacitySubscriber --> drafter workers
    rollout --FeaturePusher (PUSH, never blocks, counts drops)--> FeaturePuller (PULL) --> drafter buffer

Capacity: `publish(event)` sends a replica's state change at once; a
background thread re-publishes every replica's current state about once a
second with `heartbeat=true`, and answers `SnapshotRequest`s on the REP socket
with the state of every replica, so a late subscriber knows everything at
once. (A change published while a new subscription is still reaching the
publisher can be missed; the next heartbeat repairs it, so a subscriber is
never more than one heartbeat period out of date.) Sequence numbers are per
replica and advance on state changes only (a heartbeat repeats the last one);
they start at the publisher's start time in microseconds, so a restarted
publisher continues above its old numbers.

Features: the pusher uses a small send high-water mark and non-blocking sends;
when the drafter is slow or absent the batch is dropped and counted (the next
batch carries the running count in `dropped_before`, how many of them were
dropped since the previous frame that went out in `dropped_since`, and the
pusher's `sender` id, so the drafter sums the counts of every process and rank).
Frames already queued when the drafter's coordinator goes away (a restart) are
lost with the drops they carried, counted nowhere. The rollout
never waits. A batch is sent as frames of at most `MAX_FRAME_BYTES`: a whole RL
batch that finishes in one step can pass protobuf's 2 GiB message limit; a
single sequence over the limit is dropped and counted.

Security (zmq_auth.py): with a control token every socket here is CURVE with keys derived from it, and each
binding side (publisher, puller) admits only the token's clients (ZAP); a peer without the token is never
connected. With none they are plain ZeroMQ on a loopback bind, and a bind on another address is refused. Each
class takes the config's token (`token`; empty: TLT_AUTH_TOKEN, then TLT_AUTH_TOKEN_FILE).

Garbage (undecodable frames, or an Envelope with the wrong body) is counted
on every socket and skipped; nothing crashes on it. The small interfaces the
services depend on are `CapacitySink`, `CapacityFeed`, `FeatureSink` and
`FeatureSource`; `events_local` has in-process implementations for tests.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Protocol

import zmq
from google.protobuf.message import DecodeError, EncodeError

from tlt.services.common.logging import get_logger
from tlt.services.common.auth import resolve_token
from tlt.services.common.zmq_auth import ZmqAuth
from tlt.v1 import events_pb2

CapacityEvent = events_pb2.CapacityEvent
FeatureBatch = events_pb2.FeatureBatch
Envelope = events_pb2.Envelope
TOPIC = b"cap"

log = get_logger("events")


class CapacitySink(Protocol):
    def publish(self, event: CapacityEvent) -> CapacityEvent: ...


class CapacityFeed(Protocol):
    def snapshot(self, timeout_s: float = 2.0) -> list[CapacityEvent]: ...
    def recv(self, timeout_s: float) -> CapacityEvent | None: ...


class FeatureSink(Protocol):
    dropped: int

    def push(self, batch: FeatureBatch) -> bool: ...


class FeatureSource(Protocol):
    def recv(self, timeout_s: float) -> FeatureBatch | None: ...

    def recv_frame(self, timeout_s: float) -> list[bytes] | None: ...  # `recv` in two steps: take it, then parse

    def parse(self, frames: list[bytes]) -> FeatureBatch | None: ...


# a recv reads at most this many queued frames once its time is up (skipped ones, garbage or stale, are drained,
# but not forever: a flood of them cannot hold a caller that asked not to wait)
MAX_LATE_FRAMES = 64


def decode(frame: bytes, body: str) -> events_pb2.Envelope | None:
    """The Envelope in `frame` when it parses and holds `body`; None for garbage."""
    env = Envelope()
    try:
        env.ParseFromString(frame)
    except DecodeError:
        return None
    return env if env.WhichOneof("body") == body else None


def _endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _copy(event: CapacityEvent) -> CapacityEvent:
    out = CapacityEvent()
    out.CopyFrom(event)
    return out


class CapacityPublisher:
    """PUB of capacity events with heartbeats, plus a REP snapshot socket. Thread-safe."""

    def __init__(
        self, bind_pub: str, bind_snapshot: str, server_id: str = "", heartbeat_s: float = 1.0, token: str = ""
    ) -> None:
        self.server_id = server_id
        self.heartbeat_s = heartbeat_s
        self.garbage = 0
        self.published = 0
        token = resolve_token(token)  # before the context: a token file that cannot be read leaves nothing behind
        self._ctx = zmq.Context()
        self._auth = ZmqAuth(self._ctx, token)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._rep = self._ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._auth.bind_or_release((self._pub, bind_pub), (self._rep, bind_snapshot))
        self.pub_endpoint = _endpoint(self._pub)
        self.snapshot_endpoint = _endpoint(self._rep)
        self._lock = threading.Lock()
        self._state: dict[int, CapacityEvent] = {}
        self._seq_start = time.time_ns() // 1000
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="capacity-publisher", daemon=True)
        self._thread.start()

    def publish(self, event: CapacityEvent) -> CapacityEvent:
        """Send a state change for `event.replica_id` now; returns the event as sent (seq, time set)."""
        with self._lock:
            sent = _copy(event)
            prev = self._state.get(sent.replica_id)
            sent.seq = (prev.seq if prev else self._seq_start) + 1
            sent.heartbeat = False
            sent.server_id = sent.server_id or self.server_id
            sent.timestamp = sent.timestamp or time.time()
            self._state[sent.replica_id] = sent
            self._send(sent)
            return _copy(sent)

    def current(self) -> list[CapacityEvent]:
        with self._lock:
            return [_copy(e) for _, e in sorted(self._state.items())]

    def _send(self, event: CapacityEvent) -> None:  # caller holds the lock
        self._pub.send_multipart([TOPIC, Envelope(capacity=event).SerializeToString()])
        self.published += 1

    def _heartbeat(self) -> None:
        with self._lock:
            for event in self._state.values():
                beat = _copy(event)
                beat.heartbeat = True
                beat.timestamp = time.time()
                self._send(beat)

    def _answer_snapshot(self) -> None:
        frames = self._rep.recv_multipart()
        if len(frames) != 1 or decode(frames[0], "snapshot_request") is None:
            self.garbage += 1
            log.debug("garbage_snapshot_request", frames=len(frames), total=self.garbage)
            self._rep.send(Envelope().SerializeToString())  # REP must answer; an empty body says "bad request"
            return
        self._rep.send(Envelope(snapshot=events_pb2.Snapshot(replicas=self.current())).SerializeToString())

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._rep, zmq.POLLIN)
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._stop.is_set():
            wait_ms = max(0.0, next_beat - time.monotonic()) * 1000
            if poller.poll(timeout=min(wait_ms, 100)):
                self._answer_snapshot()
            if time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + self.heartbeat_s

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._pub.close()
            self._rep.close()
        self._auth.close()
        self._ctx.term()

    def __enter__(self) -> CapacityPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CapacitySubscriber:
    """SUB to one publisher; `snapshot()` for the current state, then `recv()` / `events()`.

    Keeps `latest[(server_id, replica_id)]`; a non-heartbeat event older than
    what it already knows (e.g. one queued before the snapshot) is skipped.
    Not thread-safe: one thread owns a subscriber.
    """

    def __init__(self, connect_pub: str, connect_snapshot: str, token: str = "") -> None:
        self.snapshot_endpoint = connect_snapshot
        self.garbage = 0
        self.latest: dict[tuple[str, int], CapacityEvent] = {}
        token = resolve_token(token)  # before the context: a token file that cannot be read leaves nothing behind
        self._ctx = zmq.Context()
        self._auth = ZmqAuth(self._ctx, token)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._auth.connect(self._sub, connect_pub)  # before the snapshot, so nothing falls between the two

    def snapshot(self, timeout_s: float = 2.0) -> list[CapacityEvent]:
        """Ask the publisher for every replica's current state; TimeoutError when it does not answer (saying so when
        the publisher refused the handshake: it may require the control token, zmq_auth.HandshakeWatch)."""
        req = self._ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        watch = None
        try:
            watch = self._auth.connect(req, self.snapshot_endpoint, watch=True)
            req.send(Envelope(snapshot_request=events_pb2.SnapshotRequest()).SerializeToString())
            if not req.poll(timeout=int(timeout_s * 1000)):
                hint = watch.hint() if watch is not None else ""
                raise TimeoutError(f"no snapshot from {self.snapshot_endpoint} within {timeout_s}s"
                                   + (f"; {hint}" if hint else ""))
            env = decode(req.recv(), "snapshot")
        finally:
            if watch is not None:
                watch.close()
            req.close()  # a REQ that got no answer is stuck; never reuse it
        if env is None:
            self.garbage += 1
            raise ValueError(f"{self.snapshot_endpoint} answered the snapshot request with garbage")
        for event in env.snapshot.replicas:
            self._remember(event)
        return list(env.snapshot.replicas)

    def _remember(self, event: CapacityEvent) -> bool:
        key = (event.server_id, event.replica_id)
        known = self.latest.get(key)
        if known is not None and event.seq < known.seq:
            return False
        self.latest[key] = event
        return True

    def recv(self, timeout_s: float) -> CapacityEvent | None:
        """The next event (state change or heartbeat), or None when `timeout_s` passes without one. timeout_s 0 (or
        less than a millisecond): what is queued now, without waiting (it returned None without looking; a worker,
        which asks between the parts of every micro-step, asked recv(0.001), which polls with timeout 0 only because
        the milliseconds left are truncated)."""
        deadline = time.monotonic() + timeout_s
        late = 0  # frames read past the deadline: skipped ones (garbage, stale) are drained, but not forever
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                late += 1
                if late > MAX_LATE_FRAMES:
                    return None
            if not self._sub.poll(timeout=int(max(0.0, left) * 1000)):  # 0: look, never wait
                return None
            frames = self._sub.recv_multipart()
            env = decode(frames[1], "capacity") if len(frames) == 2 and frames[0] == TOPIC else None
            if env is None:
                self.garbage += 1
                log.debug("garbage_capacity_frame", frames=len(frames), total=self.garbage)
                continue
            if self._remember(env.capacity):
                return env.capacity

    def events(self, timeout_s: float) -> Iterator[CapacityEvent]:
        """Yield events until none arrives for `timeout_s`."""
        while (event := self.recv(timeout_s)) is not None:
            yield event

    def close(self) -> None:
        self._sub.close()
        self._ctx.term()

    def __enter__(self) -> CapacitySubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


STALE_S = 5.0  # a replica's state not repeated this long no longer counts: heartbeats must come well within it
MAX_FRAME_BYTES = 256 << 20  # one feature frame; protobuf refuses messages over 2 GiB
FRAME_OVERHEAD = 256  # bytes a frame needs besides its sequences


def split_batch(batch: FeatureBatch, max_bytes: int) -> tuple[list[FeatureBatch], int]:
    """`batch` as batches of at most `max_bytes` serialized each (`batch` itself when it fits), and how many of its
    sequences are too big to send alone."""
    if batch.ByteSize() + FRAME_OVERHEAD <= max_bytes:
        return [batch], 0
    parts: list[FeatureBatch] = []
    room = max_bytes - FRAME_OVERHEAD  # the frame's own fields (source, sender, the drop counts) and the Envelope
    too_big, size = 0, room + 1
    for seq in batch.sequences:
        n = seq.ByteSize() + 16  # the field's tag and length
        if n > room:
            too_big += 1
            continue
        if size + n > room:
            parts.append(FeatureBatch(source=batch.source))
            size = 0
        parts[-1].sequences.append(seq)
        size += n
    return parts, too_big


class FeaturePusher:
    """PUSH of FeatureBatch that never blocks: a full queue or no consumer drops the batch. Thread-safe."""

    def __init__(self, connect: str, hwm: int = 4, max_frame_bytes: int = MAX_FRAME_BYTES, token: str = "") -> None:
        self.dropped = 0  # sequences dropped so far
        self.dropped_batches = 0
        self.sent = 0
        self._reported = 0  # `dropped` when the last frame went out
        self.sender = uuid.uuid4().hex  # the drafter sums drops per sender: every pusher is its own
        self.max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        token = resolve_token(token)  # before the context: a token file that cannot be read leaves nothing behind
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to connected peers (a refused one never is)
        # a drafter that refuses the handshake (it has a token, this pusher none or another) is said once, in one
        # line, at the first batch dropped for it (zmq_auth.HandshakeWatch); otherwise drops are all one sees
        self._watch = ZmqAuth(self._ctx, token).connect(self._sock, connect, watch=True)

    def wait_connected(self, timeout_s: float) -> bool:
        """True once a batch could go now: a peer that completed its handshake (CURVE and ZAP under a token: a few
        ms, longer on a loaded host) with room in its queue; False after `timeout_s` (nobody bound, a refused
        token). Under IMMEDIATE a batch pushed before that is dropped and counted, by design; a caller that must
        not lose its first batch waits here first. The lock is taken one 20 ms look at a time: a `push` from
        another thread meanwhile is not held up."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self._lock:
                if self._sock.poll(int(min(0.02, max(0.0, deadline - time.monotonic())) * 1000), zmq.POLLOUT):
                    return True
            if time.monotonic() >= deadline:
                return False

    def push(self, batch: FeatureBatch) -> bool:
        """Send `batch` if it can go now, in frames of at most `max_frame_bytes`; count what cannot go as dropped.
        True when all of it was sent.

        Sets `dropped_before` (the running drop count), `dropped_since` (those since the last frame that went out)
        and `sender` on each frame's batch before sending it.
        """
        with self._lock:
            parts, too_big = split_batch(batch, self.max_frame_bytes)
            if too_big:
                self.dropped += too_big
                self.dropped_batches += 1
                log.warning("feature_sequence_too_big", sequences=too_big, max_frame_bytes=self.max_frame_bytes,
                            total=self.dropped)
            sent = 0
            for part in parts:
                part.dropped_before, part.sender = self.dropped, self.sender
                part.dropped_since = self.dropped - self._reported
                try:
                    frame = Envelope(features=part).SerializeToString()
                    self._sock.send(frame, flags=zmq.NOBLOCK)
                except (zmq.Again, EncodeError) as e:
                    self.dropped += len(part.sequences)
                    self.dropped_batches += 1
                    if isinstance(e, EncodeError):
                        log.warning("feature_batch_unencodable", error=str(e), total=self.dropped)
                    elif self._watch is not None:
                        self._watch.hint()  # logs zmq_handshake_failed once, where the drafter refused us
                    continue
                self._reported = part.dropped_before
                self.sent += 1
                sent += 1
            return not too_big and sent == len(parts)

    def close(self) -> None:
        with self._lock:
            if self._watch is not None:
                self._watch.close()
            self._sock.close()
        self._ctx.term()

    def __enter__(self) -> FeaturePusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FeaturePuller:
    """PULL of FeatureBatch (the drafter binds, rollouts connect). Garbage is counted and skipped."""

    def __init__(self, bind: str, hwm: int = 16, token: str = "") -> None:
        self.garbage = 0
        self.received = 0  # batches parsed
        self.frames = 0  # frames taken off the socket (parsed or not yet)
        token = resolve_token(token)  # before the context: a token file that cannot be read leaves nothing behind
        self.sender_dropped = 0  # the last `dropped_before` seen
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth = ZmqAuth(self._ctx, token)
        self._auth.bind_or_release((self._sock, bind))
        self.endpoint = _endpoint(self._sock)

    def recv(self, timeout_s: float) -> FeatureBatch | None:
        """The next batch, or None when `timeout_s` passes without one (0: only what is queued now)."""
        deadline = time.monotonic() + timeout_s
        late = 0  # garbage read past the deadline is drained, but not forever
        while True:
            frame = self.recv_frame(max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            batch = self.parse(frame)
            if batch is not None:
                return batch
            if time.monotonic() >= deadline:
                late += 1
                if late > MAX_LATE_FRAMES:
                    return None

    def recv_frame(self, timeout_s: float) -> list[bytes] | None:
        """The next frame unparsed (`parse` it later: the coordinator holds them while the rollout decodes), or None
        when `timeout_s` passes without one; 0 looks without waiting. Never blocks past the poll: libzmq can say
        POLLIN with nothing to take (its ZAP path with a receive queue of one, zmq_auth.ZmqAuth.bind), where a
        blocking receive would hold the drafter's ingest thread, and its close, forever."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            if not self._sock.poll(timeout=int(max(0.0, deadline - time.monotonic()) * 1000)):
                return None
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # ready with nothing to take: wait on for the rest of timeout_s, as the caller asked
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.001)
                continue
            self.frames += 1
            return frames

    def parse(self, frames: list[bytes]) -> FeatureBatch | None:
        """The batch in a frame of `recv_frame`; None (counted) for garbage."""
        env = decode(frames[0], "features") if len(frames) == 1 else None
        if env is None:
            self.garbage += 1
            log.debug("garbage_feature_frame", frames=len(frames), total=self.garbage)
            return None
        self.received += 1
        self.sender_dropped = env.features.dropped_before
        return env.features

    def close(self) -> None:
        self._sock.close()
        self._auth.close()
        self._ctx.term()

    def __enter__(self) -> FeaturePuller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
