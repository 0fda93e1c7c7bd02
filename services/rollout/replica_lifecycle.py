"""A replica's life, seen from the front process: spawn, wait until it loaded, watch it, and restart it when it dies.

    _spawn -> Ready -> serving -> (Fatal | pipe closed | stalled | killed) -> _on_dead -> _restart -> Ready ...

Each replica is a `multiprocessing` process (`replica.replica_main`; spawned, or forked from a forkserver that
imported torch once: replica_start.py) with one duplex pipe, and
`_Replica` is the front process's handle on it: the process, its pipe and the pool's bookkeeping of it.

Replica restarts (`max_restarts` > 0): a replica process that dies (crash,
OOM, kill -9) hands its in-flight requests back to the pool, which re-dispatches
their unfinished samples (`redispatch_limit`, replicas.py: `_rehome`) or fails
them with ReplicaUnavailableError, and is started again after a back-off (1 s,
doubling, at most 30 s); requests that wait for it (no other replica alive) go to
it once it serves, or fail when its restart fails. `max_restarts`
bounds a crash loop, not a server's lifetime: a replica that served for
`RESTART_WINDOW_S` before it died starts again from restart 1. A replica
that hangs (a deadlock, a GPU hang) is treated as dead: one with sequences
outstanding that has sent nothing for `stall_timeout_s` is killed (SIGKILL),
its requests are handed back like a dead one's (those that cannot go on fail
with ReplicaUnavailableError("... stalled ...")), and it is
restarted like any dead replica. A dead replica's process that has not exited
`EXIT_GRACE_S` after is killed before its replacement starts (it still holds
its memory).

The pool keeps what the replicas hold from the applied policy and drafter
pushes (the latest push, plus the tensors of earlier ones a partial push did
not carry: manifest + payload, in this process's memory; gRPC GetWeights reads
the policy's too); a restarted replica loads the model folder, then gets those
replayed under the update lock, and only when its versions equal the pool's
does it take requests again. Until then it is not routed to.

`ReplicaLifecycle` is a mixin of `ReplicaPool` (replicas.py): it reads and writes the pool's replicas,
pending requests and pushes, and uses its pipe threads (`_reader`, `_writer`) and `_ask`.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from tlt.services.common.logging import get_logger
from tlt.services.rollout.errors import ReplicaUnavailableError, WeightUpdateError
from tlt.services.rollout.ipc import ApplyWeights, EngineLoad, Lend, QueryStats, ReplicaInfo, Reply, Shutdown
from tlt.services.rollout.replica import replica_main
from tlt.services.rollout.replica_start import environ, replica_context, warm
from tlt.services.rollout.types import Versions

log = get_logger("rollout.replicas")

RESTART_WINDOW_S = 600.0  # a replica up this long before it died is not crash-looping: its restart count starts over
EXIT_GRACE_S = 5.0  # a dead replica's process that has not exited this long after is killed before its replacement starts


class _Replica:
    """The front process's handle on one replica process, and the pool's bookkeeping of it."""

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
        self.applying = False  # a policy push is being applied (BUSY, see pool_states.py)
        self.outbox: queue.Queue = queue.Queue()
        self.ready = asyncio.get_running_loop().create_future()
        self.restarted = False  # a restarted replica serves only once the latest weights are replayed
        self.up_since = 0.0  # time.monotonic() when it began to serve; 0 while it never has
        self.heard = time.monotonic()  # last event from it, or when it was handed work while it had none
        self.published: tuple | None = None  # ReplicaPool._key of its last capacity event
        self.refresh_scheduled = False
        self.published_at = 0.0  # time.monotonic() of its last capacity event (pool_states.REFRESH_MIN_S)

    @property
    def has_work(self) -> bool:
        """Sequences outstanding or a policy push being applied: what BUSY means."""
        return self.outstanding > 0 or self.applying


class ReplicaLifecycle:
    """Start, stop, watch and restart the pool's replica processes (the pool's attributes it uses, below)."""

    model_dir: str
    backend: str
    engine_config: Any
    spec_config: Any
    num_replicas: int
    threads_per_replica: int
    features_push: str
    features_token: str
    features_max_tokens: int
    pin_cpus: bool
    spin_wait: bool
    gc_freeze: bool
    max_restarts: int
    restarts: dict[int, int]
    deaths: dict[int, int]
    restart_window_s: float
    exit_grace_s: float
    stall_timeout_s: float
    replicas: list[_Replica]
    versions: Versions
    _info: ReplicaInfo | None
    _latest: dict[str, tuple[int, bytes, bytes]]
    _pending: dict[str, Any]
    _replies: dict[int, tuple[_Replica, asyncio.Future]]
    _restart_tasks: set[asyncio.Task]
    _watchdog: asyncio.Task | None
    _update_lock: asyncio.Lock
    _loop: asyncio.AbstractEventLoop | None
    _stopping: bool

    if TYPE_CHECKING:  # ReplicaPool's and CapacityStates' (not defined here: the mixin must not shadow them)
        lent_to: Any

        async def _ask(self, rep: _Replica, make: Any, timeout_s: float) -> Reply: ...
        def _reader(self, rep: _Replica) -> None: ...
        def _writer(self, rep: _Replica) -> None: ...
        def refuse_requests(self, why: str) -> None: ...
        def _new_lease(self) -> Any: ...
        def _maybe_idle(self, rep: _Replica) -> None: ...
        def _resume(self, rep: _Replica) -> asyncio.Future: ...
        def _publish_state(self, rep: _Replica, state: int) -> None: ...
        def _rehome(self, dead: _Replica, why: str) -> None: ...
        def _settle_parked(self) -> None: ...

    async def start(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.lease = self._new_lease()
        await asyncio.to_thread(warm, self._context()[0])  # the forkserver's first start imports torch: off the loop
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
        `_on_dead` re-dispatches or fails its requests and restarts it. A policy push being applied is not a stall
        (it answers once done, within `update_timeout_s`); an engine step sends its events when done, and steps that
        emit nothing (the chunks of a long prefill) send empty ones at least every `replica.PROGRESS_EVERY_S`."""
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
        re-dispatch or fail its requests and fail its commands at once (`_on_dead`, which restarts it; what it sends
        until the kill lands is dropped), then SIGKILL its process."""
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
        cfg = self.engine_config
        if str(getattr(cfg, "device", "cpu")) == "cuda":  # one GPU per replica; an explicit cuda:k is kept
            cfg = cfg.model_copy(update={"device": f"cuda:{i}"})
        # a fork of a forkserver that imported torch once, where that is the process a spawn would give
        ctx, preloaded = self._context()
        parent, proc = self._start_process(ctx, preloaded, i, cfg)
        if proc is None:  # the forkserver failed to fork it (it died, or could not start): spawned, as before
            log.warning("replica_spawned", replica=i, reason="the forkserver failed to start it")
            parent, proc = self._start_process(mp.get_context("spawn"), False, i, cfg)
        rep = _Replica(i, proc, parent)
        threading.Thread(target=self._reader, args=(rep,), name=f"replica-{i}-reader", daemon=True).start()
        threading.Thread(target=self._writer, args=(rep,), name=f"replica-{i}-writer", daemon=True).start()
        return rep

    def _context(self) -> tuple[Any, bool]:
        """The multiprocessing context for this pool's replicas, and whether it is the preloaded forkserver."""
        return replica_context(self.backend, str(getattr(self.engine_config, "device", "cpu")),
                               self.threads_per_replica, self.spin_wait)

    def _start_process(self, ctx: Any, preloaded: bool, i: int, cfg: Any) -> tuple[Any, Any]:
        """(the front's end of the pipe, the started replica process), or (None, None) when the forkserver could
        not fork it."""
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=replica_main,
            args=(i, self.model_dir, self.backend, cfg.model_dump_json(), self.threads_per_replica, child,
                  self.features_push, self.features_max_tokens,
                  "" if self.spec_config is None else self.spec_config.model_dump_json(), self.pin_cpus,
                  self.spin_wait and not preloaded,  # preloaded: spin_wait was off or one thread (no spin count to set)
                  environ() if preloaded else None, self.gc_freeze,
                  self.capacity is not None),  # capacity events carry the start drafter's identity: hash it then
            kwargs={"features_token": self.features_token},  # pickled over the pipe, never on a command line
            name=f"tlt-rollout-replica-{i}",
            daemon=True,
        )
        try:
            proc.start()
        except (OSError, EOFError):  # the forkserver died while starting it (a spawn's failure is the caller's)
            if not preloaded:
                raise
            parent.close()
            return None, None
        finally:
            child.close()
        return parent, proc

    async def _restart(self, dead: _Replica, timeout_s: float = 300.0) -> None:
        """Start a replacement for a dead replica, replay the latest pushes, then route to it; the requests waiting
        for a replica go to it then, or fail when it did not come up and no other restart is under way."""
        try:
            await self._restart_once(dead, timeout_s)
        finally:
            self._settle_parked()

    async def _restart_once(self, dead: _Replica, timeout_s: float) -> None:
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
        await asyncio.to_thread(warm, self._context()[0])  # a forkserver that died starts again off the loop
        if self._stopping:  # stopped during the warm-up (seconds, for a forkserver importing torch): spawn nothing
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
                    if not self.lent_to:  # taken back (or lapsed) meanwhile: that reached only the live replicas,
                        self._resume(rep)  # so this one resumes before any request sent after it, LENT until then
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
            # still loading its model: it reads the Shutdown only once loaded (minutes). is_alive first: a forked
            # replica is reaped by the forkserver, and its pid may be another process's once its status is read
            if not rep.ready.done() and rep.process.is_alive():
                rep.process.kill()
            await asyncio.to_thread(rep.process.join, max(0.1, deadline - time.monotonic()))
            if rep.process.is_alive():
                rep.process.kill()
                await asyncio.to_thread(rep.process.join, 5)
            rep.alive = False
        self.refuse_requests("the server is shutting down")  # what is still waiting (RolloutServer.stop did it first)
        self._pending.clear()

    def _on_dead(self, rep: _Replica, why: str, checkpoint: str = "") -> None:
        if rep.error:
            return
        rep.alive = False
        rep.error = why
        if self._stopping:
            log.info("replica_stopped", replica=rep.replica_id)
        elif checkpoint and not rep.ready.done() and not rep.restarted:  # the server's start fails as the folder's
            # error, which says it in one line (a restart's failure is a replica death, as before)
            log.debug("replica_dead", replica=rep.replica_id, error=why[-2000:])
        else:
            self.deaths[rep.replica_id] = self.deaths.get(rep.replica_id, 0) + 1  # /metrics: replica_deaths_total
            log.error("replica_dead", replica=rep.replica_id, error=why[-2000:])
        if not rep.ready.done():
            if self._stopping:  # killed while it loaded: nobody waits for it any more
                rep.ready.cancel()
            elif checkpoint and not rep.restarted:  # the user's folder: `tlt rollout serve` says it in one line
                from tlt.model.folder import CheckpointError

                rep.ready.set_exception(CheckpointError(checkpoint))
            else:
                rep.ready.set_exception(ReplicaUnavailableError(f"replica {rep.replica_id} failed to start: {why}"))
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
        self._rehome(rep, why)  # once it is known whether a restart is coming: requests may wait for it
