"""The drop counts the feature senders report (FeatureBatch.dropped_before, a uint64 running count per sender)
are untrusted input: one 20-byte message on the features socket with dropped_before = 2**63 made the summed
count overflow DrafterStatus.features_dropped (int64), and every Drafter.GetStatus failed ("Value out of range")
until a restart; each distinct sender id also stayed in a dict for ever, summed again at each batch.
A count past plausibility refuses its batch (counted as rejected); the senders kept are bounded, the total kept.
Real parts: a raw ZeroMQ PUSH into the coordinator's FeaturePuller on 127.0.0.1, the status gRPC server of
`tlt drafter serve` asked over a real channel."""

from __future__ import annotations

import time
from contextlib import contextmanager

import grpc
import numpy as np
import zmq

from drafter_helpers import model_dir, wait_for  # noqa: F401 (fixture)
from tlt.services.common import events as events_mod
from tlt.services.drafter import buffer as buffer_mod
from tlt.services.common.zmq_auth import ZmqAuth
from tlt.services.drafter.buffer import FeatureBuffer
from tlt.v1 import drafter_pb2, drafter_pb2_grpc, events_pb2


def _seq(name: str, h: int, n: int = 12) -> events_pb2.FeatureSequence:
    return events_pb2.FeatureSequence(seq_id=name, token_ids=list(range(5, 5 + n)), response_start=3, hidden_size=h,
                                      features=np.full((n, h), 0.5, np.float16).tobytes())


def test_an_absurd_drop_count_is_refused_and_status_keeps_answering(tmp_path, model_dir) -> None:  # noqa: F811
    from tlt.services.common.events import FeaturePuller
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.serve import start_status_server

    puller = FeaturePuller("tcp://127.0.0.1:*")
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               window_tokens=16, batch_tokens=16, holdout_every=1000, gate_when_idle=False,
                               eval_interval_s=1e9)
    coord = Coordinator(cfg, str(model_dir), puller, None).start()
    server, port = start_status_server(coord, "127.0.0.1", 0)
    h = coord.drafter_cfg.hidden_size
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    ZmqAuth(ctx).connect(push, puller.endpoint)  # a peer with the token
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        def send(batch: events_pb2.FeatureBatch) -> None:
            push.send(events_pb2.Envelope(features=batch).SerializeToString())

        send(events_pb2.FeatureBatch(source="rollout", sender="evil", dropped_before=1 << 63))  # 20 bytes
        send(events_pb2.FeatureBatch(source="rollout", sender="evil2", dropped_before=(1 << 64) - 1,
                                     sequences=[_seq("bad", h)]))
        send(events_pb2.FeatureBatch(source="rollout", sender="a", dropped_before=3, sequences=[_seq("good", h)]))
        send(events_pb2.FeatureBatch(source="rollout", sender="b", dropped_before=4))
        assert wait_for(lambda: coord.buffer.received_sequences >= 2, 10)
        time.sleep(0.2)
        st = drafter_pb2_grpc.DrafterStub(channel).GetStatus(drafter_pb2.DrafterStatusRequest(), timeout=10)
        assert st.features_dropped == 7  # the plausible senders' counts only
        assert st.features_rejected == 2  # the two refused batches (one of them with no sequence)
        assert st.buffer_sequences == 1  # "bad" came in a refused batch
    finally:
        channel.close()
        push.close()
        ctx.term()
        server.stop(grace=0).wait()
        coord.close()
        puller.close()


def test_the_senders_kept_are_bounded_and_the_total_stays_right(monkeypatch) -> None:
    monkeypatch.setattr(buffer_mod, "MAX_SENDERS", 8)
    buf = FeatureBuffer(10, 10, 8, 4, holdout_every=100)
    for i in range(100):  # a sender per process restart (or a peer inventing ids): each dropped 2
        buf.add_batch(events_pb2.FeatureBatch(sender=f"s{i}", dropped_before=2))
    assert buf.sender_dropped == 200 and len(buf._dropped) <= 8
    buf.add_batch(events_pb2.FeatureBatch(sender="s99", dropped_before=5))  # a kept sender's count goes on
    assert buf.sender_dropped == 203
    monkeypatch.setattr(buffer_mod, "MAX_SENDER_DROPPED", 1 << 62)  # (2**23 senders at the real bound)
    for i in range(3):  # each plausible, summed past int64
        buf.add_batch(events_pb2.FeatureBatch(sender=f"big{i}", dropped_before=1 << 62))
    assert buf.sender_dropped == (1 << 63) - 1


