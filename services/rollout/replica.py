"""One engine replica: a process that owns an `LLMEngine` and runs its loop.

    front --Command--> [drain commands] -> [engine.step() if it has work] --StepEvents--> front

The loop drains every pending command (add, abort, apply weights, lend,
stats) before each engine step, so a weight update always lands *between* two
steps, never inside one. When the engine has nothing to do the loop blocks on
the pipe (no busy spin) until the next command arrives. If the front goes
away (the pipe closes) the replica exits.

Every StepEvents carries the engine's load after the step (running, queued, KV
use) for the front's capacity events. An abort is answered (`Aborted`) once the
engine holds none of the request's sequences: at once for the native engine,
after the step that reports their end for one that ends them asynchronously
(SGLang). Until then the front counts them as work on this replica.

A lend (the colocated trainer borrows the device) calls the engine's optional
`release()` once it holds no sequences, then answers; taking the device back
calls `resume()` before any command that follows it in the pipe.

Errors: a request the engine refuses (ValueError) is reported back as
`RequestFailed` and the loop goes on; a weight push that fails validation is
answered with an error and changes nothing. Anything else (an engine bug, out
of memory) ends the loop: the replica reports `Fatal` with the traceback and
exits, and the front marks it dead and fails its requests.
"""

from __future__ import annotations

import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from tlt.services.common.gc_heap import GcPauses, freeze_heap
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

# a replica whose steps emit nothing (a long chunked prefill) still tells the front it works this often (the
# stall watchdog, replica_lifecycle._watch_stalls, counts silence)
PROGRESS_EVERY_S = 1.0


