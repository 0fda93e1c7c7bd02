"""Capacity events and feature transport over real ZeroMQ sockets on 127.0.0.1 (ephemeral ports).

Nothing is faked. PUB/SUB drops messages sent before a subscription reaches
the publisher ("slow joiner"); tests that need a live stream wait for a
heartbeat first, which proves the subscription is live. Every wait is bounded.
"""

from __future__ import annotations

import inspect
import threading
import time

import pytest
import zmq

from tlt.services.common.events import (
    FRAME_OVERHEAD,
    MAX_LATE_FRAMES,
    TOPIC,
    CapacityPublisher,
    CapacitySubscriber,
    Envelope,
    FeaturePuller,
    FeaturePusher,
    split_batch,
)
from tlt.services.common.events_local import LocalCapacityBus, LocalFeatureQueue
from tlt.services.common.zmq_auth import ZmqAuth
from tlt.v1 import common_pb2, events_pb2

ANY = "tcp://127.0.0.1:*"
BUSY, IDLE = common_pb2.REPLICA_STATE_BUSY, common_pb2.REPLICA_STATE_IDLE


def _event(replica: int, state: int, running: int = 0) -> events_pb2.CapacityEvent:
    return events_pb2.CapacityEvent(replica_id=replica, device="cpu", state=state, running=running)


def _batch(n: int, size: int = 16) -> events_pb2.FeatureBatch:
    seqs = [events_pb2.FeatureSequence(seq_id=f"s{i}", token_ids=[1, 2, 3], features=b"\0" * size) for i in range(n)]
    return events_pb2.FeatureBatch(sequences=seqs, source="rollout")


def _wait_heartbeat(sub: CapacitySubscriber, timeout_s: float = 5.0) -> events_pb2.CapacityEvent:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ev = sub.recv(0.5)
        if ev is not None and ev.heartbeat:
            return ev
    raise AssertionError("no heartbeat within the time limit")


@pytest.fixture
def publisher():
    pub = CapacityPublisher(ANY, ANY, server_id="srv-a", heartbeat_s=0.1)
    yield pub
    pub.close()


def test_late_subscriber_gets_current_state_from_snapshot(publisher: CapacityPublisher) -> None:
    publisher.publish(_event(0, BUSY, running=5))
    publisher.publish(_event(1, BUSY, running=3))
    publisher.publish(_event(1, IDLE))
    with CapacitySubscriber(publisher.pub_endpoint, publisher.snapshot_endpoint) as sub:
        snap = sub.snapshot(timeout_s=2.0)
        assert [(e.replica_id, e.state, e.running) for e in snap] == [(0, BUSY, 5), (1, IDLE, 0)]
        assert all(e.server_id == "srv-a" and not e.heartbeat for e in snap)
        assert sub.latest[("srv-a", 1)].state == IDLE

        _wait_heartbeat(sub)  # the subscription is live
        sent = publisher.publish(_event(0, IDLE))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ev = sub.recv(0.5)
            if ev is not None and not ev.heartbeat:
                break
        assert ev is not None and not ev.heartbeat
        assert (ev.replica_id, ev.state, ev.seq) == (0, IDLE, sent.seq)
        assert sub.latest[("srv-a", 0)].state == IDLE


def test_recv_zero_returns_what_is_queued_without_waiting() -> None:
    """recv(0) looks at the queue and never waits: a drafter worker asks between the parts of every micro-step
    whether its replica turned busy. recv(0) returned None without looking (the worker asked recv(0.001) instead,
    which did not wait only because the milliseconds left truncate to 0)."""
    pub = CapacityPublisher(ANY, ANY, server_id="srv-z", heartbeat_s=60.0)  # no heartbeat in the way
    try:
        with CapacitySubscriber(pub.pub_endpoint, pub.snapshot_endpoint) as sub:
            sub.snapshot(timeout_s=2.0)
            sent = None
            deadline = time.monotonic() + 5  # past the slow joiner: publish until one arrives
            while sent is None and time.monotonic() < deadline:
                pub.publish(_event(0, BUSY))
                sent = sub.recv(0.2)
            assert sent is not None
            while sub.recv(0.05) is not None:  # drain what the retries queued
                pass
            last = pub.publish(_event(0, IDLE))
            time.sleep(0.3)  # delivered to the subscriber's queue
            ev = sub.recv(0)
            assert ev is not None and (ev.state, ev.seq) == (IDLE, last.seq)
            t0 = time.monotonic()
            assert all(sub.recv(0) is None for _ in range(200))
            assert time.monotonic() - t0 < 0.15, "recv(0) must look without waiting"
    finally:
        pub.close()


