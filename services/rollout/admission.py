"""Admission control: a request is refused before any of it reaches a replica when the replicas hold too much.

`max_pending_sequences` bounds the sequences handed to the replicas and not yet finished, failed or dropped
(running or waiting, `pending_sequences`): the pool counts them exactly per replica (`_Replica.outstanding`,
at submit, finish, failure, abort answer and death), plus the unfinished ones of requests whose replica died and
that wait for one to serve again (re-dispatch, replicas.py). The HTTP and gRPC handlers call `admit` with a request's
prompts x n before they submit it: 400 / INVALID_ARGUMENT when it alone is over the limit, 429 / RESOURCE_EXHAUSTED
when it would fit once others finish.

`Admission` is a mixin of `ReplicaPool` (replicas.py).
"""

from __future__ import annotations

from typing import Any

from tlt.services.rollout.errors import InvalidRequestError, OverloadedError


class Admission:
    max_pending_sequences: int  # 0: no limit
    replicas: list[Any]
    _pending: dict[str, Any]  # request id -> replicas._Pending

    @property
    def pending_sequences(self) -> int:
        """Sequences handed to the replicas and not yet finished, failed or dropped (running or waiting), and those
        waiting to be re-dispatched once a replica serves again."""
        parked = sum(p.remaining for p in self._pending.values() if p.replica is None)
        return sum(r.outstanding for r in self.replicas) + parked

    def admit(self, sequences: int) -> None:
        """Refuse a request of `sequences` (its prompts x n, all at once) that would take the replicas past
        `max_pending_sequences`: InvalidRequestError when it alone is larger (waiting cannot help), OverloadedError
        when it would fit once others finish. A check, not a reservation: requests arriving within one event loop
        turn may pass it together, by at most their own sizes."""
        limit = self.max_pending_sequences
        if not limit:
            return
        if sequences > limit:
            raise InvalidRequestError(f"{sequences} sequences (prompts x n) in one request is over the server's "
                                      f"max_pending_sequences={limit}")
        pending = self.pending_sequences
        if pending + sequences > limit:
            raise OverloadedError(f"the server is busy: {pending} sequences pending, and {sequences} more would pass "
                                  f"max_pending_sequences={limit}; retry later")
