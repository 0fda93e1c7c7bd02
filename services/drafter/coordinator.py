"""The drafter coordinator: owns the feature buffer and the candidate drafter, gates publishing.

    rollout/trainer --FeatureBatch (PULL)--> FeatureBuffer
    workers --WorkerMessage (REQ -> ROUTER)--> hello | pull candidate | batch request | delta | window report
    candidate += delta (version + 1)  --every eval_interval_s-->  offline acceptance length on held-out
        recent data, candidate vs serving --better by publish_margin--> UpdateWeights(kind=drafter) on the
        rollout (every replica, versioned) --> serving := candidate
    policy version of feature batches and worker messages > ours --before an evaluation--> the target's
        embedding and lm_head fetched from the rollout (GetWeights, shared.py) for the acceptance gate
    everything --> DrafterStatus (gRPC tlt.v1.Drafter/GetStatus)

Workers train asynchronously from the candidate they pulled and send back their change (a delta), so
any number of workers can join, leave or die: a delta is applied whole or not at all, and once (a
worker that sends it again after a lost answer gets the version it made), and the candidate with its
version, the serving drafter and the history are checkpointed atomically after every change
(`coordinator.pt`, written by a background saver at most every 0.5 s so the workers' requests never wait on the
disk, and while a replica decodes only after a while: `_saver`), so a restarted coordinator continues from a
consistent state. The published tensors are the drafter's own (fc.*, layer.*); the target's embedding and lm_head
are never among them (asserted). A push that fails (possibly on some replicas only) is sent again as it
was until it lands, whatever later evaluations say; a push in flight or owed is in the checkpoint, so a
restarted coordinator sends it again too (or, refused as already served, takes it as the serving drafter). A
push refused because the rollout serves a newer drafter than any this coordinator pushed (its checkpoint_dir is new
or was lost while the rollout ran on) is numbered above the rollout's version and sent again; a rollout seen on an
older drafter (restarted) gets the serving drafter again if it started on the drafter this one grew from, else is
reported. A checkpoint of another init drafter is moved aside (lineage.py).
A worker not heard from for `WORKER_SILENT_S` (workers say hello every `WORKER_HEARTBEAT_S` while they run) is shown
in status as neither alive nor training.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from tlt.model.drafter import DrafterError
from tlt.services.common.events import FeatureSource
from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.common.weights import unpack
from tlt.services.drafter.acceptance import EvaluationInterrupted, mean_accept_length, same_objects
from tlt.services.drafter.buffer import FeatureBuffer
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.intake import FeatureIntake
from tlt.services.drafter.lineage import identity, moved_aside
from tlt.services.drafter.rollout_idle import RolloutIdle
from tlt.services.drafter.shared import Fetch, SharedTensors, SharedWeights
from tlt.services.drafter.training import (build_drafter, load_state, own_tensors, save_atomic, target_shared,
                                           tensors_message)
from tlt.services.rollout.client import WeightPushError
from tlt.v1 import common_pb2, drafter_pb2, events_pb2, rollout_pb2

log = get_logger("drafter.coordinator")

# (own tensors, version) -> pushed, or raises (WeightPushError with the version the rollout serves when it refused)
Publish = Callable[[dict[str, torch.Tensor], int], None]


# a checkpoint write owed for the history only (window reports) waits at most this long for an idle rollout (`_saver`)
HISTORY_SAVE_WAIT_S = 30.0
# a checkpoint write owed for a change of the drafter's state waits at most this long for an idle rollout (`_saver`)
STATE_SAVE_WAIT_S = 5.0
PUSH_RETRY_S = 2.0  # a push owed to the rollout (`push_pending`) is retried this often until it lands
REPUSH_S = 10.0  # after a push, a rollout seen on an older drafter is reported only after this long
WORKER_HEARTBEAT_S = 2.0  # a running worker says hello this often, whatever it does (worker.py: its own thread)
WORKER_REQUEST_TIMEOUT_S = 10.0  # a worker's wait for an answer before it asks again on a fresh socket
# A worker not heard from for this long is shown as neither alive nor training (killed, or cut off). A live one is
# heard at least every heartbeat plus the timeout of one unanswered request; twice that leaves room for a slow host.
WORKER_SILENT_S = 2 * (WORKER_HEARTBEAT_S + WORKER_REQUEST_TIMEOUT_S)


class Coordinator:
    def __init__(self, config: DrafterServiceConfig, model_dir: str, features: FeatureSource | None,
                 publish: Publish | None, fetch_shared: Fetch | None = None) -> None:
        """`fetch_shared`: where newer target embedding / lm_head come from (shared.rollout_fetch); None: never."""
        self.cfg = config
        self.model_dir = model_dir
        self.features = features
        self.publish_fn = publish
        self.ckpt = Path(config.checkpoint_dir) / "coordinator.pt"
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self.drafter_cfg, embed, head = target_shared(model_dir)
        self.buffer = FeatureBuffer(config.buffer_sequences, config.holdout_sequences, config.window_tokens,
                                    config.long_tokens, config.holdout_every, hidden_size=self.drafter_cfg.hidden_size,
                                    vocab_size=self.drafter_cfg.vocab_size)  # what does not fit is refused at ingest
        self.shared = SharedWeights(SharedTensors(0, embed, head), fetch_shared)  # --model is policy version 0
        self.candidate = build_drafter(self.drafter_cfg, embed, head, config.init_drafter, seed=0)
        self.candidate.requires_grad_(False)
        self.lineage = identity(config.init_drafter, own_tensors(self.candidate))  # checkpointed (lineage.py)
        self.candidate_version = 0
        self.serving = own_tensors(self.candidate)
        self.serving_version = 0  # the drafter the rollout started with (init_drafter or random), as version 0
        self.latest_policy = 0
        self.windows: deque[drafter_pb2.TrainingWindow] = deque(maxlen=config.history)
        self.acceptance: deque[drafter_pb2.AcceptanceRecord] = deque(maxlen=config.history)
        self.workers: dict[int, drafter_pb2.WorkerStatus] = {}  # changed under the lock (status() reads them)
        self._heard: dict[int, float] = {}  # worker id -> monotonic time of its last message
        self._pids: dict[int, int] = {}  # worker id -> the pid its last hello gave (a new one: the worker restarted)
        self.worker_silent_s = WORKER_SILENT_S
        self.preemptions = 0
        self.deltas = 0
        self.deltas_refused = 0  # since this process started (not checkpointed: a count for status and /metrics)
        # worker id -> ((base version, payload sha256) of its last applied delta, the version it made): a worker
        # whose answer timed out sends the same delta again, which must not be applied twice (checkpointed)
        self._applied: dict[int, tuple[tuple[int, str], int]] = {}
        self._evaluated = 0
        self._last_eval = 0.0
        # the serving drafter's last score: ((serving version, shared policy version), the held-out samples
        # it was computed on, (accept length, verify steps walked)). Several candidates are usually scored against
        # one held-out set between two rollouts; the serving side need not be recomputed.
        self._serving_score: tuple[tuple[int, int], list, tuple[float, int]] | None = None
        self.interrupted_evals = 0  # evaluations given up because a replica turned busy
        self._restored_pending: tuple[dict[str, torch.Tensor], int] | None = None
        # the versions the checkpoint says were pushed, or may have been (serving, and the push owed): the only ones
        # a rollout's "already served" refusal can be about (`push_pending`)
        self._restored_pushes: set[int] = set()
        self._restore()
        # A push still owed to the rollout (`push_pending`), sent as it is until it lands: a candidate push that
        # failed, or a restored serving drafter (version > 0): after a restart (`tlt run --resume`) the rollout
        # starts from its initial drafter and would otherwise run without the trained one until a candidate beat
        # it by the margin.
        # A push owed when the last process died (in flight or failed: checkpointed with it) comes first.
        self._pending: tuple[dict[str, torch.Tensor], int] | None = self._restored_pending or (
            (dict(self.serving), self.serving_version) if self.serving_version > 0 else None)
        self._pending_at = self._repush_at = 0.0  # `push_pending`, `_repush_if_behind` not before
        self._behind: int | None = None  # the rollout's older drafter version, once `_repush_if_behind` said so
        # evaluations (and publishing) wait until every replica is idle, as training waits for its replica's (made
        # after the checkpoint was read: one that does not fit raises, and its thread and socket would be left behind)
        self.rollout = RolloutIdle(config.capacity_pub, config.capacity_snapshot) if config.gate_when_idle else None
        self.metrics = Metrics("drafter")
        self.m_versions = self.metrics.gauge("version", "drafter versions: candidate and serving", ("kind",))
        self.m_buffer = self.metrics.gauge("buffer_windows", "training windows in the feature buffer")
        self.m_dropped = self.metrics.gauge("features_dropped", "feature sequences the senders dropped (slow consumer)")
        self.m_refused = self.metrics.gauge("features_rejected", "feature sequences refused at ingest (do not fit the model)")
        self.m_rejected = self.metrics.counter("feature_batches_rejected_total", "batches from the other source")
        self.m_preempt = self.metrics.counter("preemptions_total", "training windows ended by a BUSY event")
        self.m_steps = self.metrics.counter("micro_steps_total", "drafter micro-steps reported by workers")
        self.m_deltas_refused = self.metrics.counter("deltas_refused_total", "worker deltas refused (wrong tensors or "
                                                     "non-finite: a diverged step)")
        self.m_release = self.metrics.histogram("release_seconds", "BUSY event -> worker freed the device",
                                                buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.m_accept = self.metrics.gauge("accept_len", "held-out greedy acceptance length", ("drafter",))
        self.m_shared = self.metrics.gauge("shared_policy_version", "policy version of the target embedding/lm_head "
                                           "the acceptance gate uses")
        self.m_shared_failed = self.metrics.gauge("shared_fetch_failures", "failed fetches of the target embedding/lm_head")
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(config.coordinator_bind)
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dirty = threading.Event()
        self._state_dirty = False  # a change beyond the history since the last write (`_saver`)
        self._threads = [threading.Thread(target=self._serve_workers, name="drafter-router", daemon=True),
                         threading.Thread(target=self._saver, name="drafter-saver", daemon=True),
                         threading.Thread(target=self._gate_loop, name="drafter-gate", daemon=True)]
        # features arriving while a replica decodes are parsed once the rollout is idle when no worker trains meanwhile
        hold = config.train_when == "rollout_idle" and self.rollout is not None and self.rollout.enabled
        self.intake = None if features is None else FeatureIntake(features, self._ingest, self.rollout if hold else None)
        if self.intake is not None:
            self._threads.append(threading.Thread(target=self.intake.run, args=(self._stop,), name="drafter-features",
                                                  daemon=True))

    # ---- lifecycle
    def start(self) -> Coordinator:
        for t in self._threads:
            t.start()
        log.info("coordinator_started", endpoint=self.endpoint, candidate_version=self.candidate_version,
                 serving_version=self.serving_version)
        return self

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:  # started (a caller whose setup failed before start() closes it too)
                t.join(timeout=10)
        if self.rollout is not None:
            self.rollout.close()
        self._router.close()
        self._ctx.term()

    def _restore(self) -> None:
        state = load_state(self.ckpt)
        if state is None or moved_aside(state, self.lineage, self.ckpt, self.cfg.init_drafter):  # another init's
            return
        try:
            self.candidate.load_tensors(state["candidate"])
        except DrafterError as e:  # the default checkpoint_dir is the same for every model started from one folder
            raise DrafterError(f"{self.ckpt} holds the drafter of another model ({e}); give [drafter] checkpoint_dir "
                               f"a folder of its own for --model {self.model_dir}, or move that file away") from e
        self.candidate_version = int(state["candidate_version"])
        self.serving = state["serving"]
        self.serving_version = int(state["serving_version"])
        self.preemptions = int(state.get("preemptions", 0))
        self.deltas = int(state.get("deltas", 0))
        self._applied = dict(state.get("applied", {}))
        pending = state.get("pending")
        if pending is not None:  # the last process died with this push in flight or failed: still owed
            self._restored_pending = (pending["tensors"], int(pending["version"]))
            self._restored_pushes.add(self._restored_pending[1])
        if self.serving_version > 0:
            self._restored_pushes.add(self.serving_version)
        for blob in state.get("acceptance", []):
            self.acceptance.append(drafter_pb2.AcceptanceRecord.FromString(blob))
        for blob in state.get("windows", []):
            self.windows.append(drafter_pb2.TrainingWindow.FromString(blob))
        log.info("coordinator_restored", candidate_version=self.candidate_version, serving=self.serving_version)

    def _save(self, history_only: bool = False) -> None:  # caller holds the lock; the saver thread writes it soon
        """history_only: only the status history changed (a worker's window report): see `_saver`."""
        if not history_only:
            self._state_dirty = True
        self._dirty.set()

    def _saver(self) -> None:
        """Write the checkpoint ~0.5 s after a change. While a replica is busy (or no replica's state is known: the
        rollout is down or not up yet, `RolloutIdle.busy`) the write (the drafter's tensors, the history, an fsync)
        waits until the rollout is idle: it would take a decoding replica's CPU. A change of the
        history only (window reports, which workers send as their replica turns busy: at the start of every
        rollout) waits at most HISTORY_SAVE_WAIT_S, records a crash may lose at no cost to training; a change of the
        candidate, the serving drafter, a push owed or the applied deltas at most STATE_SAVE_WAIT_S (the deltas a
        worker sent in the last moments of an idle gap were written ~0.5 s later, inside the next rollout), so a
        kill -9 loses at most that much training. Without `gate_when_idle` (no capacity events) nothing waits."""
        while not self._stop.is_set():
            if self._dirty.wait(0.5) and not self._stop.is_set():
                time.sleep(0.5)
                since = time.monotonic()
                while (self.rollout is not None and self.rollout.busy()
                       and time.monotonic() - since < (STATE_SAVE_WAIT_S if self._state_dirty else HISTORY_SAVE_WAIT_S)
                       and not self._stop.wait(0.1)):
                    pass
                if self._dirty.is_set():  # the gate may have written it meanwhile (save_now)
                    self._try_save()
        if self._dirty.is_set():
            self._try_save()

    def _try_save(self) -> None:
        """`save_now` for the saver thread: a failed write (full disk, I/O error) is logged and tried again at the
        next round, instead of ending the thread and with it every later checkpoint."""
        try:
            self.save_now()
        except Exception as e:  # deliberate boundary: the saver must outlive a bad moment of the disk
            log.error("coordinator_checkpoint_failed", path=str(self.ckpt), error=repr(e)[:300])

    def save_now(self) -> None:
        """Write the checkpoint now. A write that fails leaves the change owed (the saver tries again, as for any
        change of the drafter's state) and raises."""
        with self._save_lock:  # the saver and the gate (after a publish): one writer, snapshots in order
            with self._lock:
                self._dirty.clear()
                self._state_dirty = False
                state = self._state()
            try:
                save_atomic(self.ckpt, state, fsync=True)
            except BaseException:
                with self._lock:
                    self._state_dirty = True
                    self._dirty.set()
                raise

    def _state(self) -> dict:  # caller holds the lock
        return ({
            "candidate": own_tensors(self.candidate), "candidate_version": self.candidate_version,
            "serving": self.serving, "serving_version": self.serving_version, "preemptions": self.preemptions,
            "deltas": self.deltas, "applied": dict(self._applied), "lineage": self.lineage,
            "pending": None if self._pending is None else {"tensors": self._pending[0], "version": self._pending[1]},
            "acceptance": [a.SerializeToString() for a in self.acceptance],
            "windows": [w.SerializeToString() for w in self.windows],
        })

    # ---- features (the intake thread, intake.py)
    def _ingest(self, batch: events_pb2.FeatureBatch) -> None:
        if batch.source and batch.source != self.cfg.source:  # [drafter] source picks one producer
            self.m_rejected.inc()
            return
        self.buffer.add_batch(batch)
        if batch.sequences:
            self.latest_policy = max(self.latest_policy, max(s.policy_version for s in batch.sequences))
            self.shared.see(self.latest_policy)

    # ---- workers
    def _serve_workers(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(timeout=100):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, body = frames
            try:
                msg = drafter_pb2.WorkerMessage.FromString(body)
                reply = self.handle(msg)
            except Exception as e:  # deliberate boundary: one bad request must not stop the coordinator
                log.error("worker_request_failed", error=repr(e))
                reply = drafter_pb2.CoordinatorMessage(error=repr(e))
            self._router.send_multipart([ident, b"", reply.SerializeToString()])

    def handle(self, msg: drafter_pb2.WorkerMessage) -> drafter_pb2.CoordinatorMessage:
        kind = msg.WhichOneof("body")
        with self._lock:
            now = time.monotonic()
            joined = not self._alive(msg.worker_id, now)  # new, or back after a silence
            self._heard[msg.worker_id] = now
            w = self.workers.setdefault(msg.worker_id, drafter_pb2.WorkerStatus(worker_id=msg.worker_id))
            w.replica_id, w.alive = msg.replica_id, True
            w.shared_policy_version, w.shared_fetch_failures = msg.shared_policy_version, msg.shared_fetch_failures
            if kind == "hello" and self._pids.get(msg.worker_id) != msg.hello.pid:
                self._pids[msg.worker_id] = msg.hello.pid
                w.training = False  # a (re)started process: the window its predecessor had open ended with it
                joined = True
        self.shared.see(msg.shared_policy_version)  # a worker heard of a newer policy (capacity events)
        if kind == "hello":  # also every WORKER_HEARTBEAT_S: logged when the worker (re)joins
            if joined:
                log.info("worker_joined", worker=msg.worker_id, replica=msg.replica_id, pid=msg.hello.pid)
            return drafter_pb2.CoordinatorMessage(status=self.status(history=False))
        if kind == "pull":
            with self._lock:
                m, p = tensors_message(own_tensors(self.candidate), self.candidate_version)
                return drafter_pb2.CoordinatorMessage(candidate=drafter_pb2.CandidateWeights(
                    version=self.candidate_version, manifest=m, payload=p))
        if kind == "batch_request":
            with self._lock:
                w.training = True
            # smaller than the configured batch if asked, never larger: this thread builds it while every other
            # worker waits (a peer's rows=10**6 took it 30 s and gigabytes of padding)
            rows = min(msg.batch_request.rows or self.cfg.batch_rows, self.cfg.batch_rows)
            tokens = min(msg.batch_request.max_tokens or self.cfg.batch_tokens, self.cfg.batch_tokens)
            batch = self.buffer.batch(rows, tokens)
            return drafter_pb2.CoordinatorMessage(batch=batch.to_proto() if batch else drafter_pb2.TrainBatch())
        if kind == "update":
            try:
                return drafter_pb2.CoordinatorMessage(candidate_version=self.apply_delta(msg.update, msg.worker_id))
            except ValueError as e:  # counted where an operator looks (status, /metrics); the worker gets the error
                with self._lock:
                    self.deltas_refused += 1
                    w.deltas_refused += 1
                self.m_deltas_refused.inc()
                log.warning("delta_refused", worker=msg.worker_id, error=str(e)[:300])
                raise
        if kind == "window":
            win = msg.window
            self.m_steps.inc(win.micro_steps)
            if win.preempted:
                self.m_preempt.inc()
                self.m_release.observe(max(0.0, win.released - win.busy_timestamp))
            with self._lock:
                w.training = False
                w.micro_steps += win.micro_steps
                w.preemptions += int(win.preempted)
                self.windows.append(win)
                self.preemptions += int(win.preempted)
                self._save(history_only=True)
            return drafter_pb2.CoordinatorMessage(status=self.status(history=False))
        raise ValueError(f"unknown worker message {kind!r}")

    def _alive(self, worker_id: int, now: float) -> bool:  # caller holds the lock
        heard = self._heard.get(worker_id)
        return heard is not None and now - heard < self.worker_silent_s

    def _worker_status(self, w: drafter_pb2.WorkerStatus, now: float) -> drafter_pb2.WorkerStatus:
        """A copy of a worker's record as status shows it: a worker silent for `worker_silent_s` (killed with -9, or
        cut off) is neither alive nor training, whatever it last said. Caller holds the lock."""
        out = drafter_pb2.WorkerStatus()
        out.CopyFrom(w)
        out.alive = self._alive(w.worker_id, now)
        out.training = w.training and out.alive
        return out

    def apply_delta(self, upd: drafter_pb2.DeltaUpdate, worker_id: int | None = None) -> int:
        """Add a worker's delta to the candidate; returns the version it made. The same delta sent again by
        the same worker (its answer came after the worker's timeout, so the worker kept it) is not added twice:
        the answer is the version it made the first time."""
        manifest = rollout_pb2.WeightManifest.FromString(upd.manifest)
        delta = unpack(manifest, upd.payload, None)  # validated: the payload matches the manifest's sha256
        key = (int(upd.base_version), manifest.sha256)
        with self._lock:
            done = self._applied.get(worker_id) if worker_id is not None else None
            if done is not None and done[0] == key:
                log.info("delta_resent", worker=worker_id, base_version=upd.base_version, version=done[1])
                return done[1]
            own = self.candidate.state_dict()
            bad = sorted(set(delta) ^ set(own))
            if bad:
                raise ValueError(f"delta tensors do not match the drafter: {bad[:5]}")
            for k, d in delta.items():
                if d.shape != own[k].shape or not torch.isfinite(d).all():
                    raise ValueError(f"delta tensor {k} has the wrong shape or non-finite values")
            for k, d in delta.items():
                own[k].add_(d.to(own[k].dtype))
            self.candidate_version += 1
            self.deltas += 1
            if worker_id is not None:
                self._applied[worker_id] = (key, self.candidate_version)
            self._save()
            return self.candidate_version

    # ---- gating
    def _gate_loop(self) -> None:
        if self.cfg.evaluation_sched == "idle":  # this thread only: ingest and the router keep their priority
            from tlt.services.common.cpus import this_thread_when_idle

            log.info("evaluation_sched", sched="idle" if this_thread_when_idle() else "unsupported")
        while not self._stop.wait(0.2):
            self._repush_if_behind()
            if self._pending is not None and time.monotonic() >= self._pending_at:
                if self.rollout is None or not self.rollout.busy():
                    try:
                        self.push_pending()
                    except Exception as e:  # deliberate boundary: the rollout may be down or not up yet; try again
                        log.warning("drafter_push_retry_failed", version=self._pending[1], error=repr(e)[:300])
                        self._pending_at = time.monotonic() + PUSH_RETRY_S
            if self.candidate_version > self._evaluated and time.monotonic() - self._last_eval >= self.cfg.eval_interval_s:
                if self.rollout is not None and self.rollout.busy():
                    continue  # a replica decodes: this work would take its CPU (BENCHMARKS.md, "Session 5")
                try:
                    if self.intake is not None:  # the last rollout's features belong in the held-out set
                        self.intake.parse_held()
                    self.refresh_shared()
                    self.evaluate_and_publish()
                except EvaluationInterrupted as e:
                    self.interrupted_evals += 1
                    log.info("drafter_evaluation_interrupted", reason=str(e), total=self.interrupted_evals)
                except Exception as e:  # deliberate boundary: a failed push is reported and retried later
                    log.error("drafter_publish_failed", error=repr(e))
                self._last_eval = time.monotonic()

    def push_pending(self) -> None:
        """Send the push still owed to the rollout, as it is, whatever the evaluations said since.
        - a candidate push that failed: it may have failed on some replicas only, leaving those on the old
          drafter and the others on this one, and a later candidate that no longer wins by the margin would
          never repair that;
        - the serving drafter restored from the checkpoint: the restarted rollout serves its initial one.
        A rollout that already serves this version or a newer one refuses it and says which
        (`WeightPushError.serving_version`). For a version the restored checkpoint says was pushed (e.g. only this
        service restarted) that ends it too. A version this process made may be refused for a drafter this
        coordinator does not know (its checkpoint_dir is new, or was lost while the rollout ran on): the push is
        numbered above the rollout's version and sent again (`_renumber_pending`; one push more than needed when an
        earlier send of it landed and only the answer was lost). Any other refusal raises (retried later)."""
        if self._pending is None or self.publish_fn is None:
            self._pending = None  # nowhere to push (a coordinator without a rollout)
            return
        tensors, version = self._pending
        try:
            self.publish_fn(tensors, version)
            log.info("drafter_pushed", version=version, retried=True)
        except WeightPushError as e:
            if e.serving_version is None or e.serving_version < version:
                raise
            if version in self._restored_pushes:
                log.info("drafter_push_not_needed", version=version, serving=e.serving_version)
                with self._lock:  # the next candidate numbers above what the rollout serves
                    self.candidate_version = max(self.candidate_version, e.serving_version)
            else:
                version = self._renumber_pending(version, e.serving_version)
                self.publish_fn(tensors, version)  # raises: owed under its new number, retried by the gate loop
                log.info("drafter_pushed", version=version, renumbered=True)
        with self._lock:
            if version > self.serving_version:
                self.serving, self.serving_version = tensors, version
            self._pending = None
        self._repush_at = time.monotonic() + REPUSH_S
        self.save_now()

    def _repush_if_behind(self) -> None:
        """A rollout on an older drafter than the serving one (not within REPUSH_S of a push) that restarted on the
        drafter this one grew from (events' `start_drafter` == lineage) is owed the serving drafter; one started on
        another (its operator chose it, or it does not say) is left alone and reported once."""
        behind = None if self.rollout is None else self.rollout.drafter_behind(self.serving_version)
        if behind is None or self._pending is not None or time.monotonic() < self._repush_at:
            self._behind = None if behind is None else self._behind
            return
        if (starts := self.rollout.start_drafters(self.serving_version)) == {self.lineage} and self.serving_version > 0:
            log.info("drafter_repush", version=self.serving_version, rollout_serves=behind, start_drafter=self.lineage)
            with self._lock:
                self._pending = (dict(self.serving), self.serving_version)
                self._restored_pushes.add(self.serving_version)  # refused as not newer: it got there another way
            self._pending_at, self._behind = 0.0, None
            return
        if self._behind is None:
            log.warning("drafter_rollout_behind", serving=self.serving_version, rollout_serves=behind, lineage=self.lineage,
                        rollout_started_on=sorted(s or "unknown" for s in starts), detail="started on another drafter "
                        "than this one grew from: left alone; restart the drafter service to push the serving one")
        self._behind = behind

    def _renumber_pending(self, version: int, rollout_version: int) -> int:
        """Number the owed push of `version` above `rollout_version` (what the rollout serves) and the candidate;
        checkpointed before it is sent, as every push is. Returns the new number. The candidate keeps a number of its
        own: the push's when it is still the drafter the push carries, one above it when deltas changed it since (one
        number, one drafter: a refusal of a number as already served must be about these weights)."""
        with self._lock:
            fresh = max(self.candidate_version, rollout_version) + 1
            self.candidate_version = fresh if self.candidate_version == version else fresh + 1
            self._pending = (self._pending[0], fresh)  # type: ignore[index]  # push_pending's, set
        log.warning("drafter_push_renumbered", version=version, rollout_serves=rollout_version, now=fresh,
                    candidate_version=self.candidate_version)
        self.save_now()
        return fresh

    def refresh_shared(self) -> bool:
        """Fetch the policy's embedding / lm_head if a newer policy was seen (on failure keep ours); True: swapped."""
        if not self.shared.refresh():
            return False
        cur = self.shared.current
        with self._lock:
            self.candidate.set_shared(cur.embed, cur.lm_head)  # drop the old ones (large on real models)
        return True

    def evaluate_and_publish(self) -> drafter_pb2.AcceptanceRecord | None:
        """Compare candidate and serving on held-out recent data; publish the candidate when it is better.
        Raises EvaluationInterrupted (nothing recorded) when a replica turns busy meanwhile (`gate_when_idle`)."""
        held = self.buffer.holdout(self.cfg.min_eval_tokens)
        if sum(len(s) for s in held) < self.cfg.min_eval_tokens:
            return None
        with self._lock:
            version = self.candidate_version
            cand = own_tensors(self.candidate)
            serving = {k: v.clone() for k, v in self.serving.items()}
            serving_version = self.serving_version
        shared = self.shared.current
        probe = build_drafter(self.drafter_cfg, shared.embed, shared.lm_head)  # the policy's lm_head, as the engine's
        probe.eval()
        probe.load_tensors(cand)
        stop = self.rollout.busy if self.rollout is not None else None  # give the CPU back at once
        cand_len, _ = mean_accept_length(probe, held, self.cfg.eval_depth, stop)
        basis, cached = (serving_version, shared.policy_version), self._serving_score
        if cached is not None and cached[0] == basis and same_objects(cached[1], held):
            serve_len, count = cached[2]
        else:
            probe.load_tensors(serving)
            serve_len, count = mean_accept_length(probe, held, self.cfg.eval_depth, stop)
            self._serving_score = (basis, held, (serve_len, count))
        if stop is not None and stop():  # turned busy at the very end: publish between rollouts, not during one
            raise EvaluationInterrupted("a replica turned busy before publishing")
        better = cand_len >= serve_len * (1 + self.cfg.publish_margin) and cand_len > serve_len
        rec = drafter_pb2.AcceptanceRecord(drafter_version=version, policy_version=self.latest_policy,
                                           candidate_accept_len=cand_len, serving_accept_len=serve_len,
                                           published=False, timestamp=time.time())
        if better and self.publish_fn is not None:
            leaked = [k for k in cand if "embed" in k or "lm_head" in k]
            assert not leaked, f"a drafter push must never carry the target's embedding/lm_head: {leaked}"
            # Owed from now on, and checkpointed as owed: a restart during or after a failed push sends it again
            # (some replicas may serve it), and one after a push that landed learns it is the serving one.
            self._pending, self._pending_at = (cand, version), 0.0
            try:
                self.save_now()  # the rollout will serve `version`: a restart must never number a candidate <= it
            except Exception:
                self._pending = None  # not on disk: not pushed either
                raise
            self.publish_fn(cand, version)  # raises: left pending, retried by the gate loop
            rec.published = True
            self._repush_at = time.monotonic() + REPUSH_S
            with self._lock:  # together: a checkpoint holds the push as owed or as serving, never neither
                self._pending = None
                self.serving, self.serving_version = cand, version
        self._evaluated = version  # after the push: a push that raised leaves this candidate due, retried next gate
        self.m_accept.labels("candidate").set(cand_len)
        self.m_accept.labels("serving").set(rec.candidate_accept_len if rec.published else serve_len)
        with self._lock:
            self.acceptance.append(rec)
            self._save(history_only=not rec.published)  # a published one is written just below
        if rec.published:  # now, not by the background saver: the rollout already serves it
            self.save_now()
        log.info("drafter_evaluated", version=version, candidate=round(cand_len, 3), serving=round(serve_len, 3),
                 steps=count, published=rec.published)
        return rec

    # ---- status
    def status(self, history: bool = True) -> drafter_pb2.DrafterStatus:
        """The service's state; history=False leaves out the training windows and acceptance records (up to
        `history` of each): the answer to a worker's hello and window report, which the worker does not read, sent
        while its replica is busy (two workers' hellos and reports copied 400 records each round)."""
        seqs, toks = self.buffer.stats()
        self.m_buffer.set(seqs)
        self.m_dropped.set(self.buffer.sender_dropped)
        self.m_refused.set(self.buffer.rejected)
        self.m_versions.labels("candidate").set(self.candidate_version)
        self.m_versions.labels("serving").set(self.serving_version)
        self.m_shared.set(self.shared.current.policy_version)
        self.m_shared_failed.set(self.shared.failures)
        now = time.monotonic()
        with self._lock:
            return drafter_pb2.DrafterStatus(
                serving_version=self.serving_version, candidate_version=self.candidate_version,
                latest_policy=common_pb2.WeightVersions(policy=self.latest_policy, drafter=self.serving_version),
                buffer_sequences=seqs, buffer_tokens=toks,
                features_dropped=self.buffer.sender_dropped, features_rejected=self.buffer.rejected,
                deltas_refused=self.deltas_refused,
                workers=[self._worker_status(w, now) for w in self.workers.values()],
                windows=list(self.windows) if history else [], acceptance=list(self.acceptance) if history else [],
                preemptions=self.preemptions,
                shared_policy_version=self.shared.current.policy_version,
                shared_fetch_failures=self.shared.failures, shared_fetch_error=self.shared.last_error)
