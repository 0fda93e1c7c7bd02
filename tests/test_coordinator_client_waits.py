"""services/drafter/coordinator_client.py, what tests/test_coordinator_client.py leaves open: a fresh client's stamps,
one socket for every answered request, how long `timeout_s` really is, how often `should_stop` is asked, and that
a given-up request is a CoordinatorUnavailable to whoever catches that.

Each was a surviving mutant of a mutation audit: the stamps starting at 1 instead of 0, a new REQ socket for every
request (`if True:` for `if self._sock is None:`; the old ones left to the garbage collector), a deadline of
3 x `timeout_s`, STOP_CHECK_S 0.2 s instead of 10 ms, and CoordinatorInterrupted derived from RuntimeError (the
worker's loop and flush catch CoordinatorUnavailable). The client and the sockets are real (ZeroMQ over TCP on
127.0.0.1, CURVE under the tests' control token); the peer is a bare ROUTER that answers by hand. Every wait is
bounded: the client's blocking calls run in daemon threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import zmq

from tlt.services.common.zmq_auth import ZmqAuth
from tlt.services.drafter.coordinator_client import (CoordinatorClient, CoordinatorInterrupted,
                                                     CoordinatorUnavailable)
from tlt.v1 import drafter_pb2


class _Coordinator:
    """A ROUTER bound on 127.0.0.1 as the coordinator binds (ZmqAuth, the tests' TLT_AUTH_TOKEN)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.auth = ZmqAuth(self.ctx)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.auth.bind(self.sock, "tcp://127.0.0.1:*")
        self.endpoint = self.sock.last_endpoint.decode()

    def take(self, timeout_s: float = 10.0) -> tuple[list[bytes], drafter_pb2.WorkerMessage]:
        """The next request: its envelope (the peer's identity first: one per connected socket) and the message."""
        assert self.sock.poll(int(1000 * timeout_s)), f"no request within {timeout_s} s"
        *envelope, payload = self.sock.recv_multipart()
        return envelope, drafter_pb2.WorkerMessage.FromString(payload)

    def answer(self, envelope: list[bytes], **body: object) -> None:
        self.sock.send_multipart([*envelope, drafter_pb2.CoordinatorMessage(**body).SerializeToString()])

    def close(self) -> None:
        self.sock.close()
        self.auth.close()
        self.ctx.term()


class _Call:
    """`fn(*a, **k)` in a daemon thread; `result(timeout_s)` returns its value or raises what it raised."""

    def __init__(self, fn: Callable[..., object], *a: object, **k: object) -> None:
        self._done = threading.Event()
        self._value: object = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(fn, a, k), daemon=True).start()

    def _run(self, fn, a, k) -> None:  # noqa: ANN001
        try:
            self._value = fn(*a, **k)
        except BaseException as e:  # noqa: BLE001 - handed to the test by result()
            self._error = e
        self._done.set()

    def result(self, timeout_s: float) -> object:
        assert self._done.wait(timeout_s), f"the call did not return within {timeout_s} s"
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture
def coordinator():
    coord = _Coordinator()
    yield coord
    coord.close()


def test_a_fresh_client_stamps_zeros_and_keeps_one_socket(coordinator) -> None:
    """Before the worker has fetched any shared weights its messages say policy version 0 and 0 failed fetches (the
    coordinator shows them and takes a worker's version as a policy it heard of). Answered requests all go out on
    one REQ socket: the ROUTER sees one peer identity, not a new connection (and CURVE handshake) per request."""
    client = CoordinatorClient(coordinator.endpoint, worker_id=3, replica_id=1, timeout_s=10)
    try:
        peers = []
        for version in (1, 2, 3):
            call = _Call(client.ask, pull=drafter_pb2.PullCandidate())
            envelope, msg = coordinator.take()
            assert (msg.shared_policy_version, msg.shared_fetch_failures) == (0, 0), msg
            peers.append(envelope[0])
            coordinator.answer(envelope, candidate_version=version)
            assert call.result(10).candidate_version == version
        assert len(set(peers)) == 1, f"{len(set(peers))} sockets for 3 answered requests"
    finally:
        _Call(client.close).result(10)


def test_an_unanswered_request_is_given_up_after_timeout_s_not_later(coordinator) -> None:
    """`timeout_s` is the wait: a 1 s timeout raises CoordinatorUnavailable after 1 s, not after several (a worker
    that retries a silent coordinator, or holds its device meanwhile, waits that long each time). 1.5 s of slack for
    a loaded machine; a deadline of 3 x timeout_s is 3 s."""
    client = CoordinatorClient(coordinator.endpoint, worker_id=3, replica_id=1, timeout_s=1.0)
    try:
        start = time.monotonic()
        call = _Call(client.ask, pull=drafter_pb2.PullCandidate())
        coordinator.take()  # never answered
        with pytest.raises(CoordinatorUnavailable, match="in 1.0s"):
            call.result(10)
        took = time.monotonic() - start
        assert 0.95 <= took < 2.5, f"gave up after {took:.2f} s for a 1 s timeout"
    finally:
        _Call(client.close).result(10)


def test_should_stop_is_asked_every_few_milliseconds_and_a_stop_is_an_unavailable(coordinator) -> None:
    """While an answer is awaited `should_stop` is asked every STOP_CHECK_S (10 ms): about 60 times in a 0.6 s wait
    (at least 15 asked here, for a loaded machine; every 0.2 s would be 3), a BUSY frees the device that soon. False
    throughout ends in CoordinatorUnavailable at the timeout, not CoordinatorInterrupted. A True gives the request up
    as CoordinatorInterrupted, which is a CoordinatorUnavailable: the worker's loop and its final flush catch that."""
    client = CoordinatorClient(coordinator.endpoint, worker_id=3, replica_id=1, timeout_s=0.6)
    try:
        looks: list[float] = []

        def never() -> bool:
            looks.append(time.monotonic())
            return False

        call = _Call(client.ask, should_stop=never, pull=drafter_pb2.PullCandidate())
        coordinator.take()  # never answered
        with pytest.raises(CoordinatorUnavailable, match="no answer from the coordinator") as err:
            call.result(10)
        assert not isinstance(err.value, CoordinatorInterrupted)
        assert len(looks) >= 15, f"should_stop asked {len(looks)} times in a 0.6 s wait"
        client.timeout_s = 60
        call = _Call(client.ask, should_stop=lambda: True, pull=drafter_pb2.PullCandidate())
        coordinator.take()
        with pytest.raises(CoordinatorUnavailable) as err:
            call.result(5)
        assert isinstance(err.value, CoordinatorInterrupted), repr(err.value)
    finally:
        _Call(client.close).result(10)