def test_heartbeats_repeat_every_replica_state(publisher: CapacityPublisher) -> None:
    a = publisher.publish(_event(0, BUSY))
    b = publisher.publish(_event(1, IDLE))
    with CapacitySubscriber(publisher.pub_endpoint, publisher.snapshot_endpoint) as sub:
        seen: dict[int, events_pb2.CapacityEvent] = {}
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            ev = sub.recv(0.5)
            if ev is not None and ev.heartbeat:
                seen[ev.replica_id] = ev
        assert set(seen) == {0, 1}
        assert (seen[0].state, seen[0].seq) == (BUSY, a.seq)  # a heartbeat repeats the last seq
        assert (seen[1].state, seen[1].seq) == (IDLE, b.seq)


def test_seq_is_per_replica_and_thread_safe(publisher: CapacityPublisher) -> None:
    results: list[events_pb2.CapacityEvent] = []
    lock = threading.Lock()

    def worker(replica: int) -> None:
        for i in range(50):
            ev = publisher.publish(_event(replica, BUSY if i % 2 else IDLE))
            with lock:
                results.append(ev)

    threads = [threading.Thread(target=worker, args=(r % 2,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    for replica in (0, 1):
        seqs = sorted(e.seq for e in results if e.replica_id == replica)
        assert seqs == list(range(seqs[0], seqs[0] + 100))  # 2 threads x 50, no gaps, no repeats


def test_snapshot_times_out_without_publisher() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as silent:  # accepts the request, never answers
        silent.bind(ANY)
        endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
        with CapacitySubscriber("tcp://127.0.0.1:1", endpoint) as sub:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                sub.snapshot(timeout_s=0.3)
            assert time.monotonic() - start < 2


def test_garbage_on_snapshot_socket_is_counted_and_answered(publisher: CapacityPublisher) -> None:
    publisher.publish(_event(0, IDLE))
    with zmq.Context() as ctx:  # a peer with the token (zmq_auth.py) sending garbage
        for junk in ([b"\xff\xfe\xfd"], [b"a", b"b"], [Envelope(capacity=_event(3, BUSY)).SerializeToString()]):
            with ctx.socket(zmq.REQ) as req:
                req.setsockopt(zmq.LINGER, 0)
                ZmqAuth(ctx).connect(req, publisher.snapshot_endpoint)
                req.send_multipart(junk)
                assert req.poll(2000), "the publisher must still answer"
                assert Envelope.FromString(req.recv()).WhichOneof("body") is None
    assert publisher.garbage == 3
    with CapacitySubscriber(publisher.pub_endpoint, publisher.snapshot_endpoint) as sub:
        assert [e.replica_id for e in sub.snapshot()] == [0]


def _wait_until_live(sub: CapacitySubscriber, rogue: zmq.Socket, server_id: str = "") -> None:
    """Resend a probe event from `rogue` until `sub` receives one (a SUB drops what arrives before its
    subscription is live), then drain the duplicate probes."""
    probe = _event(99, IDLE)
    probe.server_id = server_id
    deadline = time.monotonic() + 5
    while sub.recv(0.1) is None:
        assert time.monotonic() < deadline, "subscription never became live"
        rogue.send_multipart([TOPIC, Envelope(capacity=probe).SerializeToString()])
    while sub.recv(0.1) is not None:
        pass


@pytest.fixture
def rogue_sub(publisher: CapacityPublisher):
    """A subscriber to a rogue PUB socket (live), whose snapshot came from `publisher` (replica 0 BUSY); with a stale
    and a fresh event of that replica to send."""
    publisher.publish(_event(0, BUSY))
    with zmq.Context() as ctx, ZmqAuth(ctx) as auth, ctx.socket(zmq.PUB) as rogue:  # a rogue with the token
        auth.bind(rogue, ANY)
        with CapacitySubscriber(rogue.getsockopt_string(zmq.LAST_ENDPOINT), publisher.snapshot_endpoint) as sub:
            known = sub.snapshot()[0]
            stale = _event(0, IDLE)
            stale.server_id, stale.seq = "srv-a", known.seq - 1
            fresh = _event(0, IDLE)
            fresh.server_id, fresh.seq = "srv-a", known.seq + 1
            _wait_until_live(sub, rogue, server_id="probe")
            yield rogue, sub, stale, fresh


@pytest.mark.parametrize("timeout_s", [3.0, 0.0])
def test_garbage_and_stale_events_on_sub_socket_are_skipped(rogue_sub, timeout_s: float) -> None:
    """Garbage and stale frames queued ahead of a real event are skipped, also by recv(0), a worker's non-waiting look
    for a BUSY (everything is queued before it looks)."""
    rogue, sub, stale, fresh = rogue_sub
    frames = [
        [TOPIC, b"\xff\xff\xff"],  # not protobuf
        [TOPIC],  # no body frame
        [TOPIC, Envelope(features=_batch(1)).SerializeToString()],  # wrong body
        [TOPIC, Envelope(capacity=stale).SerializeToString()],  # older than the snapshot
        [TOPIC, Envelope(capacity=fresh).SerializeToString()],
    ]
    for f in frames:
        rogue.send_multipart(f)
    if timeout_s == 0:
        time.sleep(0.3)
    got = sub.recv(timeout_s)
    assert got is not None and got.seq == fresh.seq and got.state == IDLE
    assert sub.garbage == 3
    assert sub.recv(0.2) is None
    assert sub.latest[("srv-a", 0)].seq == fresh.seq


def test_recv_reads_a_bounded_number_of_frames_past_its_deadline(rogue_sub) -> None:
    """Once its time is up recv reads at most MAX_LATE_FRAMES queued frames: a sender of endless garbage cannot hold
    it (recv(0) drains skipped frames to reach an event behind them)."""
    rogue, sub, _, _ = rogue_sub
    n = MAX_LATE_FRAMES + 36
    for _ in range(n):
        rogue.send_multipart([TOPIC, b"\xff\xff"])
    time.sleep(0.3)
    assert sub.recv(0) is None and sub.garbage == MAX_LATE_FRAMES
    assert sub.recv(0) is None and sub.garbage == n  # the rest, at the next look


def test_pusher_never_blocks_without_consumer() -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as probe:
        probe.bind(ANY)
        free = probe.getsockopt_string(zmq.LAST_ENDPOINT)
    # `free` is now an address nobody listens on
    with FeaturePusher(free, hwm=2) as pusher:
        start = time.monotonic()
        sent = [pusher.push(_batch(3)) for _ in range(500)]
        elapsed = time.monotonic() - start
    assert not any(sent)
    assert pusher.dropped == 1500 and pusher.dropped_batches == 500
    assert elapsed < 2.0, f"500 pushes took {elapsed:.2f}s"


def test_wait_connected_says_when_a_batch_can_go() -> None:
    """Nobody bound: False after the timeout, nothing sent. A puller there: True, and the next push goes and
    arrives. (A peer refusing the token: tests/test_zmq_auth.py.)"""
    from tlt.services.common.ports import free_port

    with FeaturePusher(f"tcp://127.0.0.1:{free_port()}") as pusher:
        start = time.monotonic()
        assert not pusher.wait_connected(0.3)
        assert time.monotonic() - start >= 0.25 and pusher.sent == 0
    with FeaturePuller(ANY) as puller, FeaturePusher(puller.endpoint) as pusher:
        assert pusher.wait_connected(10)
        assert pusher.push(_batch(1)) and pusher.dropped == 0
        assert puller.recv(3.0) is not None
    with FeaturePusher(f"tcp://127.0.0.1:{free_port()}") as pusher:  # a wait does not hold up a push meanwhile
        waiting = threading.Thread(target=pusher.wait_connected, args=(2.0,))
        waiting.start()
        time.sleep(0.2)
        start = time.monotonic()
        assert not pusher.push(_batch(1))
        assert time.monotonic() - start < 1.0 and waiting.is_alive()
        waiting.join()


def test_pusher_drops_when_consumer_is_slow_and_reports_count() -> None:
    with FeaturePuller(ANY, hwm=1) as puller, FeaturePusher(puller.endpoint, hwm=1) as pusher:
        deadline = time.monotonic() + 5
        while not pusher.push(_batch(1)) and time.monotonic() < deadline:
            time.sleep(0.01)  # wait for the TCP connection
        first = puller.recv(2.0)
        assert first is not None
        dropped_before_burst = pusher.dropped
        start = time.monotonic()
        results = [pusher.push(_batch(2, size=64 << 10)) for _ in range(400)]  # 50 MB, nobody reading
        elapsed = time.monotonic() - start
        assert elapsed < 5.0, f"pushes blocked for {elapsed:.2f}s"
        assert results.count(False) > 0
        assert pusher.dropped - dropped_before_burst == 2 * results.count(False)
        received = []
        while (b := puller.recv(0.5)) is not None:
            received.append(b)
        assert 0 < len(received) <= results.count(True) + 1
        pusher.push(_batch(1))
        last = puller.recv(2.0)
        assert last is not None and last.dropped_before == pusher.dropped
        assert puller.sender_dropped == pusher.dropped


def test_garbage_on_pull_socket_is_counted() -> None:
    with FeaturePuller(ANY) as puller, zmq.Context() as ctx, ctx.socket(zmq.PUSH) as rogue:
        ZmqAuth(ctx).connect(rogue, puller.endpoint)  # a peer with the token (zmq_auth.py) sending garbage
        rogue.send(b"\x08\x96\x01\xff\xff")  # truncated varint field: not protobuf
        rogue.send_multipart([b"two", b"frames"])
        rogue.send(Envelope(capacity=_event(0, IDLE)).SerializeToString())  # wrong body
        rogue.send(Envelope(features=_batch(2)).SerializeToString())
        got = puller.recv(3.0)
        assert got is not None and len(got.sequences) == 2
        assert puller.garbage == 3 and puller.received == 1


def test_local_capacity_bus_matches_the_contract() -> None:
    bus = LocalCapacityBus("local")
    bus.publish(_event(0, BUSY))
    feed = bus.subscribe()
    assert [(e.replica_id, e.state, e.seq) for e in feed.snapshot()] == [(0, BUSY, 1)]
    bus.publish(_event(0, IDLE))
    ev = feed.recv(1.0)
    assert ev is not None and (ev.state, ev.seq, ev.heartbeat) == (IDLE, 2, False)
    bus.heartbeat()
    ev = feed.recv(1.0)
    assert ev is not None and ev.heartbeat and ev.seq == 2
    assert feed.recv(0.01) is None



def test_local_capacity_bus_keeps_the_publishers_contract_and_hands_out_copies() -> None:
    """The in-process bus stands in for CapacityPublisher/Subscriber in tests, so it must keep their contract: a
    published state never a heartbeat, the caller's server_id and timestamp kept (the bus's name and the time only
    where unset), a snapshot in replica order, a negative wait that only looks (the ZeroMQ feeds clamp it;
    queue.get raised ValueError), and every event a copy: one subscriber changing what it got changed the other's
    event and the bus's state."""
    bus = LocalCapacityBus("local")
    ev = _event(2, BUSY)
    ev.heartbeat, ev.server_id, ev.timestamp = True, "srv-b", 123.5  # a state change is never a heartbeat
    a, b = bus.publish(ev), bus.publish(_event(0, IDLE))
    assert (a.server_id, a.timestamp, a.heartbeat, b.server_id) == ("srv-b", 123.5, False, "local")
    assert abs(b.timestamp - time.time()) < 60
    a.state = IDLE  # what publish returned is the caller's own
    first, second = bus.subscribe(), bus.subscribe()
    assert [(e.replica_id, e.state) for e in first.snapshot()] == [(0, IDLE), (2, BUSY)]
    bus.publish(_event(1, BUSY))
    got = first.recv(1.0)
    assert got is not None and got.replica_id == 1
    got.state, got.running = IDLE, 99
    other = second.recv(1.0)
    assert other is not None and (other.state, other.running) == (BUSY, 0)
    assert [(e.replica_id, e.state, e.running) for e in bus.current()] == [(0, IDLE, 0), (1, BUSY, 0), (2, BUSY, 0)]
    assert first.recv(-1.0) is None
    q = LocalFeatureQueue(maxsize=1)
    assert q.recv(-1.0) is None and q.recv_frame(-1.0) is None
    q.push(_batch(1))
    assert q.recv(-1.0) is not None  # what is queued is still taken

def test_local_feature_queue_drops_when_full() -> None:
    """A feature queue is bounded (4 batches unless told), and a push past that is dropped and counted, never
    queued or waited on: an unbounded default let a test's producer outrun its consumer without a drop."""
    default = LocalFeatureQueue()
    assert [default.push(_batch(1)) for _ in range(5)] == [True] * 4 + [False] and default.dropped == 1
    q = LocalFeatureQueue(maxsize=2)
    assert [q.push(_batch(3)) for _ in range(4)] == [True, True, False, False]
    assert q.dropped == 6 and q.dropped_batches == 2
    assert q.recv(0.1) is not None and q.recv(0.1) is not None and q.recv(0.05) is None
    q.push(_batch(1))
    got = q.recv(0.1)
    assert got is not None and (got.dropped_before, got.dropped_since) == (6, 6)
    q.push(_batch(1))  # nothing dropped since the batch that reported the six
    got = q.recv(0.1)
    assert got is not None and (got.dropped_before, got.dropped_since) == (6, 0)


def test_publish_sets_seq_from_the_start_time_and_keeps_the_callers_fields() -> None:
    start_us = time.time_ns() // 1000
    with CapacityPublisher(ANY, ANY, server_id="srv-a", heartbeat_s=5.0) as first:
        a = first.publish(_event(0, BUSY))
        ev = _event(1, IDLE)
        ev.heartbeat, ev.server_id, ev.timestamp = True, "srv-b", 123.5  # a state change is never a heartbeat
        b = first.publish(ev)
    assert a.seq > start_us and b.seq > start_us  # numbers start at the start time in microseconds
    assert (a.server_id, b.server_id) == ("srv-a", "srv-b") and b.timestamp == 123.5 and not b.heartbeat
    assert abs(a.timestamp - time.time()) < 60
    with CapacityPublisher(ANY, ANY, server_id="srv-a", heartbeat_s=5.0) as restarted:
        assert restarted.publish(_event(0, IDLE)).seq > a.seq  # a restarted publisher continues above


def test_snapshot_request_with_extra_frames_and_frames_on_a_longer_topic_are_garbage(
        publisher: CapacityPublisher) -> None:
    publisher.publish(_event(0, IDLE))
    request = Envelope(snapshot_request=events_pb2.SnapshotRequest()).SerializeToString()
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as req:
        req.setsockopt(zmq.LINGER, 0)
        ZmqAuth(ctx).connect(req, publisher.snapshot_endpoint)
        req.send_multipart([request, b"extra"])
        assert req.poll(2000), "the publisher must still answer"
        assert Envelope.FromString(req.recv()).WhichOneof("body") is None
    assert publisher.garbage == 1
    with zmq.Context() as ctx, ZmqAuth(ctx) as auth, ctx.socket(zmq.PUB) as rogue:  # a rogue with the token
        auth.bind(rogue, ANY)
        with CapacitySubscriber(rogue.getsockopt_string(zmq.LAST_ENDPOINT), publisher.snapshot_endpoint) as sub:
            _wait_until_live(sub, rogue)
            # "capx" passes the SUB prefix filter "cap" but is another topic
            rogue.send_multipart([TOPIC + b"x", Envelope(capacity=_event(5, BUSY)).SerializeToString()])
            assert sub.recv(0.5) is None and sub.garbage == 1 and ("", 5) not in sub.latest


def test_a_batch_over_the_frame_limit_goes_as_several_frames_and_a_sequence_over_it_is_dropped() -> None:
    # A whole RL batch can finish in one engine step; serialized as one frame it can pass protobuf's 2 GiB
    # limit and the encode error killed the replica. Here the limit is 10 kB instead of 256 MiB.
    default = inspect.signature(FeaturePusher).parameters["max_frame_bytes"].default
    assert default < 2**31 - (64 << 20)  # the default frame stays under 2 GiB
    with FeaturePuller(ANY) as puller, FeaturePusher(puller.endpoint, max_frame_bytes=10_000) as pusher:
        deadline = time.monotonic() + 5
        while not pusher.push(_batch(1)) and time.monotonic() < deadline:
            time.sleep(0.01)  # wait for the TCP connection
        assert puller.recv(2.0) is not None
        before = pusher.dropped  # pushes before the connection was up
        batch = _batch(7, size=3_000)  # ~21 kB: three frames of at most three sequences
        batch.sequences.append(events_pb2.FeatureSequence(seq_id="huge", token_ids=[1], features=b"\0" * 20_000))
        assert not pusher.push(batch)  # not all of it went
        frames = []
        while (b := puller.recv(0.5)) is not None:
            frames.append(b)
        assert sorted(s.seq_id for f in frames for s in f.sequences) == [f"s{i}" for i in range(7)]
        assert len(frames) == 3 and all(len(Envelope(features=f).SerializeToString()) <= 10_000 for f in frames)
        assert pusher.dropped == before + 1 and {f.dropped_before for f in frames} == {before + 1}
        assert {f.sender for f in frames} == {pusher.sender} and {f.source for f in frames} == {"rollout"}


def test_a_heartbeat_carries_the_time_it_was_sent_and_a_snapshot_lists_replicas_in_order(
        publisher: CapacityPublisher) -> None:
    """A heartbeat says the state holds NOW: it carried the time of the state change, however long ago that was."""
    late = publisher.publish(_event(2, IDLE))
    publisher.publish(_event(0, BUSY))
    with CapacitySubscriber(publisher.pub_endpoint, publisher.snapshot_endpoint) as sub:
        assert [e.replica_id for e in sub.snapshot()] == [0, 2]  # by replica, not by first publish
        beat = _wait_heartbeat(sub)
        while beat.replica_id != 2:
            beat = _wait_heartbeat(sub)
        assert beat.seq == late.seq and beat.timestamp > late.timestamp  # a copy of the publish had its time


def test_sequences_that_fit_a_frame_exactly_share_it() -> None:
    """split_batch packs as many sequences as fit into each frame, the last byte of its room included."""
    batch = _batch(3, size=100)
    n = batch.sequences[0].ByteSize() + 16  # what split_batch counts per sequence
    parts, too_big = split_batch(batch, FRAME_OVERHEAD + 2 * n)  # room for two exactly
    assert too_big == 0 and [len(p.sequences) for p in parts] == [2, 1]