def replica_main(*args: Any, **kwargs: Any) -> None:
    """Process entry point (multiprocessing spawn target): `serve_replica`, then the process ends at once.

    A normal interpreter exit tears down every module and object first: about a second once torch and a
    tokenizer are loaded, which every stop and restart of a replica waited for. Nothing of the replica's needs
    it: its pipe is closed, its sockets linger 0 and its logs are flushed here. The atexit handlers still run
    (SGLang's engine stops its scheduler processes in one; multiprocessing's own clean-up is another). An
    exception that escaped (none should) is printed and ends the process with 1, as a normal exit would."""
    import atexit
    import sys

    code = 0
    try:
        serve_replica(*args, **kwargs)
    except BaseException:  # deliberate boundary: the process ends here either way
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        except BaseException:  # deliberate boundary: a failing handler must not keep the process alive
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve_replica(
    replica_id: int, model_dir: str, backend: str, engine_config_json: str, threads: int, conn: Connection,
    features_push: str = "", features_max_tokens: int = 4096, spec_config_json: str = "", pin_cpus: bool = False,
    spin_wait: bool = False, environ: dict[str, str] | None = None, gc_freeze: bool = False,
    identify_drafter: bool = False, features_token: str = "",
) -> None:
    """The replica's life in its process. `features_push`: drafter feature PULL endpoint.
    `pin_cpus`: a CPU replica runs on its own cores, `services.common.cpus.cpu_group(replica_id, threads)`.
    `spin_wait`: its OpenMP threads spin briefly at barriers (`services.common.cpus.spin_at_barriers`).
    `environ`: the front's environment, for a replica forked from the preloaded forkserver (replica_start.py),
    whose own is the front's at the forkserver's start.
    `gc_freeze`: freeze the process's heap once the engine is up (services/common/gc_heap.py).
    `identify_drafter`: hash the learned drafter it starts with for `ReplicaInfo.start_drafter` (the front publishes
    capacity events; otherwise nobody reads it, and a large drafter takes seconds to hash).
    `features_token`: the front's control token, which secures the features PUSH (zmq_auth.py; empty: the
    environment's, TLT_AUTH_TOKEN)."""
    import signal

    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)

    # The front stops a replica (Shutdown over the pipe; it exits on the pipe's EOF if the front dies). A signal
    # to the whole process group (`tlt run` stopping the service, Ctrl-C in a terminal) must not kill it before
    # the front has begun its own stop: every normal stop was logged as `replica_dead`.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    spinning = False
    if spin_wait:  # before torch is imported: libgomp reads it then
        from tlt.services.common.cpus import spin_at_barriers

        spinning = spin_at_barriers()
    import torch

    from tlt.services.common.logging import configure_logging, get_logger
    from tlt.services.rollout.backends import engine_class
    from tlt.services.rollout.engine.config import EngineConfig

    configure_logging(service=f"rollout-replica-{replica_id}")
    log = get_logger("rollout.replica")
    if threads > 0:
        torch.set_num_threads(threads)
    if spin_wait and not spinning:
        log.warning("spin_wait_not_applied", reason="torch was imported before the replica could set GOMP_SPINCOUNT")
    config = EngineConfig.model_validate_json(engine_config_json)
    if pin_cpus and str(getattr(config, "device", "cpu")).startswith("cpu"):
        from tlt.services.common.cpus import pin_group

        cores, pinned = pin_group(replica_id, threads)
        log.info("replica_cpus", replica=replica_id, cores=cores, pinned=pinned)
    loading = model_dir  # what the failure names: the model, or the drafter once the model is up
    try:
        engine = engine_class(backend)(model_dir, config, replica_id=replica_id)
        start_drafter = ""
        if spec_config_json:
            loading = spec_subject(spec_config_json)
            attach_spec(engine, spec_config_json)
            if identify_drafter:  # only capacity events carry it: a drafter of 1B params takes ~6 s to hash
                start_drafter = start_drafter_identity(engine, spec_config_json)
    except Exception as e:  # deliberate boundary: report why the replica could not start, then exit
        from tlt.model.drafter import DrafterError
        from tlt.model.folder import CheckpointError

        mine = isinstance(e, (CheckpointError, DrafterError))  # the folder's fault: its message says what to fix
        conn.send(Fatal(f"replica {replica_id} failed to load {loading}:\n{traceback.format_exc()}",
                        checkpoint=f"{loading}: {e}" if mine else ""))
        conn.close()
        return
    info = ReplicaInfo(
        replica_id=replica_id,
        device=str(getattr(config, "device", "cpu")),
        max_model_len=int(engine.max_model_len),
        vocab_size=int(engine.model_config.vocab_size),
        hidden_size=int(engine.model_config.hidden_size),
        eos_token_ids=tuple(int(t) for t in (engine.model_config.eos_token_ids or ())),
        versions=engine.versions,
        expected_weights={k: (tuple(s), str(d).removeprefix("torch.")) for k, (s, d) in engine.expected_weights().items()},
        pid=os.getpid(),
        runs_sample_subsets=bool(getattr(engine, "runs_sample_subsets", False)),
        kv_capacity_tokens=_kv_capacity_tokens(engine),
        start_drafter=start_drafter,
    )
    frozen = freeze_heap() if gc_freeze else 0  # before Ready: the front's first request finds it done
    gc_pauses = GcPauses().install()  # what serving costs: the freeze's own full collection is not counted
    conn.send(Ready(info))
    log.info("replica_ready", replica=replica_id, pid=info.pid, threads=torch.get_num_threads(), device=info.device,
             spin_count=os.environ.get("GOMP_SPINCOUNT", "") if spinning else "", gc_frozen=frozen)
    try:
        features = None
        if features_push:
            from tlt.services.rollout.features import FeaturePublisher

            features = FeaturePublisher(features_push, replica_id, features_max_tokens, token=features_token)
        ReplicaLoop(engine, conn, replica_id, features, gc_pauses).run()
    except (EOFError, BrokenPipeError):
        log.info("replica_front_gone", replica=replica_id)
    except Exception:  # deliberate boundary: the loop died; tell the front why before exiting
        message = traceback.format_exc()
        log.error("replica_failed", replica=replica_id, error=message)
        try:
            conn.send(Fatal(message))
        except (OSError, BrokenPipeError):
            pass
    finally:
        conn.close()


def _kv_capacity_tokens(engine: Any) -> int:
    """What the native engine's paged cache holds for one sequence (its `add_request` refuses more); 0 elsewhere."""
    blocks = getattr(engine, "block_manager", None)
    try:
        return int(blocks.num_blocks) * int(blocks.block_size)
    except (AttributeError, TypeError, ValueError):
        return 0


def spec_subject(spec_config_json: str) -> str:
    """What `attach_spec` loads, for its failure message: the learned drafter's folder, else the speculative
    decoder (a failure there is not the model's, whose folder the message named)."""
    from tlt.services.rollout.spec.config import SpecConfig

    spec = SpecConfig.model_validate_json(spec_config_json)
    if spec.mode != "off" and spec.drafter == "learned":
        return f"the drafter {spec.drafter_path}"
    return "the speculative decoder ([rollout.spec])"


