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

Re-dispatch (`redispatch_limit` > 0): when a replica dies (its process exits, or the stall watchdog or an
update timeout kills it), each request it held goes on elsewhere instead of failing: the samples of it that had
not finished (none of their completions went to the caller yet) are re-issued, under the request's id, to the
least-loaded live replica, or, with none alive, to the restarted one once it serves again. Each keeps its sample
index (`GenerationRequest.sample_indices`), so its per-sample seed (`engine/sequence.py: seed_for(seed, i)`): a
seeded request gives the same completions whether or not a replica died, and the caller gets each index once.
What comes late from the dead replica is dropped (only the replica a request is on now counts). A request
fails with ReplicaUnavailableError as before when it was re-dispatched `redispatch_limit` times already, when
no replica is alive and none is restarting, when its stream already sent tokens (`want_steps`: those cannot be
taken back) and when its backend cannot run a subset of a request's samples and some had finished. A request
that arrives while every replica is restarting waits the same way for the first to serve (it was a 503).

Generated tokens (`generated_tokens`, /metrics' rollout_generated_tokens_total) are counted here, once, from
every engine step (each StepEvents carries every running sample's new tokens, whether or not its caller asked
for steps): a request whose caller went away counts what its unfinished samples had generated until its abort
reached the engine, and a re-dispatched sample's tokens count again as it regenerates them (the engine did that
work twice). What a replica the pool counts dead still sends is not counted.

Replica processes (spawn, death, restart, the stall watchdog): replica_lifecycle.py.
Admission control (`admit`, `max_pending_sequences`): admission.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from tlt.services.common.logging import get_logger
from tlt.services.rollout.admission import Admission
from tlt.services.rollout.errors import (
    InvalidRequestError,
    ReplicaUnavailableError,
    WeightUpdateError,
)
from tlt.services.rollout.ipc import (
    Aborted,
    AbortRequest,
    AddRequest,
    ApplyWeights,
    Fatal,
    QueryStats,
    Ready,
    ReplicaInfo,
    ReplicaStats,
    Reply,
    RequestFailed,
    StepEvents,
)
from tlt.services.rollout.pool_states import CapacityStates, failures
from tlt.services.rollout.replica_lifecycle import EXIT_GRACE_S, RESTART_WINDOW_S, ReplicaLifecycle, _Replica
from tlt.services.rollout.types import CompletionOutput, GenerationRequest, StepOutput, Versions

log = get_logger("rollout.replicas")


@dataclass
class _Pending:
    request: GenerationRequest
    replica: "_Replica | None"  # None: its replica died and it waits for one to serve again (`_settle_parked`)
    remaining: int
    want_steps: bool
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set[int] = field(default_factory=set)  # sample indices whose completion went to the caller
    stepped: bool = False  # a StepOutput went to the caller: its tokens of unfinished samples cannot be taken back
    redispatches: int = 0
    lost: str = ""  # why its last replica was lost ("replica 1 died: ..."); the error if it cannot go on
    lost_from: int = -1  # that replica's id


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


