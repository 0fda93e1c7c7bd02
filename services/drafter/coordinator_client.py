"""The REQ client a drafter worker asks its coordinator through (services/drafter/coordinator.py serves it).

Every message carries the worker's id, its replica and the shared-weights version it trains against (the
coordinator shows them in status). A request not answered within `timeout_s` closes its socket (a REQ that lost
its answer cannot send again) and raises CoordinatorUnavailable; the next request opens a fresh one. An answer
with an error raises CoordinatorRefused.
"""

from __future__ import annotations

import zmq

from tlt.services.drafter.coordinator import WORKER_REQUEST_TIMEOUT_S
from tlt.v1 import drafter_pb2


class CoordinatorUnavailable(RuntimeError):
    pass


class CoordinatorRefused(RuntimeError):
    """The coordinator answered with an error (e.g. it could not build a batch from its buffer)."""


class CoordinatorClient:
    """REQ to the coordinator with a timeout; a lost answer gets a fresh socket (REQ cannot recover)."""

    def __init__(self, endpoint: str, worker_id: int, replica_id: int,
                 timeout_s: float = WORKER_REQUEST_TIMEOUT_S) -> None:
        self.endpoint, self.worker_id, self.replica_id, self.timeout_s = endpoint, worker_id, replica_id, timeout_s
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self.shared_policy_version = 0  # stamped on every message: the coordinator shows them in status
        self.shared_fetch_failures = 0

    def ask(self, **body: object) -> drafter_pb2.CoordinatorMessage:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        msg = drafter_pb2.WorkerMessage(worker_id=self.worker_id, replica_id=self.replica_id,
                                        shared_policy_version=self.shared_policy_version,
                                        shared_fetch_failures=self.shared_fetch_failures, **body)
        self._sock.send(msg.SerializeToString())
        if not self._sock.poll(int(self.timeout_s * 1000)):
            self._sock.close()
            self._sock = None
            raise CoordinatorUnavailable(f"no answer from the coordinator at {self.endpoint} in {self.timeout_s}s")
        reply = drafter_pb2.CoordinatorMessage.FromString(self._sock.recv())
        if reply.error:
            raise CoordinatorRefused(f"coordinator refused {next(iter(body))}: {reply.error}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
