"""The REQ client a drafter worker asks its coordinator through (services/drafter/coordinator.py serves it).

Every message carries the worker's id, its replica and the shared-weights version it trains against (the
coordinator shows them in status). A request not answered within `timeout_s` closes its socket (a REQ that lost
its answer cannot send again) and raises CoordinatorUnavailable; the next request opens a fresh one. An answer
with an error raises CoordinatorRefused.

A worker asks with its drafter on the device (a pull, a batch, a delta): `should_stop` (its look at the capacity
events) is called every `STOP_CHECK_S` while the answer is awaited, and True gives the request up at once the same way
(the socket closed, CoordinatorInterrupted), so a BUSY frees the device within that much of the wait however slow the
coordinator is: it waited up to the 10 s timeout (a starved coordinator held one first-window pull 930 ms).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from tlt.services.common.auth import resolve_token
from tlt.services.common.zmq_auth import HandshakeWatch, ZmqAuth
from tlt.services.drafter.coordinator import WORKER_REQUEST_TIMEOUT_S
from tlt.v1 import drafter_pb2


class CoordinatorUnavailable(RuntimeError):
    pass


class CoordinatorRefused(RuntimeError):
    """The coordinator answered with an error (e.g. it could not build a batch from its buffer)."""


class CoordinatorInterrupted(CoordinatorUnavailable):
    """The caller's `should_stop` said stop while the answer was awaited: the request was given up (it may still be
    carried out; a delta sent again is applied once, the coordinator's `apply_delta`)."""


STOP_CHECK_S = 0.01  # while an answer is awaited, `should_stop` is asked this often


class CoordinatorClient:
    """REQ to the coordinator with a timeout; a lost answer gets a fresh socket (REQ cannot recover)."""

    def __init__(self, endpoint: str, worker_id: int, replica_id: int,
                 timeout_s: float = WORKER_REQUEST_TIMEOUT_S, token: str = "") -> None:
        """`token`: the control token the coordinator's ROUTER is secured with (zmq_auth.py; empty: TLT_AUTH_TOKEN).
        A coordinator that refuses this client's key never answers: CoordinatorUnavailable after `timeout_s`, which
        then says the coordinator may require the control token (zmq_auth.HandshakeWatch)."""
        self.endpoint, self.worker_id, self.replica_id, self.timeout_s = endpoint, worker_id, replica_id, timeout_s
        token = resolve_token(token)  # before the context: a token file that cannot be read leaves nothing behind
        self._ctx = zmq.Context()
        self._auth = ZmqAuth(self._ctx, token)
        self._sock: zmq.Socket | None = None
        self._watch: HandshakeWatch | None = None
        self.shared_policy_version = 0  # stamped on every message: the coordinator shows them in status
        self.shared_fetch_failures = 0

    def ask(self, should_stop: Callable[[], bool] | None = None, **body: object) -> drafter_pb2.CoordinatorMessage:
        """Send one WorkerMessage with `body` and return the answer. `should_stop`: asked every STOP_CHECK_S while
        the answer is awaited; True gives the request up (CoordinatorInterrupted)."""
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._watch = self._auth.connect(self._sock, self.endpoint, watch=True)
        msg = drafter_pb2.WorkerMessage(worker_id=self.worker_id, replica_id=self.replica_id,
                                        shared_policy_version=self.shared_policy_version,
                                        shared_fetch_failures=self.shared_fetch_failures, **body)
        self._sock.send(msg.SerializeToString())
        kind = next(iter(body))
        self._await(kind, should_stop)
        reply = drafter_pb2.CoordinatorMessage.FromString(self._sock.recv())
        if reply.error:
            raise CoordinatorRefused(f"coordinator refused {kind}: {reply.error}")
        return reply

    def _await(self, kind: str, should_stop: Callable[[], bool] | None) -> None:
        """Return once the answer is there. After `timeout_s`, or when `should_stop()` says so, the socket (a REQ that
        lost its answer) is closed and CoordinatorUnavailable, or CoordinatorInterrupted, raised."""
        assert self._sock is not None
        deadline = time.monotonic() + self.timeout_s
        slice_s = self.timeout_s if should_stop is None else STOP_CHECK_S
        stopped = False
        while not self._sock.poll(int(1000 * max(0.0, min(slice_s, deadline - time.monotonic())))):
            if time.monotonic() >= deadline or (stopped := should_stop is not None and should_stop()):
                hint = self._watch.hint() if self._watch is not None else ""
                self._close_sock()
                if stopped:
                    raise CoordinatorInterrupted(f"{kind} to {self.endpoint} given up: the caller stopped waiting")
                raise CoordinatorUnavailable(f"no answer from the coordinator at {self.endpoint} in {self.timeout_s}s"
                                             + (f"; {hint}" if hint else ""))

    def _close_sock(self) -> None:
        if self._watch is not None:
            self._watch.close()  # its monitor socket would hold the context's term forever
            self._watch = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self._close_sock()
        self._ctx.term()
