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
This module holds the service's state, threads and checkpoint; the workers' requests are answered in
coordinator_workers.py, the acceptance gate and the pushes run in coordinator_gate.py.
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

from tlt.model.drafter import TRAINER_CHECKPOINT, DrafterError
from tlt.services.common.events import FeatureSource
from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.common.auth import resolve_token
from tlt.services.common.zmq_auth import ZmqAuth
from tlt.services.drafter.buffer import FeatureBuffer
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator_gate import PUSH_RETRY_S, REPUSH_S, PublishGate
from tlt.services.drafter.coordinator_workers import (WORKER_HEARTBEAT_S, WORKER_REQUEST_TIMEOUT_S, WORKER_SILENT_S,
                                                      WorkerRequests)
from tlt.services.drafter.intake import FeatureIntake
from tlt.services.drafter.lineage import identity, moved_aside
from tlt.services.drafter.rollout_idle import RolloutIdle
from tlt.services.drafter.shared import Fetch, SharedTensors, SharedWeights
from tlt.services.drafter.training import build_drafter, load_state, own_tensors, save_atomic, target_shared
from tlt.v1 import common_pb2, drafter_pb2, events_pb2

log = get_logger("drafter.coordinator")

# (own tensors, version) -> pushed, or raises (WeightPushError with the version the rollout serves when it refused)
Publish = Callable[[dict[str, torch.Tensor], int], None]


# a checkpoint write owed for the history only (window reports) waits at most this long for an idle rollout (`_saver`)
HISTORY_SAVE_WAIT_S = 30.0
# a checkpoint write owed for a change of the drafter's state waits at most this long for an idle rollout (`_saver`)
STATE_SAVE_WAIT_S = 5.0
# re-exported: the worker side's and the gate's timing, importable from here as before
__all__ = ["Coordinator", "Publish", "HISTORY_SAVE_WAIT_S", "STATE_SAVE_WAIT_S", "PUSH_RETRY_S", "REPUSH_S",
           "WORKER_HEARTBEAT_S", "WORKER_REQUEST_TIMEOUT_S", "WORKER_SILENT_S"]


class Coordinator(WorkerRequests, PublishGate):
    """The service's state, threads and checkpoint; its workers' requests (coordinator_workers.py) and its
    acceptance gate and pushes (coordinator_gate.py) are its two halves."""

    def __init__(self, config: DrafterServiceConfig, model_dir: str, features: FeatureSource | None,
                 publish: Publish | None, fetch_shared: Fetch | None = None) -> None:
        """`fetch_shared`: where newer target embedding / lm_head come from (shared.rollout_fetch); None: never."""
        self.cfg = config
        self.model_dir = model_dir
        self.features = features
        self.publish_fn = publish
        self.ckpt = Path(config.checkpoint_dir) / TRAINER_CHECKPOINT
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
        self.rollout = (RolloutIdle(config.capacity_pub, config.capacity_snapshot, token=config.control_token)
                        if config.gate_when_idle else None)
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
        token = resolve_token(config.control_token)  # before the context: an unreadable token file leaves none behind
        self._ctx = zmq.Context()
        self._zmq_auth = ZmqAuth(self._ctx, token)  # CURVE under the control token (zmq_auth.py)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self._zmq_auth.bind_or_release((self._router, config.coordinator_bind))
        except (zmq.ZMQError, ValueError):  # ZmqAuthError is a ValueError (ConfigError)
            if self.rollout is not None:
                self.rollout.close()
            raise
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
        self.close_sockets()

    def close_sockets(self) -> None:
        """The ROUTER, the ZAP authenticator its token started (its socket would hold `term` forever) and the
        context: all `close` does once the threads are gone; a caller that never started it may call this alone."""
        self._router.close()
        self._zmq_auth.close()
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
