"""The replica pool's capacity events, and lending its devices to a colocated trainer.

Capacity events (when a `capacity` sink is given): a replica is BUSY from the moment a request
is handed to it while it had nothing outstanding, and IDLE again when its last outstanding
sequence finishes, fails or is aborted (the pool counts them exactly, replicas.py); DRAINING when it
dies or the pool stops. An aborted request (client gone) stays outstanding until its replica answers
that its engine dropped the sequences (`Aborted`): the replica may be in the middle of a step that
decodes them, and a drafter worker must not start training on a device that still decodes. The
events split what is outstanding into `running` (the engine's running sequences, as of the load it
reported with its last step or abort) and `queued` (the rest: waiting in its scheduler or still on
the way to it), and carry its KV use; a change of that split, or of KV use by a percent, is
published too, coalesced: at most one such event per replica every `REFRESH_MIN_S` (with the latest counts),
while a change of state goes out at once. Every subscriber (each drafter worker, the drafter coordinator) wakes
and parses each event while the replicas decode, and coalesced per loop turn only, a replica's counts moved with
nearly every step: 46 count events beside 2 state changes in a 0.55 s round of `tlt bench drafter-drift
--overhead`. Applying a policy push is work too: the
replica is BUSY while it copies the new weights in (a drafter worker training on its cores
meanwhile made the apply several times slower with spinning OpenMP threads, `spin_wait`). Each
change is published at once (drafter workers preempt on BUSY).

Lending (`lend` / `take_back`, services/rollout/lease.py): while a colocated trainer has borrowed the
devices, a replica with nothing to do is LENT instead of IDLE (drafter workers train only on IDLE) and its
backend releases what it can; new work or a policy push takes the devices back first, without an IDLE between.
However the lend ends (given back, new work, a lapsed lease), a replica says IDLE only once it has answered its
resume: SGLang's KV cache is back before a drafter worker may start on the device.

`CapacityStates` is a mixin of `ReplicaPool` (replicas.py): it reads the pool's replicas, versions, capacity
sink and loop, and asks replicas through the pool's `_ask`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from tlt.services.common.logging import get_logger
from tlt.services.rollout.errors import ReplicaUnavailableError, WeightUpdateError
from tlt.services.rollout.ipc import Lend, Reply
from tlt.services.rollout.lease import DeviceLease

if TYPE_CHECKING:
    from tlt.services.rollout.replica_lifecycle import _Replica

log = get_logger("rollout.replicas")

REFRESH_MIN_S = 0.1  # a replica's count / KV-use events (not its state changes) are at least this far apart


def failures(live: list[Any], replies: list[Any]) -> list[str]:
    """What went wrong on each replica of a command sent to all; one that died meanwhile serves nothing any more:
    it is not a failure."""
    return [f"replica {r.replica_id}: {x.error if isinstance(x, Reply) else repr(x)}"
            for r, x in zip(live, replies)
            if (not isinstance(x, Reply) or x.error) and not isinstance(x, ReplicaUnavailableError)]


class CapacityStates:
    capacity: Any  # a common.events.CapacitySink, or None
    replicas: list[Any]
    versions: Any
    lease: DeviceLease | None
    _loop: asyncio.AbstractEventLoop | None
    _stopping: bool
    _cmd_ids: Any  # ReplicaPool's: itertools.count of command ids
    _replies: dict[int, tuple[Any, asyncio.Future]]  # ReplicaPool's: command id -> (replica, its Reply's future)

    _releasing: asyncio.Future | None = None  # the gather of a first lend's releases, until they answered

    async def _ask(self, rep: Any, make: Any, timeout_s: float) -> Reply:  # ReplicaPool's
        raise NotImplementedError

    def _send(self, rep: Any, make: Any) -> tuple[int, asyncio.Future]:  # ReplicaPool's
        raise NotImplementedError

    async def _answer(self, sent: tuple[int, asyncio.Future], timeout_s: float) -> Reply:  # ReplicaPool's
        raise NotImplementedError

    def _new_lease(self) -> DeviceLease:
        assert self._loop is not None
        return DeviceLease(self._loop, self._lease_lapsed)

    # ---- capacity events ---------------------------------------------------------------------

    @staticmethod
    def _counts(rep: _Replica) -> tuple[int, int]:
        """(running, queued) on `rep`; they add up to its exact outstanding count. The engine's running count is
        as of its last report, so it is capped by what is outstanding now (a sequence finished since is not)."""
        outstanding = max(rep.outstanding, 0)
        running = min(rep.load.running, outstanding)
        return running, outstanding - running

    def _key(self, rep: _Replica, state: int) -> tuple:
        """What a capacity event of `rep` says; a new event goes out when it changes (KV use by whole percents)."""
        return (state, *self._counts(rep), round(rep.load.kv_usage * 100), self.versions.policy, self.versions.drafter)

    def _publish_state(self, rep: _Replica, state: int) -> None:
        if self.capacity is None:
            return
        from tlt.v1 import common_pb2, events_pb2

        v = self.versions
        running, queued = self._counts(rep)
        rep.published = self._key(rep, state)
        rep.published_at = time.monotonic()
        self.capacity.publish(events_pb2.CapacityEvent(
            replica_id=rep.replica_id, device=rep.info.device if rep.info else "", state=state,
            running=running, queued=queued, kv_usage=rep.load.kv_usage,
            versions=common_pb2.WeightVersions(policy=v.policy, drafter=v.drafter),
            start_drafter=rep.info.start_drafter if rep.info else ""))

    def _busy(self, rep: _Replica) -> None:
        """Call once the new work is counted in (outstanding / applying): BUSY at once when it was not,
        else the new count follows (coalesced: `_schedule_refresh`)."""
        from tlt.v1 import common_pb2

        if self.capacity is None:
            return
        if rep.published is None or rep.published[0] != common_pb2.REPLICA_STATE_BUSY:
            self._publish_state(rep, common_pb2.REPLICA_STATE_BUSY)
        else:
            self._schedule_refresh(rep)

    def _rest_state(self, rep: _Replica) -> int:
        """What a replica with nothing to do is: IDLE, or LENT while a colocated trainer has the devices or the
        replica has not answered its resume yet."""
        from tlt.v1 import common_pb2

        lent = self.lent_to or (self.lease is not None and rep in self.lease.resuming)
        return common_pb2.REPLICA_STATE_LENT if lent else common_pb2.REPLICA_STATE_IDLE

    def _maybe_idle(self, rep: _Replica) -> None:
        if not rep.has_work and rep.alive and not self._stopping:
            self._publish_state(rep, self._rest_state(rep))
        else:
            self._schedule_refresh(rep)  # still busy: its count (or versions) changed

    def _schedule_refresh(self, rep: _Replica) -> None:
        """Re-publish `rep`'s state with its current count and versions (heartbeats and the snapshot repeat
        the last event, so a count that changes while the state does not must be sent too). Coalesced: in this loop
        turn, or REFRESH_MIN_S after `rep`'s last event when that was sooner (with the counts of that moment)."""
        if self.capacity is None or rep.refresh_scheduled or self._loop is None:
            return
        rep.refresh_scheduled = True
        wait = rep.published_at + REFRESH_MIN_S - time.monotonic()
        if wait > 0:
            self._loop.call_later(wait, self._refresh, rep)
        else:
            self._loop.call_soon(self._refresh, rep)

    def _refresh(self, rep: _Replica) -> None:
        from tlt.v1 import common_pb2

        rep.refresh_scheduled = False
        if rep.published is None or not rep.alive or self._stopping or rep.error:
            return
        state = common_pb2.REPLICA_STATE_BUSY if rep.has_work else self._rest_state(rep)
        if state != rep.published[0]:
            return  # a transition is published where it happens, never from here
        if self._key(rep, state) != rep.published:
            self._publish_state(rep, state)

    # ---- colocated trainer: lending the devices ------------------------------------------------

    @property
    def lent_to(self) -> str:
        """Who has borrowed the replicas' devices; "" when nobody has."""
        return self.lease.holder if self.lease is not None else ""

    async def lend(self, holder: str, lease_s: float, timeout_s: float) -> dict:
        """Lend the devices to `holder` for `lease_s` (or renew the lease): idle replicas publish LENT and release
        what their backend can free. Returns once every live replica has released (one still finishing aborted
        sequences releases after them); the lease runs from then. Raises WeightUpdateError when a replica could
        not release."""
        assert self.lease is not None, "start() first"
        t0 = time.perf_counter()
        live = [r for r in self.replicas if r.alive]
        if not self.lease.grant(holder, lease_s):
            # a renewal answers once the devices are released: while the first lend's releases are still going (a
            # caller that timed out and asked again), it waits for them (it answered lent at once, replicas decoding)
            if self._releasing is not None and not self._releasing.done():
                with contextlib.suppress(Exception):  # the first lend reports its own failure (and takes back)
                    await asyncio.wait_for(asyncio.shield(self._releasing), timeout_s)
            return {"replicas": [r.replica_id for r in live], "seconds": time.perf_counter() - t0,
                    "expires_in_s": self.lease.expires_in()}
        log.info("devices_lent", holder=self.lent_to, lease_s=lease_s, replicas=[r.replica_id for r in live])
        for r in live:
            self._maybe_idle(r)
        # Each replica's Lend goes on its pipe now, in this loop turn: sent from tasks, it went one turn later, and a
        # request (or a take-back) handled meanwhile put its Lend(False) ahead of it; the replica then released after
        # the take-back, once its engine was idle, and this call waited all that time (a 30 s deadline passed).
        sent: list[Any] = []
        for r in live:
            try:
                sent.append(self._send(r, lambda cid: Lend(cid, True)))
            except ReplicaUnavailableError as e:
                sent.append(e)

        async def answer(s: Any) -> Reply:
            if isinstance(s, Exception):
                raise s
            return await self._answer(s, timeout_s)

        self._releasing = asyncio.ensure_future(asyncio.gather(*(answer(s) for s in sent), return_exceptions=True))
        try:
            replies = await asyncio.shield(self._releasing)
        finally:  # also when the caller went away: the lease still lapses if it is never renewed
            self.lease.start_clock()
        failed = failures(live, replies)
        if failed:
            self._take_back_now("a replica could not release")
            raise WeightUpdateError("lend failed, devices taken back: " + "; ".join(failed))
        return {"replicas": [r.replica_id for r in live], "seconds": time.perf_counter() - t0,
                "expires_in_s": self.lease.expires_in()}

    async def take_back(self, timeout_s: float) -> dict:
        """End the lend now; returns once every live replica has resumed (nothing to do when nothing was lent)."""
        t0 = time.perf_counter()
        live = [r for r in self.replicas if r.alive]
        if not self.lent_to:
            return {"replicas": [r.replica_id for r in live], "seconds": 0.0, "expires_in_s": 0.0}
        self._taken_back(self.lease.end() if self.lease is not None else "", "given back")
        resumes = [self._resume(r) for r in live]
        # shielded: a replica that answers after the timeout still says IDLE then, not before
        replies = await asyncio.gather(*(asyncio.wait_for(asyncio.shield(f), timeout_s) for f in resumes),
                                       return_exceptions=True)
        failed = failures(live, replies)
        if failed:
            raise WeightUpdateError("taking the devices back failed: " + "; ".join(failed))
        return {"replicas": [r.replica_id for r in live], "seconds": time.perf_counter() - t0, "expires_in_s": 0.0}

    def _take_back_now(self, why: str) -> None:
        """End the lend without waiting: each replica resumes before anything sent to it after this (one pipe), and
        says IDLE once it has (`_resumed`)."""
        self._taken_back(self.lease.end() if self.lease is not None else "", why)
        for r in self.replicas:
            if r.alive:
                self._resume(r)

    def _taken_back(self, holder: str, why: str) -> None:
        """Log the end of `holder`'s lend ("": nothing was lent); each replica's IDLE follows its resume."""
        if holder:
            log.info("devices_taken_back", holder=holder, why=why)

    def _resume(self, rep: _Replica) -> asyncio.Future:
        """Send `rep` its resume now, ahead of anything sent to it after this call; until it answers, it stays LENT
        (SGLang: its KV cache is not back, and a drafter worker seeing IDLE would load onto the device meanwhile).
        Returns the future of its Reply (ReplicaUnavailableError when it dies first)."""
        assert self._loop is not None and self.lease is not None
        cmd_id = next(self._cmd_ids)
        fut = self._loop.create_future()
        self._replies[cmd_id] = (rep, fut)
        self.lease.resuming[rep] = cmd_id
        rep.outbox.put(Lend(cmd_id, False))
        fut.add_done_callback(lambda f: self._resumed(rep, cmd_id, f))
        return fut

    def _resumed(self, rep: _Replica, cmd_id: int, fut: asyncio.Future) -> None:
        """`rep` answered its resume `cmd_id` (or died): IDLE now, unless a later resume is still on its way (lent and
        taken back again meanwhile: the pipe answers them in order)."""
        self._replies.pop(cmd_id, None)
        error = "cancelled" if fut.cancelled() else fut.exception() or fut.result().error
        if error and not isinstance(error, ReplicaUnavailableError):
            log.warning("replica_resume_failed", replica=rep.replica_id, error=str(error)[:500])
        if self.lease is not None and self.lease.resuming.get(rep) == cmd_id:
            del self.lease.resuming[rep]
            self._maybe_idle(rep)

    def _lease_lapsed(self) -> None:
        log.warning("device_lease_lapsed", holder=self.lent_to,
                    detail="the borrower neither renewed nor gave the devices back (crashed?); taking them back")
        self._take_back_now("the lease lapsed")
