"""Admission control: a request is refused before any of it reaches a replica when the replicas hold too much.

`max_pending_sequences` bounds the sequences handed to the replicas and not yet finished, failed or dropped
(running or waiting, `pending_sequences`): the pool counts them exactly per replica (`_Replica.outstanding`,
at submit, finish, failure, abort answer and death), plus the unfinished ones of requests whose replica died and
that wait for one to serve again (re-dispatch, replicas.py), plus those admitted and not handed to a replica yet. The
HTTP and gRPC handlers call `admit` with a request's prompts x n before they submit it: 400 / INVALID_ARGUMENT when it
alone is over the limit, 429 / RESOURCE_EXHAUSTED when it would fit once others finish. Given the engine requests'
ids, `admit` reserves their sequences until each reaches the pool (`generate` takes its reservation) or
`RESERVATION_S` passes (a streamed response whose client left before its body started never reaches it): the HTTP
handlers submit a turn or more after they admit (a streamed one once its body starts), and a burst of 40 requests
passed a limit of 8 together.

`Admission` is a mixin of `ReplicaPool` (replicas.py).
"""

from __future__ import annotations

import time
from typing import Any

from tlt.services.rollout.errors import InvalidRequestError, OverloadedError

RESERVATION_S = 60.0  # an admitted request that has not reached the pool by then no longer holds its place


class Admission:
    max_pending_sequences: int  # 0: no limit
    replicas: list[Any]
    _pending: dict[str, Any]  # request id -> replicas._Pending
    _reserved: dict[str, tuple[int, float]]  # engine request id -> (sequences, monotonic time admitted)

    @property
    def pending_sequences(self) -> int:
        """Sequences handed to the replicas and not yet finished, failed or dropped (running or waiting), and those
        waiting to be re-dispatched once a replica serves again."""
        parked = sum(p.remaining for p in self._pending.values() if p.replica is None)
        return sum(r.outstanding for r in self.replicas) + parked + sum(n for n, _ in self._reserved.values())

    def take_reservation(self, request_id: str) -> None:
        """The request reached the pool (its sequences are counted there now)."""
        self._reserved.pop(request_id, None)

    def admit(self, sequences: int, reserve: dict[str, int] | None = None) -> None:
        """Refuse a request of `sequences` (its prompts x n, all at once) that would take the replicas past
        `max_pending_sequences`: InvalidRequestError when it alone is larger (waiting cannot help), OverloadedError
        when it would fit once others finish. `reserve` (engine request id -> its sequences): hold them counted until
        each request reaches the pool; without it a check only (a caller that submits in the same loop turn)."""
        limit = self.max_pending_sequences
        if not limit:
            return
        now = time.monotonic()
        for rid in [r for r, (_, t) in self._reserved.items() if now - t > RESERVATION_S]:
            del self._reserved[rid]
        if sequences > limit:
            raise InvalidRequestError(f"{sequences} sequences (prompts x n) in one request is over the server's "
                                      f"max_pending_sequences={limit}")
        pending = self.pending_sequences
        if pending + sequences > limit:
            raise OverloadedError(f"the server is busy: {pending} sequences pending, and {sequences} more would pass "
                                  f"max_pending_sequences={limit}; retry later")
        for rid, n in (reserve or {}).items():
            self._reserved[rid] = (n, now)
