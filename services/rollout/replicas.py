"""The front process's view of its engine replicas: start them, spread requests, collect results.

    submit(GenerationRequest) -> least-loaded live replica --AddRequest--> replica process
    replica --StepEvents--> reader thread -> event loop -> the request's queue -> caller

`ReplicaPool` lives on one asyncio event loop (the servers' loop). Each
replica is a `multiprocessing` spawn process with one duplex pipe; a reader
thread per replica turns what arrives into calls on the loop, and a writer
thread per replica sends commands, so a large weight payload or a replica busy
in a long step never blocks the loop.

Load balancing: each request goes to the live replica with the fewest
outstanding sequences (counted here, at submit and finish, so it is exact and
immediate), ties broken round-robin.

Capacity events and lending the devices to a colocated trainer: pool_states.py.

Weight updates (`update_weights`) are all-or-nothing in the sense that
matters: the payload is validated entirely here (checksum, sizes, names,
shapes, dtypes against the replicas' `expected_weights`) before any replica
sees it; then every live replica applies it between two engine steps. A
replica that still fails to apply it (an engine bug) makes the call fail
loudly and is named in the error. A replica that does not answer within the
update timeout might still apply the push later, under versions the pool never
had: it is killed (`_kill`) and counts as one that died meanwhile, so the push
holds if any other replica applied it (the restarted replica gets it replayed)
and fails otherwise (it gets the previous weights). One update at a time.

Replica restarts (`max_restarts` > 0): a replica process that dies (crash,
OOM, kill -9) fails its in-flight requests with ReplicaUnavailableError and
is started again after a back-off (1 s, doubling, at most 30 s). `max_restarts`
bounds a crash loop, not a server's lifetime: a replica that served for
`RESTART_WINDOW_S` before it died starts again from restart 1. A replica
that hangs (a deadlock, a GPU hang) is treated as dead: one with sequences
outstanding that has sent nothing for `stall_timeout_s` is killed (SIGKILL),
its requests fail with ReplicaUnavailableError("... stalled ..."), and it is
restarted like any dead replica. The pool
keeps what the replicas hold from the applied policy and drafter pushes (the latest push, plus the
tensors of earlier ones a partial push did not carry: manifest + payload, in
this process's memory; gRPC GetWeights reads the policy's too); a restarted replica loads the model folder, then
gets those replayed under the update lock, and only when its versions equal
the pool's does it take requests again. Until then it is not routed to.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tlt.services.common.logging import get_logger
from tlt.services.rollout.ipc import (
    Aborted,
    AbortRequest,
    AddRequest,
    ApplyWeights,
    EngineLoad,
    Fatal,
    Lend,
    QueryStats,
    Ready,
    ReplicaInfo,
    ReplicaStats,
    Reply,
    RequestFailed,
    Shutdown,
    StepEvents,
)
from tlt.services.rollout.errors import (
    InvalidRequestError,
    OverloadedError,
    ReplicaUnavailableError,
    WeightUpdateError,
)
from tlt.services.rollout.pool_states import CapacityStates, failures
from tlt.services.rollout.replica import replica_main
from tlt.services.rollout.types import CompletionOutput, GenerationRequest, StepOutput, Versions

log = get_logger("rollout.replicas")

RESTART_WINDOW_S = 600.0  # a replica up this long before it died is not crash-looping: its restart count starts over
EXIT_GRACE_S = 5.0  # a dead replica's process that has not exited this long after is killed before its replacement starts


@dataclass
class _Pending:
    request: GenerationRequest
    replica: "_Replica"
    remaining: int
    want_steps: bool
    events: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass
class ReplicaSnapshot:
    """One replica as the status endpoints show it."""

    replica_id: int
    device: str
    alive: bool
    outstanding: int
    pid: int
    stats: ReplicaStats | None
    error: str = ""


class _Replica:
    def __init__(self, replica_id: int, process: mp.process.BaseProcess, conn: Any) -> None:
        self.replica_id = replica_id
        self.process = process
        self.conn = conn
        self.info: ReplicaInfo | None = None
        self.alive = False
        self.error = ""
        self.outstanding = 0  # sequences handed to it and not yet finished, failed or dropped by it
        self.aborting: dict[int, int] = {}  # abort cmd id -> its sequences, outstanding until the replica answers
        self.load = EngineLoad()  # what its engine reported with its last step or abort
        self.applying = False  # a policy push is being applied (BUSY, see the module docstring)
        self.outbox: queue.Queue = queue.Queue()
        self.ready = asyncio.get_running_loop().create_future()
        self.restarted = False  # a restarted replica serves only once the latest weights are replayed
        self.up_since = 0.0  # time.monotonic() when it began to serve; 0 while it never has
        self.heard = time.monotonic()  # last event from it, or when it was handed work while it had none
        self.published: tuple | None = None  # ReplicaPool._key of its last capacity event
        self.refresh_scheduled = False

    @property
    def has_work(self) -> bool:
        """Sequences outstanding or a policy push being applied: what BUSY means."""
        return self.outstanding > 0 or self.applying


class ReplicaPool(CapacityStates):
    """N engine replica processes behind one async interface."""

    def __init__(self, model_dir: str, backend: str, engine_config: Any, replicas: int, threads_per_replica: int,
                 capacity: Any = None, features_push: str = "", features_max_tokens: int = 4096,
                 spec_config: Any = None, max_restarts: int = 0, pin_cpus: bool = False,
                 spin_wait: bool = False, stall_timeout_s: float = 0.0, max_pending_sequences: int = 0) -> None:
        self.model_dir = model_dir
        self.max_pending_sequences = max_pending_sequences  # 0: no limit (see admit)
        self.stall_timeout_s = stall_timeout_s  # 0: no watchdog
        self._watchdog: asyncio.Task | None = None
        self.pin_cpus = pin_cpus
        self.spin_wait = spin_wait
        self.max_restarts = max_restarts
        self.restarts: dict[int, int] = {}  # replica id -> restarts in a row (see RESTART_WINDOW_S)
        self.restart_window_s = RESTART_WINDOW_S
        self.exit_grace_s = EXIT_GRACE_S
        self._latest: dict[str, tuple[int, bytes, bytes]] = {}  # kind -> (version, manifest, payload) applied
        self._restart_tasks: set[asyncio.Task] = set()
        self._info: ReplicaInfo | None = None
        self.spec_config = spec_config
        self.backend = backend
        self.engine_config = engine_config
        self.num_replicas = replicas
        self.threads_per_replica = threads_per_replica
        self.replicas: list[_Replica] = []
        self._pending: dict[str, _Pending] = {}
        self._replies: dict[int, tuple[_Replica, asyncio.Future]] = {}
        self._cmd_ids = itertools.count(1)
        self._rr = itertools.count()
        self._update_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._refusing = ""  # why new requests are refused (the server is shutting down); "" while serving
        self.versions = Versions()
        self.capacity = capacity  # a common.events.CapacitySink, or None
        self.features_push = features_push
        self.features_max_tokens = features_max_tokens
        self.lease = None  # a lease.DeviceLease, made on the loop in start()

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.lease = self._new_lease()
        for i in range(self.num_replicas):
            self.replicas.append(self._spawn(i))
        try:
            await self._all_ready(timeout_s)
        except BaseException:
            await self.stop()
            raise
        self._info = self.replicas[0].info  # kept: a restarting replica 0 has none for a while
        self.versions = self.replicas[0].info.versions  # type: ignore[union-attr]
        for rep in self.replicas:
            self._maybe_idle(rep)
        if self.stall_timeout_s > 0:
            self._watchdog = asyncio.ensure_future(self._watch_stalls())

    async def _watch_stalls(self) -> None:
        """Kill a live replica that has sequences outstanding and has sent nothing for `stall_timeout_s` (it hangs):
        `_on_dead` fails its requests and restarts it. A policy push being applied is not a stall (it answers once
        done, within `update_timeout_s`); an engine step, however long its prefill, sends its events when done."""
        period = min(5.0, self.stall_timeout_s / 4)
        while not self._stopping:
            await asyncio.sleep(period)
            now = time.monotonic()
            for rep in list(self.replicas):
                silent = now - rep.heard
                if rep.alive and rep.outstanding > 0 and not rep.applying and silent > self.stall_timeout_s:
                    log.error("replica_stalled", replica=rep.replica_id, pid=rep.process.pid,
                              silent_s=round(silent, 1), outstanding=rep.outstanding)
                    self._kill(rep, f"stalled: no progress for {silent:.0f}s with {rep.outstanding} sequences "
                                    "outstanding; killed")

    def _kill(self, rep: _Replica, why: str) -> None:
        """Treat a live replica in an unknown state (hung, or silent on a command it may still carry out) as dead:
        fail its requests and commands at once (`_on_dead`, which restarts it), then SIGKILL its process."""
        self._on_dead(rep, why)
        rep.process.kill()

    async def _all_ready(self, timeout_s: float) -> None:
        """Wait until every replica has loaded its model; raise the first failure, or TimeoutError. Waits without
        cancelling the replicas' `ready` futures when it is cancelled or times out (a gather would, and a replica
        still loading then answers Ready to a cancelled future, and its failure is logged as never retrieved)."""
        readies = [r.ready for r in self.replicas]
        done, waiting = await asyncio.wait(readies, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        errors = [e for e in (f.exception() for f in done) if e is not None]  # each retrieved: none logged
        if errors:
            raise errors[0]
        if waiting:
            slow = [r.replica_id for r in self.replicas if not r.ready.done()]
            raise TimeoutError(f"replicas {slow} did not load the model within {timeout_s}s")

    def _spawn(self, i: int) -> _Replica:
        ctx = mp.get_context("spawn")
        cfg = self.engine_config
        if str(getattr(cfg, "device", "cpu")) == "cuda":  # one GPU per replica; an explicit cuda:k is kept
            cfg = cfg.model_copy(update={"device": f"cuda:{i}"})
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=replica_main,
            args=(i, self.model_dir, self.backend, cfg.model_dump_json(), self.threads_per_replica, child,
                  self.features_push, self.features_max_tokens,
                  "" if self.spec_config is None else self.spec_config.model_dump_json(), self.pin_cpus,
                  self.spin_wait),
            name=f"tlt-rollout-replica-{i}",
            daemon=True,
        )
        proc.start()
        child.close()
        rep = _Replica(i, proc, parent)
        threading.Thread(target=self._reader, args=(rep,), name=f"replica-{i}-reader", daemon=True).start()
        threading.Thread(target=self._writer, args=(rep,), name=f"replica-{i}-writer", daemon=True).start()
        return rep

    async def _restart(self, dead: _Replica, timeout_s: float = 300.0) -> None:
        """Start a replacement for a dead replica, replay the latest pushes, then route to it."""
        i = dead.replica_id
        n = self.restarts.get(i, 0) + 1
        self.restarts[i] = n
        await asyncio.to_thread(dead.process.join, self.exit_grace_s)
        if dead.process.is_alive():  # reported its death (Fatal) but hangs on its way out: it still holds its memory
            log.warning("replica_killed_on_exit", replica=i, pid=dead.process.pid, grace_s=self.exit_grace_s)
            dead.process.kill()
            await asyncio.to_thread(dead.process.join, 10)
        await asyncio.sleep(min(30.0, 2.0 ** (n - 1)))
        if self._stopping:
            return
        rep = self._spawn(i)
        rep.restarted = True
        self.replicas[i] = rep
        log.warning("replica_restarting", replica=i, restart=n, pid=rep.process.pid)
        try:
            await asyncio.wait_for(asyncio.shield(rep.ready), timeout_s)
            async with self._update_lock:
                for kind in ("policy", "drafter"):
                    if kind in self._latest:
                        version, blob, data = self._latest[kind]
                        reply = await self._ask(rep, lambda cid: ApplyWeights(cid, kind, version, blob, data), timeout_s)
                        if reply.error:
                            raise WeightUpdateError(f"replaying {kind} v{version}: {reply.error}")
                versions = (await self._ask(rep, QueryStats, timeout_s)).stats.versions
                want = (self.versions.policy, self.versions.drafter)
                if (versions.policy, versions.drafter) != want:
                    raise WeightUpdateError(f"restarted replica has versions {versions}, the pool serves {want}")
                if self._stopping or rep.error:
                    return
                if self.lent_to:  # a colocated trainer has the devices: the new replica frees its share too
                    await self._ask(rep, lambda cid: Lend(cid, True), timeout_s)
                rep.alive = True
                rep.up_since = time.monotonic()
        except (TimeoutError, WeightUpdateError, ReplicaUnavailableError) as e:
            log.error("replica_restart_failed", replica=i, restart=n, error=str(e)[-1000:])
            if rep.process.is_alive():
                rep.process.kill()
            return  # the reader thread reports the death; _on_dead decides whether to try again
        log.info("replica_resynced", replica=i, restart=n, policy=self.versions.policy, drafter=self.versions.drafter)
        self._maybe_idle(rep)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for t in list(self._restart_tasks):
            t.cancel()
        from tlt.v1 import common_pb2

        for rep in self.replicas:
            self._publish_state(rep, common_pb2.REPLICA_STATE_DRAINING)
        for rep in self.replicas:
            rep.outbox.put(Shutdown())
            rep.outbox.put(None)
        deadline = time.monotonic() + timeout_s
        for rep in self.replicas:
            if not rep.ready.done():  # still loading its model: it reads the Shutdown only once loaded (minutes)
                rep.process.kill()
            await asyncio.to_thread(rep.process.join, max(0.1, deadline - time.monotonic()))
            if rep.process.is_alive():
                rep.process.kill()
                await asyncio.to_thread(rep.process.join, 5)
            rep.alive = False
        self.refuse_requests("the server is shutting down")  # what is still waiting (RolloutServer.stop did it first)
        self._pending.clear()

    def refuse_requests(self, why: str) -> None:
        """Fail every request in flight, and refuse new ones, with ReplicaUnavailableError(why): the first step of a
        shutdown. Left running, they would keep the HTTP and gRPC servers waiting out their grace periods and then
        be cut off (a plain-text 500, an SSE stream with no [DONE]); failed here, each client gets a clear 503 /
        UNAVAILABLE at once, and each request's abort reaches its replica before the Shutdown does."""
        self._refusing = why
        for p in self._pending.values():
            p.events.put_nowait(ReplicaUnavailableError(why))

    @property
    def info(self) -> ReplicaInfo:
        """What every replica agrees on (max length, vocab, expected weights): replica 0's."""
        return self._info if self._info is not None else self.replicas[0].info  # type: ignore[return-value]

    # ---- threads: pipe <-> loop ----------------------------------------------------------

    def _writer(self, rep: _Replica) -> None:
        while (cmd := rep.outbox.get()) is not None:
            try:
                rep.conn.send(cmd)
            except (OSError, BrokenPipeError):
                return

    def _reader(self, rep: _Replica) -> None:
        while True:
            try:
                event = rep.conn.recv()
            except (EOFError, OSError):
                self._to_loop(self._on_dead, rep, "replica process exited")
                return
            if not self._to_loop(self._on_event, rep, event) or isinstance(event, Fatal):
                return

    def _to_loop(self, fn: Any, *args: Any) -> bool:
        """Call `fn(*args)` on the loop; False once the loop is closed: the server stopped, and a replica it killed
        or shut down may still be read from here after that (nobody is left to tell)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    # ---- events (on the loop) ------------------------------------------------------------

    def _on_event(self, rep: _Replica, event: Any) -> None:
        rep.heard = time.monotonic()
        if isinstance(event, StepEvents):
            rep.load = event.load
            for s in event.steps:
                p = self._pending.get(s.request_id)
                if p is not None and p.want_steps:
                    p.events.put_nowait(s)
            for c in event.finished:
                p = self._pending.get(c.request_id)
                if p is None:
                    continue  # aborted here already
                p.events.put_nowait(c)
                p.remaining -= 1
                rep.outstanding -= 1
                if p.remaining == 0:
                    del self._pending[c.request_id]
                self._maybe_idle(rep)
            self._schedule_refresh(rep)  # the engine's running / queued split or KV use may have moved
        elif isinstance(event, Aborted):
            rep.load = event.load
            rep.outstanding -= rep.aborting.pop(event.cmd_id, 0)
            self._maybe_idle(rep)
        elif isinstance(event, RequestFailed):
            p = self._pending.pop(event.request_id, None)
            if p is not None:
                rep.outstanding -= p.remaining
                p.events.put_nowait(InvalidRequestError(event.message))
                self._maybe_idle(rep)
        elif isinstance(event, Reply):
            _, fut = self._replies.pop(event.cmd_id, (None, None))
            if fut is not None and not fut.done():
                fut.set_result(event)
        elif isinstance(event, Ready):
            rep.info = event.info
            rep.alive = not rep.restarted  # a restarted one waits for the replay in _restart
            rep.up_since = time.monotonic() if rep.alive else 0.0
            rep.ready.set_result(event.info)
            log.info("replica_up", replica=rep.replica_id, pid=event.info.pid, device=event.info.device)
        elif isinstance(event, Fatal):
            self._on_dead(rep, event.message)

    def _on_dead(self, rep: _Replica, why: str) -> None:
        if rep.error:
            return
        rep.alive = False
        rep.error = why
        if self._stopping:
            log.info("replica_stopped", replica=rep.replica_id)
        else:
            log.error("replica_dead", replica=rep.replica_id, error=why[-2000:])
        if not rep.ready.done():
            if self._stopping:  # killed while it loaded: nobody waits for it any more
                rep.ready.cancel()
            else:
                rep.ready.set_exception(ReplicaUnavailableError(f"replica {rep.replica_id} failed to start: {why}"))
        for rid, p in list(self._pending.items()):
            if p.replica is rep:
                del self._pending[rid]
                p.events.put_nowait(ReplicaUnavailableError(f"replica {rep.replica_id} died: {why.splitlines()[-1]}"))
        for cmd_id, (owner, fut) in list(self._replies.items()):
            if owner is rep:  # a command the dead replica will never answer
                del self._replies[cmd_id]
                if not fut.done():
                    fut.set_exception(ReplicaUnavailableError(f"replica {rep.replica_id} died"))
        rep.outstanding = 0  # aborts it never answered included: nothing of it is counted any more
        rep.aborting.clear()
        rep.load = EngineLoad()
        rep.outbox.put(None)
        if not self._stopping:
            from tlt.v1 import common_pb2

            self._publish_state(rep, common_pb2.REPLICA_STATE_DRAINING)
            if self.replicas and self.replicas[rep.replica_id] is rep and (rep.info is not None or rep.restarted):
                if rep.up_since and time.monotonic() - rep.up_since >= self.restart_window_s:
                    self.restarts[rep.replica_id] = 0  # it served a good while: a crash days apart is not a loop
                if self.restarts.get(rep.replica_id, 0) < self.max_restarts:
                    task = asyncio.ensure_future(self._restart(rep))
                    self._restart_tasks.add(task)
                    task.add_done_callback(self._restart_tasks.discard)
                else:
                    log.error("replica_not_restarted", replica=rep.replica_id, restarts=self.restarts.get(rep.replica_id, 0),
                              max_restarts=self.max_restarts)

    # ---- requests ------------------------------------------------------------------------

    @property
    def pending_sequences(self) -> int:
        """Sequences handed to the replicas and not yet finished, failed or dropped: running or waiting."""
        return sum(r.outstanding for r in self.replicas)

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

    def _pick(self) -> _Replica:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise ReplicaUnavailableError("no live engine replica")
        turn = next(self._rr)
        return min(live, key=lambda r: (r.outstanding, (r.replica_id - turn) % len(self.replicas)))

    async def generate(
        self, request: GenerationRequest, want_steps: bool = False
    ) -> AsyncIterator[StepOutput | CompletionOutput]:
        """Yield the request's StepOutputs (when asked) and its n CompletionOutputs as they come.

        Raises InvalidRequestError if the engine refuses it, ReplicaUnavailableError if its
        replica dies. Closing the iterator early (client gone) aborts the request.
        """
        if self._refusing:
            raise ReplicaUnavailableError(self._refusing)
        if request.request_id in self._pending:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        rep = self._pick()
        p = _Pending(request, rep, request.n, want_steps)
        self._pending[request.request_id] = p
        if rep.outstanding == 0:  # the stall clock starts now, not at its last event before an idle spell
            rep.heard = time.monotonic()
        rep.outstanding += request.n
        if self.lent_to:  # counted in first: this replica goes from LENT straight to BUSY, never IDLE between
            self._take_back_now("a request arrived")
        self._busy(rep)  # counted first: BUSY carries the sequences that made it busy
        rep.outbox.put(AddRequest(request))
        finished = 0
        try:
            while finished < request.n:
                ev = await p.events.get()
                if isinstance(ev, Exception):
                    raise ev
                if isinstance(ev, CompletionOutput):
                    finished += 1
                yield ev
        finally:
            if self._pending.get(request.request_id) is p:
                del self._pending[request.request_id]
                self._abort(rep, request.request_id, p.remaining)

    def _abort(self, rep: _Replica, request_id: str, sequences: int) -> None:
        """Ask `rep` to drop a request the client gave up on. Its `sequences` stay outstanding (BUSY) until the
        replica answers that its engine dropped them (`Aborted`), or it dies; the caller does not wait."""
        cmd_id = next(self._cmd_ids)
        rep.aborting[cmd_id] = sequences
        rep.outbox.put(AbortRequest(request_id, cmd_id))

    # ---- control -------------------------------------------------------------------------

    async def _ask(self, rep: _Replica, make: Any, timeout_s: float) -> Reply:
        if rep.error:  # dead: _on_dead already failed its commands, and nothing would ever answer this one
            raise ReplicaUnavailableError(f"replica {rep.replica_id} died: {rep.error.splitlines()[-1]}")
        cmd_id = next(self._cmd_ids)
        fut = self._loop.create_future()  # type: ignore[union-attr]
        self._replies[cmd_id] = (rep, fut)
        rep.outbox.put(make(cmd_id))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(cmd_id, None)

    async def snapshot(self, timeout_s: float = 5.0) -> list[ReplicaSnapshot]:
        async def one(rep: _Replica) -> ReplicaSnapshot:
            stats, error = None, rep.error
            if rep.alive:
                try:
                    stats = (await self._ask(rep, QueryStats, timeout_s)).stats
                except TimeoutError:
                    error = f"no stats answer within {timeout_s}s"
                except ReplicaUnavailableError as e:
                    error = str(e)
            pid = rep.info.pid if rep.info else (rep.process.pid or 0)
            device = rep.info.device if rep.info else ""
            return ReplicaSnapshot(rep.replica_id, device, rep.alive, rep.outstanding, pid, stats, error)

        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    def latest_push(self, kind: str) -> tuple[int, bytes, bytes] | None:
        """The latest applied push of `kind` as (version, serialized manifest, payload); None when none was."""
        return self._latest.get(kind)

    async def update_weights(self, kind: str, manifest: Any, payload: bytes | bytearray, timeout_s: float) -> dict:
        """Validate then apply a push on every live replica. Returns versions and timings; raises WeightUpdateError."""
        import torch

        from tlt.services.common.weights import WeightValidationError, validate

        async with self._update_lock:
            current = self.versions.policy if kind == "policy" else self.versions.drafter
            if manifest.version <= current:
                raise WeightUpdateError(f"{kind} version {manifest.version} is not newer than the serving {current}")
            expected = None
            if kind == "policy":
                known = self.info.expected_weights
                unknown = sorted(s.name for s in manifest.tensors if s.name not in known)
                if unknown:
                    raise WeightUpdateError(f"unknown policy tensors (not in the model): {unknown[:10]}")
                expected = {s.name: (known[s.name][0], getattr(torch, known[s.name][1])) for s in manifest.tensors}
            try:
                await asyncio.to_thread(validate, manifest, payload, expected)
            except WeightValidationError as e:
                raise WeightUpdateError(str(e)) from None
            live = [r for r in self.replicas if r.alive]
            if not live:
                raise ReplicaUnavailableError("no live engine replica")
            blob, data = manifest.SerializeToString(), await asyncio.to_thread(bytes, payload)  # GBs: off the loop
            busy = live if kind == "policy" else []
            for r in busy:
                r.applying = True
            if busy and self.lent_to:  # the replicas copy the weights in on their devices (LENT -> BUSY)
                self._take_back_now("a policy push arrived")
            for r in busy:
                self._busy(r)
            try:
                return await self._apply_on(live, kind, manifest.version, blob, data, timeout_s)
            finally:  # IDLE again after the pool's versions moved on (the event carries them)
                for r in busy:
                    r.applying = False
                    self._maybe_idle(r)

    @staticmethod
    def _held_after(prev: tuple[int, bytes, bytes] | None, version: int, blob: bytes, data: bytes
                    ) -> tuple[int, bytes, bytes]:
        if prev is None:
            return version, blob, data
        from tlt.services.common.weights import merge
        from tlt.v1 import rollout_pb2

        parse = rollout_pb2.WeightManifest.FromString
        manifest, payload = merge(parse(prev[1]), prev[2], parse(blob), data)
        return version, manifest.SerializeToString(), payload

    async def _apply_on(self, live: list[_Replica], kind: str, version: int, blob: bytes, data: bytes,
                        timeout_s: float) -> dict:
        """Send the validated push to every live replica; the caller holds the update lock."""
        t0 = time.perf_counter()
        replies = await asyncio.gather(
            *(self._ask(r, lambda cid: ApplyWeights(cid, kind, version, blob, data), timeout_s) for r in live),
            return_exceptions=True,
        )
        for r, x in zip(live, replies):
            if isinstance(x, TimeoutError):  # it may still apply the push later, under versions the pool never had
                self._kill(r, f"no answer to the {kind} v{version} push within {timeout_s:g}s (update_timeout_s); "
                              "killed (a restart gets the weights the pool serves)")
        replies = [ReplicaUnavailableError(r.error) if isinstance(x, TimeoutError) else x for r, x in zip(live, replies)]
        failed = failures(live, replies)
        applied = [r.replica_id for r, x in zip(live, replies) if isinstance(x, Reply) and not x.error]
        if failed:
            if applied:
                log.error("weight_update_partial", kind=kind, applied=applied, failed=failed)
                raise WeightUpdateError(
                    f"update applied on replicas {applied} but FAILED on: {'; '.join(failed)} "
                    "(replicas now serve different weights; push again)"
                )
            raise WeightUpdateError("; ".join(failed))
        if not applied:
            why = "; ".join(f"replica {r.replica_id}: {r.error.splitlines()[-1]}" for r in live if r.error)
            raise ReplicaUnavailableError(f"no replica applied the push, each died meanwhile: {why}")
        # Replayed to a restarted replica (and served by GetWeights): what the replicas now hold, i.e. this push
        # plus the tensors of earlier pushes it did not carry (a partial push leaves those as they were).
        held = await asyncio.to_thread(self._held_after, self._latest.get(kind), version, blob, data)
        self._latest[kind] = held  # set together with the versions (GetWeights reads both at once)
        self.versions = next(x.versions for x in replies if isinstance(x, Reply))  # type: ignore[union-attr]
        for r in self.replicas:  # the capacity events carry the versions: a busy or idle replica's follow
            self._schedule_refresh(r)
        log.info("weights_updated", kind=kind, version=version, replicas=applied)
        return {"versions": self.versions, "seconds": time.perf_counter() - t0, "replicas": applied}
