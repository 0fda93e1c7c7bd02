"""A drafter worker waiting on a slow coordinator still frees its replica's device at BUSY (found in review: a starved
coordinator made one first-window pull take 930 ms with BUSY pending, the drafter on the device all along; a
request could block the window up to the 10 s request timeout without a look at the capacity events).

Real parts throughout: a CapacityPublisher (the rollout's events) and a Coordinator on 127.0.0.1 ports the kernel picks,
a DrafterWorker on a tiny checkpoint. The coordinator is made slow as a starved one is: its router thread holds one
kind of request (`handle` waits) until the worker has released the device, or for `HOLD_S`.
"""

from __future__ import annotations

import threading
import time

import pytest

from drafter_helpers import BUSY, IDLE, model_dir, samples, state  # noqa: F401
from tlt.services.common.events import CapacityPublisher
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import Coordinator
from tlt.services.drafter.worker import DrafterWorker
from tlt.v1 import drafter_pb2

HOLD_S = 5.0  # how long the slow coordinator holds its answer at most (the worker's request timeout is 10 s)
RELEASE_BOUND_S = 1.0  # BUSY -> device free while the answer is held; ~10 ms here, the bound leaves room for a loaded host


def _setup(tmp_path, model_dir, samples, **over):  # noqa: ANN001, ANN202
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    cfg = DrafterServiceConfig(**{**dict(
        capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
        coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=64,
        batch_tokens=64, batch_rows=2, submit_every=2, gate_when_idle=False, pin_cpus=False), **over})
    coord = Coordinator(cfg, str(model_dir), None, None).start()
    coord.buffer.add_samples(samples)
    state(pub, 0, BUSY)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    assert worker._snapshot(None) and worker._hello(None)
    return pub, coord, worker


def _slow(coord: Coordinator, worker: DrafterWorker, pub: CapacityPublisher, kind: str) -> threading.Event:
    """Hold the coordinator's answer to the first `kind` request; publish BUSY 0.1 s after it arrives. The answer
    goes once the worker released the device (or after HOLD_S). Returns the event set when the answer went."""
    arrived, answered, released = threading.Event(), threading.Event(), threading.Event()
    real_handle, real_mark = coord.handle, worker._mark_released

    def handle(msg):  # noqa: ANN001, ANN202
        if msg.WhichOneof("body") == kind and not arrived.is_set():
            arrived.set()
            released.wait(HOLD_S)
            answered.set()
        return real_handle(msg)

    def mark(res):  # noqa: ANN001, ANN202
        real_mark(res)
        released.set()

    def busy_once_asked() -> None:
        if arrived.wait(20):
            time.sleep(0.1)
            state(pub, 0, BUSY)

    coord.handle, worker._mark_released = handle, mark  # the router thread calls self.handle
    threading.Thread(target=busy_once_asked, daemon=True).start()
    return answered


def _idle(worker: DrafterWorker, pub: CapacityPublisher) -> None:
    state(pub, 0, IDLE)
    deadline = time.monotonic() + 5
    while worker.state != IDLE and time.monotonic() < deadline:
        worker._poll_events(0.1)
    assert worker.state == IDLE


@pytest.mark.parametrize("kind", ["pull", "batch_request"])
def test_a_busy_while_the_coordinator_holds_a_request_frees_the_device_within_the_bound(tmp_path, model_dir, samples,
                                                                                        kind):
    pub, coord, worker = _setup(tmp_path, model_dir, samples)
    try:
        answered = _slow(coord, worker, pub, kind)
        _idle(worker, pub)
        res = worker.window()
        assert res.preempted and res.micro_steps == 0
        assert res.busy_timestamp > 0
        assert res.released - res.busy_timestamp < RELEASE_BOUND_S, (kind, res.released - res.busy_timestamp)
        assert answered.wait(HOLD_S + 5)  # the held answer went out; the worker's next request got a fresh socket
        assert worker.client.ask(pull=drafter_pb2.PullCandidate()).candidate.version == 0
    finally:
        worker.close()
        coord.close()
        pub.close()


def test_a_busy_while_the_coordinator_holds_a_delta_frees_the_device_and_the_delta_is_applied_once(
        tmp_path, model_dir, samples):
    """The worker gave the send up: whether the delta landed is unknown, so it stays deferred and is sent again at
    the next idle moment; the coordinator, which applied the held one, answers with the version it made."""
    pub, coord, worker = _setup(tmp_path, model_dir, samples)
    try:
        answered = _slow(coord, worker, pub, "update")
        _idle(worker, pub)
        res = worker.window()
        assert res.preempted and res.micro_steps == 2
        assert res.released - res.busy_timestamp < RELEASE_BOUND_S, res.released - res.busy_timestamp
        assert worker._deferred is not None and worker._deferred.steps == 2  # unknown whether it landed: kept
        assert answered.wait(HOLD_S + 5)
        deadline = time.monotonic() + 5
        while coord.deltas < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert coord.deltas == 1 and coord.candidate_version == 1  # the held send was applied after all
        worker._flush()  # the next idle moment: sent again, not applied twice
        assert worker._deferred is None
        assert coord.deltas == 1 and coord.candidate_version == 1
    finally:
        worker.close()
        coord.close()
        pub.close()