def test_a_sender_forgotten_then_heard_again_is_not_counted_twice(monkeypatch) -> None:
    """The buffer keeps the running drop counts of the MAX_SENDERS senders heard last; a sender forgotten and heard
    again had its whole running count added once more (1,025 senders x 5 drops read 5130, not 5125). Each frame now
    also says how many of its count were dropped since the sender's previous frame that went out, and a sender not
    in the map is counted only those. Real FeaturePushers into a FeaturePuller over ZeroMQ; the puller is closed and
    bound again (frames cannot go meanwhile: dropped) while the buffer, whose count is under test, stays."""
    from tlt.services.common.events import FeaturePusher

    monkeypatch.setattr(buffer_mod, "MAX_SENDERS", 3)
    puller = events_mod.FeaturePuller("tcp://127.0.0.1:*")  # its endpoint is bound again below, as a restarted
    endpoint = puller.endpoint  # coordinator binds its configured one
    puller.close()  # nobody bound: every push is dropped (IMMEDIATE)
    buf = FeatureBuffer(100, 100, 16, 4, holdout_every=1000, hidden_size=4)
    pushers = [FeaturePusher(endpoint) for _ in range(5)]

    def batch(name: str) -> events_pb2.FeatureBatch:
        return events_pb2.FeatureBatch(source="rollout", sequences=[_seq(name, 4)])

    def send(p: FeaturePusher, name: str) -> None:  # until one frame goes (each miss is a drop it then carries)
        deadline = time.monotonic() + 10
        while not p.push(batch(name)):
            assert time.monotonic() < deadline, "the pusher never reconnected"
            time.sleep(0.05)

    def drain() -> None:
        while (b := puller.recv(0.3)) is not None:
            buf.add_batch(b)

    try:
        for i, p in enumerate(pushers):
            assert not any(p.push(batch(f"p{i}-lost{k}")) for k in range(5))
        puller = events_mod.FeaturePuller(endpoint)
        for i, p in enumerate(pushers):  # p0 and p1 are forgotten (3 kept)
            send(p, f"p{i}")
        drain()
        assert buf.sender_dropped == sum(p.dropped for p in pushers) >= 25
        send(pushers[0], "p0-again")  # heard again, no new drop: nothing more to count
        drain()
        assert buf.sender_dropped == sum(p.dropped for p in pushers)
        puller.close()  # pushers[1], forgotten, drops 2 more meanwhile
        assert not pushers[1].push(batch("p1-lost-a")) and not pushers[1].push(batch("p1-lost-b"))
        puller = events_mod.FeaturePuller(endpoint)
        send(pushers[1], "p1-again")
        drain()
        assert buf.sender_dropped == sum(p.dropped for p in pushers)
        assert buf.received_sequences == 5 + 1 + 1
    finally:
        for p in pushers:
            p.close()
        puller.close()


@contextmanager
def _intake_running(add, rollout):  # noqa: ANN001, ANN202 - FeatureBuffer.add_batch-like, a .busy() stand-in
    """A real FeaturePuller on 127.0.0.1 with the intake's own loop in a thread, and a raw ZeroMQ PUSH (a peer with
    the token) connected to it: (puller, push, intake); everything closed after."""
    import threading

    from tlt.services.drafter.intake import FeatureIntake

    puller = events_mod.FeaturePuller("tcp://127.0.0.1:*")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    ZmqAuth(ctx).connect(push, puller.endpoint)
    intake, stop = FeatureIntake(puller, add, rollout), threading.Event()
    thread = threading.Thread(target=intake.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield puller, push, intake
    finally:
        stop.set()
        thread.join(5)
        push.close()
        ctx.term()
        puller.close()


def test_frames_held_while_the_rollout_decodes_are_counted_in_the_order_they_came() -> None:
    """Under train_when = rollout_idle the intake holds the frames that arrive while a replica decodes and parses
    them once it is idle. Parsed last-first, a sender's later running count (8) came before its earlier one (5):
    the buffer counted 3 of the 8 sequences it dropped. Real FeaturePuller fed by a raw ZeroMQ PUSH on 127.0.0.1,
    the intake's own loop in a thread; the rollout's busy state is a stand-in flag."""

    class Rollout:
        decoding = True

        def busy(self) -> bool:
            return self.decoding

    rollout, buf = Rollout(), FeatureBuffer(16, 16, 8, 8, 4)
    with _intake_running(buf.add_batch, rollout) as (puller, push, intake):
        for before, since in ((5, 5), (8, 3)):
            batch = events_pb2.FeatureBatch(source="rollout", sender="s1", dropped_before=before, dropped_since=since)
            push.send(events_pb2.Envelope(features=batch).SerializeToString())
        assert wait_for(lambda: puller.frames == 2, 10)
        time.sleep(0.3)
        assert buf.sender_dropped == 0  # held, unparsed, while the rollout decodes
        rollout.decoding = False
        assert wait_for(lambda: puller.received == 2, 10)
        with intake._lock:  # parse_held holds it until the last held batch is in the buffer
            assert buf.sender_dropped == 8


def test_frames_held_past_the_bound_are_parsed_and_the_count_starts_again(monkeypatch) -> None:
    """Held frames are parsed at once, busy or not, once HELD_FEATURE_BYTES of them wait; the count then starts
    again from nothing. Counted on, every later frame would be parsed as it came while a replica decodes (on a
    decoding replica's CPU) once the bound had been reached once. Real FeaturePuller fed by a raw ZeroMQ PUSH on
    127.0.0.1; the rollout's busy state is a stand-in flag, busy throughout."""
    from tlt.services.drafter import intake as intake_mod

    class Rollout:
        def busy(self) -> bool:
            return True

    frame = [events_pb2.Envelope(features=events_pb2.FeatureBatch(source="rollout", sender=f"s{i}")).SerializeToString()
             for i in range(5)]
    assert len({len(f) for f in frame}) == 1
    monkeypatch.setattr(intake_mod, "HELD_FEATURE_BYTES", 3 * len(frame[0]))  # the third frame reaches it
    with _intake_running(lambda b: None, Rollout()) as (puller, push, _):
        for f in frame[:3]:
            push.send(f)
        assert wait_for(lambda: puller.received == 3, 10), puller.received  # the bound: parsed, busy as it is
        for f in frame[3:]:
            push.send(f)
        assert wait_for(lambda: puller.frames == 5, 10)
        time.sleep(0.3)
        assert puller.received == 3  # two frames, under the bound again: held