def start_drafter_identity(engine: Any, spec_config_json: str) -> str:
    """Which learned drafter the engine started with ("sha256:..." of its folder's tensors, as a drafter coordinator's
    lineage), for the capacity events: a coordinator grown from it may push its serving drafter to this rollout again
    after a restart; "" when the engine drafts with none (n-gram, speculation off, another backend)."""
    from tlt.model.drafter import folder_identity
    from tlt.services.rollout.spec.config import SpecConfig

    spec = SpecConfig.model_validate_json(spec_config_json)
    if spec.mode == "off" or spec.drafter != "learned" or not spec.drafter_path or engine.versions.drafter != 0:
        return ""
    return folder_identity(spec.drafter_path)


def attach_spec(engine: Any, spec_config_json: str) -> None:
    """Give a native engine its speculative decoder ([rollout.spec]); other backends configure their own."""
    from tlt.services.rollout.spec.config import SpecConfig

    spec = SpecConfig.model_validate_json(spec_config_json)
    if hasattr(engine, "enable_spec"):
        engine.enable_spec(spec)  # loads a learned drafter from spec.drafter_path onto the target's embed/lm_head


class ReplicaLoop:
    """Drain commands, step the engine, send what it produced."""

    def __init__(self, engine: Any, conn: Connection, replica_id: int, features: Any = None,
                 gc_pauses: GcPauses | None = None) -> None:
        self.engine = engine
        self.gc_pauses = gc_pauses  # the process's collections, reported with the stats
        self.conn = conn
        self.replica_id = replica_id
        self.features = features  # a rollout.features.FeaturePublisher when features go to the drafter
        self.running = True
        self._aborts: list[AbortRequest] = []  # not answered yet: the engine still holds sequences of theirs
        self._lend: Lend | None = None  # a lend waiting for the engine to finish its sequences
        self._sent = time.monotonic()  # when StepEvents last went to the front
        self._steps_seen: int | None = None  # the engine's steps_run at the last look (_ran_a_step)
        self._handlers = {
            AddRequest: self._add,
            AbortRequest: self._abort,
            ApplyWeights: self._apply_weights,
            Lend: self._lend_cmd,
            QueryStats: self._stats,
            Shutdown: self._shutdown,
        }

    def run(self) -> None:
        while self.running:
            busy = self.engine.has_unfinished()
            # Busy: take what is waiting and step. Idle: block until a command comes.
            if self.conn.poll(0 if busy else None):
                self._drain()
                if not self.running:
                    break
            if self.engine.has_unfinished():
                steps, finished = self.engine.step()
                if steps or finished:
                    if self.features is not None:
                        self.features.publish(finished, self.engine.versions.policy)
                    for c in finished:
                        c.replica_id = self.replica_id
                        if c.features is not None:
                            c.features = c.features.detach().to("cpu").half().numpy()
                    self.conn.send(StepEvents(steps=steps, finished=finished, load=self._load()))
                    self._sent = time.monotonic()
                elif time.monotonic() - self._sent >= PROGRESS_EVERY_S and self._ran_a_step():
                    # a step that emitted nothing (a chunk of a long prefill) is progress too: say so, or the
                    # front's stall watchdog counts the silence and kills a replica that is working
                    self.conn.send(StepEvents(steps=[], finished=[], load=self._load()))
                    self._sent = time.monotonic()
                if self._aborts:
                    self._answer_aborts()
            # every turn, not only after a step: sequences that leave by an abort end no step, and a lend that
            # waited for them was never answered (the trainer's LendDevices timed out)
            if self._lend is not None and not self.engine.has_unfinished():
                self._release()

    def _ran_a_step(self) -> bool:
        """Whether the engine computed something since the last call: its `steps_run` moved. An engine without
        that count (SGLang's adapter, whose step polls an engine that may hang) never claims progress it cannot
        see; its silence stays a stall."""
        steps = getattr(self.engine, "steps_run", None)
        moved = steps is not None and steps != self._steps_seen
        self._steps_seen = steps
        return moved

    def _drain(self) -> None:
        while self.running and self.conn.poll(0):
            cmd = self.conn.recv()
            self._handlers[type(cmd)](cmd)

    def _add(self, cmd: AddRequest) -> None:
        request = cmd.request if self.features is None else self.features.want_features(cmd.request)
        try:
            self.engine.add_request(request)
        except ValueError as e:
            if self.features is not None:
                self.features.forget(cmd.request.request_id)
            self.conn.send(RequestFailed(cmd.request.request_id, str(e)))

    def _abort(self, cmd: AbortRequest) -> None:
        self.engine.abort_request(cmd.request_id)
        if self.features is not None:
            self.features.forget(cmd.request_id)
        self._aborts.append(cmd)
        self._answer_aborts()

    def _answer_aborts(self) -> None:
        """Answer the aborts whose sequences the engine has dropped: the front counts them out only then."""
        done = [a for a in self._aborts if not self.engine.holds(a.request_id)]
        if done:
            self._aborts = [a for a in self._aborts if a not in done]
            load = self._load()
            for a in done:
                self.conn.send(Aborted(a.cmd_id, load))

    def _lend_cmd(self, cmd: Lend) -> None:
        """Lend: release what the engine can free once it holds no sequences (now, or after the step that ends
        its last one). Take back: resume (before any request that follows it in the pipe)."""
        if cmd.lent:
            self._lend = cmd
            if not self.engine.has_unfinished():
                self._release()
            return
        if self._lend is not None:  # taken back before it was released: that lend is over, and answered
            self._answer(self._lend.cmd_id, "")
            self._lend = None
        self._hook("resume", cmd.cmd_id)

    def _release(self) -> None:
        cmd, self._lend = self._lend, None
        self._hook("release", cmd.cmd_id)  # type: ignore[union-attr]

    def _hook(self, name: str, cmd_id: int) -> None:
        """Run the engine's optional colocation hook `name` (release / resume; the native engine has neither: it
        keeps its fixed KV budget, docs/DEPLOY.md) and answer `cmd_id` with how it went."""
        error, t0 = "", time.perf_counter()
        try:
            hook = getattr(self.engine, name, None)
            if hook is not None:
                hook()
        except ValueError as e:
            error = f"replica {self.replica_id}: {name} failed: {e}"
        self._answer(cmd_id, error, time.perf_counter() - t0)

    def _answer(self, cmd_id: int, error: str, seconds: float = 0.0) -> None:
        if cmd_id:
            self.conn.send(Reply(cmd_id, error=error, seconds=seconds))

    def _load(self) -> EngineLoad:
        running, queued, kv_usage = self.engine.load()
        return EngineLoad(int(running), int(queued), float(kv_usage))

    def _apply_weights(self, cmd: ApplyWeights) -> None:
        from tlt.services.common.weights import WeightValidationError, unpack
        from tlt.v1 import rollout_pb2

        t0 = time.perf_counter()
        manifest = rollout_pb2.WeightManifest.FromString(cmd.manifest)
        before = self.engine.versions.policy
        try:
            tensors = unpack(manifest, cmd.payload, None)
            self.engine.update_weights(cmd.kind, tensors, cmd.version)
        except (WeightValidationError, ValueError) as e:
            self.conn.send(Reply(cmd.cmd_id, error=str(e)))  # the pool names the replica (pool_states.failures)
            return
        if self.features is not None and self.engine.versions.policy != before:
            where = getattr(self.engine, "unfinished_emitted", None)  # unfinished sequences' features end here
            if where is not None:  # else a sequence it spans is stamped policy_min and sends no features
                self.features.policy_changed(before, where())
        self.conn.send(Reply(cmd.cmd_id, versions=self.engine.versions, seconds=time.perf_counter() - t0))

    def _stats(self, cmd: QueryStats) -> None:
        s = self.engine.stats()
        stats = ReplicaStats(
            running=int(s.running),
            queued=int(s.queued),
            kv_usage=float(s.kv_usage),
            versions=s.versions,
            num_preemptions=int(s.num_preemptions),
            steps=int(s.steps),
            spec=dict(getattr(s, "spec", {}) or {}),
            features_dropped=self.features.dropped if self.features is not None else 0,
            gc=self.gc_pauses.snapshot() if self.gc_pauses is not None else {},
        )
        self.conn.send(Reply(cmd.cmd_id, stats=stats, versions=s.versions))

    def _shutdown(self, cmd: Shutdown) -> None:
        self.running = False