class ReplicaPool(Admission, ReplicaLifecycle, CapacityStates):
    """N engine replica processes behind one async interface."""

    def __init__(self, model_dir: str, backend: str, engine_config: Any, replicas: int, threads_per_replica: int,
                 capacity: Any = None, features_push: str = "", features_max_tokens: int = 4096,
                 spec_config: Any = None, max_restarts: int = 0, pin_cpus: bool = False,
                 spin_wait: bool = False, stall_timeout_s: float = 0.0, max_pending_sequences: int = 0,
                 redispatch_limit: int = 0, gc_freeze: bool = False, features_token: str = "") -> None:
        self.model_dir = model_dir
        self.redispatch_limit = redispatch_limit  # 0: a dead replica's requests fail (see the module docstring)
        self.redispatches = 0  # requests re-dispatched since start, each time counted
        self.generated_tokens = 0  # tokens the engines generated since start (`_on_event`): /metrics' counter
        self.prompt_tokens = 0  # prompt tokens of the requests submitted, each once whatever n (`generate`): likewise
        self.max_pending_sequences = max_pending_sequences  # 0: no limit (see admit)
        self.stall_timeout_s = stall_timeout_s  # 0: no watchdog
        self._watchdog: asyncio.Task | None = None
        self.pin_cpus = pin_cpus
        self.spin_wait = spin_wait
        self.gc_freeze = gc_freeze  # each replica freezes its heap once it is up (services/common/gc_heap.py)
        self.max_restarts = max_restarts
        self.restarts: dict[int, int] = {}  # replica id -> restarts in a row (see RESTART_WINDOW_S)
        self.deaths: dict[int, int] = {}  # replica id -> times its process died or was killed since start
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
        self._reserved: dict[str, tuple[int, float]] = {}  # admitted, not in the pool yet (admission.py)
        self._replies: dict[int, tuple[_Replica, asyncio.Future]] = {}
        self._cmd_ids = itertools.count(1)
        self._rr = itertools.count()
        self._update_lock = asyncio.Lock()
        self._pushes: set[asyncio.Task] = set()  # running pushes (kept: a cancelled caller does not end them)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._refusing = ""  # why new requests are refused (the server is shutting down); "" while serving
        self.versions = Versions()
        self.capacity = capacity  # a common.events.CapacitySink, or None
        self.features_push = features_push
        self.features_token = features_token  # the control token the features PUSH is secured with (zmq_auth.py)
        self.features_max_tokens = features_max_tokens
        self.lease = None  # a lease.DeviceLease, made on the loop in start()

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
            if not rep.error:  # a replica counted dead (killed) may still send steps: dropped, as below
                self.generated_tokens += sum(len(s.new_token_ids) for s in event.steps)
            for s in event.steps:
                p = self._pending.get(s.request_id)
                if p is not None and p.replica is rep and p.want_steps:
                    p.stepped = True
                    p.events.put_nowait(s)
            for c in event.finished:
                p = self._pending.get(c.request_id)
                if p is None or p.replica is not rep:
                    continue  # aborted here already, or sent by a replica the pool counts dead (re-dispatched)
                p.finished.add(c.sample_index)
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
            p = self._pending.get(event.request_id)
            if p is not None and p.replica is rep:
                del self._pending[event.request_id]
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
            self._on_dead(rep, event.message, event.checkpoint)

    # ---- requests ------------------------------------------------------------------------

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

        Raises InvalidRequestError if the engine refuses it, ReplicaUnavailableError if its replica dies and
        it cannot be re-dispatched (`_cannot_redispatch`). Closing the iterator early (client gone) aborts the
        request on the replica it is on then.
        """
        self.take_reservation(request.request_id)  # counted in the pool from here (or refused: not at all)
        if self._refusing:
            raise ReplicaUnavailableError(self._refusing)
        if request.request_id in self._pending:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        live = any(r.alive for r in self.replicas)
        if not live and not self._restart_coming():
            raise ReplicaUnavailableError("no live engine replica")
        total = len(request.samples)
        p = _Pending(request, None, total, want_steps)
        self._pending[request.request_id] = p
        self.prompt_tokens += len(request.prompt_token_ids)  # once, whatever n (OpenAI's usage.prompt_tokens)
        if live:
            self._hand(p, self._pick(), request)
        else:  # every replica is restarting: it waits for the first to serve (`_settle_parked`), as a re-dispatched
            p.lost = "no live engine replica"  # request does, rather than a 503 the SDK's retries gave up on in 1 s
        finished = 0
        try:
            while finished < total:
                ev = await p.events.get()
                if isinstance(ev, Exception):
                    raise ev
                if isinstance(ev, CompletionOutput):
                    finished += 1
                yield ev
        finally:
            if self._pending.get(request.request_id) is p:
                del self._pending[request.request_id]
                if p.replica is not None:  # where it is now: it may have been re-dispatched since
                    self._abort(p.replica, request.request_id, p.remaining)

    def _hand(self, p: _Pending, rep: _Replica, request: GenerationRequest) -> None:
        """Send `request` (all of `p`, or its unfinished samples) to `rep`, its `p.remaining` sequences counted in."""
        p.replica = rep
        if rep.outstanding == 0:  # the stall clock starts now, not at its last event before an idle spell
            rep.heard = time.monotonic()
        rep.outstanding += p.remaining
        if self.lent_to:  # counted in first: this replica goes from LENT straight to BUSY, never IDLE between
            self._take_back_now("a request arrived")
        self._busy(rep)  # counted first: BUSY carries the sequences that made it busy
        rep.outbox.put(AddRequest(request))

    # ---- re-dispatch (see the module docstring) -------------------------------------------

    def _rehome(self, dead: _Replica, why: str) -> None:
        """The requests `dead` held (it died; its counts are dropped): re-dispatch each that may go on, else fail
        it with ReplicaUnavailableError. Called by `_on_dead` once it decided whether `dead` restarts."""
        lost = f"replica {dead.replica_id} died: {why.splitlines()[-1]}"
        for rid, p in list(self._pending.items()):
            if p.replica is not dead:
                continue
            p.replica, p.lost, p.lost_from = None, lost, dead.replica_id
            refusal = self._cannot_redispatch(p)
            if refusal is not None:
                del self._pending[rid]
                p.events.put_nowait(ReplicaUnavailableError(lost + refusal))
        self._settle_parked()

    def _cannot_redispatch(self, p: _Pending) -> str | None:
        """Why `p` must fail rather than go on (appended to its error); None when it may be re-dispatched."""
        if self._stopping or self._refusing or not self.redispatch_limit:
            return ""
        if p.redispatches >= self.redispatch_limit:
            times = f"{p.redispatches} time{'s' if p.redispatches != 1 else ''}"
            return f" (the request was re-dispatched {times} already, redispatch_limit={self.redispatch_limit})"
        if p.want_steps and p.stepped:
            return " (its stream already sent tokens of samples that had not finished: not re-dispatched)"
        if p.finished and not self.info.runs_sample_subsets:
            return f" (the {self.backend!r} backend cannot re-issue the unfinished samples of a request alone)"
        return None

    def _settle_parked(self) -> None:
        """Re-dispatch the requests waiting for a replica when one serves; fail them when none is alive and none is
        restarting (a restart that fails settles them again, `_restart`)."""
        parked = [(rid, p) for rid, p in self._pending.items() if p.replica is None]
        if not parked or self._stopping or self._refusing:  # refuse_requests failed them all
            return
        if any(r.alive for r in self.replicas):
            for _, p in parked:
                self._redispatch(p)
        elif not self._restart_coming():
            for rid, p in parked:
                del self._pending[rid]
                p.events.put_nowait(ReplicaUnavailableError(p.lost + " (no replica alive, none restarting)"))

    def _restart_coming(self) -> bool:
        current = asyncio.current_task()
        return any(not t.done() for t in self._restart_tasks if t is not current)

    def _redispatch(self, p: _Pending) -> None:
        """Re-issue the samples of `p` that have not finished to the least-loaded live replica, each with its index."""
        rep = self._pick()
        if p.lost_from < 0:  # a request that arrived while every replica restarted: its first dispatch
            log.info("request_dispatched_after_restart", request_id=p.request.request_id, to_replica=rep.replica_id)
            self._hand(p, rep, p.request)
            return
        left = tuple(i for i in p.request.samples if i not in p.finished)
        request = replace(p.request, sample_indices=left) if p.finished else p.request
        p.redispatches += 1
        self.redispatches += 1
        log.warning("request_redispatched", request_id=p.request.request_id, from_replica=p.lost_from,
                    to_replica=rep.replica_id, sequences=len(left), sample_indices=list(left),
                    redispatch=p.redispatches, why=p.lost)
        self._hand(p, rep, request)

    def _abort(self, rep: _Replica, request_id: str, sequences: int) -> None:
        """Ask `rep` to drop a request the client gave up on. Its `sequences` stay outstanding (BUSY) until the
        replica answers that its engine dropped them (`Aborted`), or it dies; the caller does not wait."""
        cmd_id = next(self._cmd_ids)
        rep.aborting[cmd_id] = sequences
        rep.outbox.put(AbortRequest(request_id, cmd_id))

    # ---- control -------------------------------------------------------------------------

    async def _ask(self, rep: _Replica, make: Any, timeout_s: float) -> Reply:
        return await self._answer(self._send(rep, make), timeout_s)

    def _send(self, rep: _Replica, make: Any) -> tuple[int, asyncio.Future]:
        """Put a command on `rep`'s pipe now (ahead of anything sent after this call returns); (its id, the future
        of its Reply). ReplicaUnavailableError for a dead replica."""
        if rep.error:  # dead: _on_dead already failed its commands, and nothing would ever answer this one
            raise ReplicaUnavailableError(f"replica {rep.replica_id} died: {rep.error.splitlines()[-1]}")
        cmd_id = next(self._cmd_ids)
        fut = self._loop.create_future()  # type: ignore[union-attr]
        self._replies[cmd_id] = (rep, fut)
        rep.outbox.put(make(cmd_id))
        return cmd_id, fut

    async def _answer(self, sent: tuple[int, asyncio.Future], timeout_s: float) -> Reply:
        cmd_id, fut = sent
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
        """Validate then apply a push on every live replica. Returns versions and timings; raises WeightUpdateError.

        A push sent to the replicas runs to its end even when the caller is cancelled (its RPC's deadline passed, or
        the trainer was killed): they apply it, so the pool must record it, or it would report and replay the old
        weights (and versions) while the replicas serve and stamp the new ones. One whose caller went away before
        that (waiting for an earlier push, or being validated) is dropped: nobody waits for it, and a retry of it
        would be refused as not newer.
        """
        abandoned = asyncio.Event()
        task = asyncio.ensure_future(self._update_weights(kind, manifest, payload, timeout_s, abandoned))
        self._pushes.add(task)
        task.add_done_callback(self._push_done)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            abandoned.set()
            raise

    def _push_done(self, task: asyncio.Task) -> None:
        self._pushes.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved: no "never retrieved" noise
            log.debug("weight_update_ended_with", error=str(task.exception()))

    async def _update_weights(self, kind: str, manifest: Any, payload: bytes | bytearray, timeout_s: float,
                              abandoned: asyncio.Event) -> dict:
        import torch

        from tlt.model.loader import EMBEDDING, TIED_HEAD
        from tlt.services.common.weights import WeightValidationError, validate

        async with self._update_lock:
            current = self.versions.policy if kind == "policy" else self.versions.drafter
            if manifest.version <= current:
                raise WeightUpdateError(f"{kind} version {manifest.version} is not newer than the serving {current}")
            expected, tied = None, False
            if kind == "policy":
                known = self.info.expected_weights
                tied = _carries_a_tied_head(known, manifest)
                if tied:  # the embedding under its other name: its shape and dtype, then equal (_drop_tied_head)
                    known = {**known, TIED_HEAD: known[EMBEDDING]}
                unknown = sorted(s.name for s in manifest.tensors if s.name not in known)
                if unknown:
                    raise WeightUpdateError(f"unknown policy tensors (not in the model): {unknown[:10]}")
                odd = sorted({known[s.name][1] for s in manifest.tensors if not hasattr(torch, known[s.name][1])})
                if odd:  # a checkpoint dtype torch has no name for: say so (an AttributeError answered UNKNOWN)
                    raise WeightUpdateError(f"the model's checkpoint stores dtype(s) {odd}, which pushes cannot match")
                expected = {s.name: (known[s.name][0], getattr(torch, known[s.name][1])) for s in manifest.tensors}
            try:
                await asyncio.to_thread(validate, manifest, payload, expected)
            except WeightValidationError as e:
                raise WeightUpdateError(str(e)) from None
            if tied:
                manifest = await asyncio.to_thread(_drop_tied_head, manifest, payload)
            live = [r for r in self.replicas if r.alive]
            if not live:
                raise ReplicaUnavailableError("no live engine replica")
            blob, data = manifest.SerializeToString(), await asyncio.to_thread(bytes, payload)  # GBs: off the loop
            if abandoned.is_set():  # the last moment it can be dropped: from here the replicas apply it
                raise WeightUpdateError(f"{kind} v{manifest.version}: the caller went away before it was applied")
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


def _carries_a_tied_head(known: dict[str, tuple[tuple[int, ...], str]], manifest: Any) -> bool:
    """Whether a policy push carries lm_head.weight for a model that has no head of its own (tie_word_embeddings):
    HF's state_dict() of a tied model does (the embedding's storage under its other name), so pushing it, as the
    client's docstring shows, was refused as a tensor "not in the model"."""
    from tlt.model.loader import EMBEDDING, TIED_HEAD

    return TIED_HEAD not in known and EMBEDDING in known and any(s.name == TIED_HEAD for s in manifest.tensors)


def _drop_tied_head(manifest: Any, payload: bytes | bytearray) -> Any:
    """The validated push's manifest without its tied lm_head.weight, which must equal the embedding it carries
    too (WeightUpdateError otherwise, as `loader.check_tied_head` says for the engine): the replicas serve that
    embedding as the head, and no record of the push (the replay to a restarted replica, GetWeights) keeps a head
    that a later embedding-only push would leave stale. The payload stays as it is, the head's bytes unreferenced
    (valid: `validate` asks for no coverage), so a GB-sized push is not copied."""
    import torch

    from tlt.model.loader import EMBEDDING, TIED_HEAD, CheckpointError, check_tied_head

    specs = {s.name: s for s in manifest.tensors}
    view = memoryview(payload)  # no copy of the push; frombuffer wants a writable buffer, so tensors only of slices
    pair = {n: torch.frombuffer(bytearray(view[s.offset : s.offset + s.nbytes]), dtype=torch.uint8)
            for n, s in specs.items() if n in (TIED_HEAD, EMBEDDING)}
    try:  # bytes against bytes: "equal" is bit for bit (same dtype and shape: validated)
        check_tied_head(pair)
    except CheckpointError as e:
        raise WeightUpdateError(str(e)) from None
    kept = type(manifest)()
    kept.CopyFrom(manifest)
    del kept.tensors[[s.name for s in kept.tensors].index(TIED_HEAD)]
    return kept
