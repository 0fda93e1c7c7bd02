"""The coordinator's side of its workers (services/drafter/coordinator.py: `Coordinator` is one).

    worker REQ --WorkerMessage--> ROUTER (`_serve_workers`, one thread) --> `handle`:
        hello          -> joined / alive (heard within `worker_silent_s`), status without history
        pull           -> the candidate and its version
        batch_request  -> a batch from the feature buffer (at most the configured size)
        update         -> `apply_delta`: whole or not at all, once per (worker, base version, payload)
        window         -> the training-window log, preemption count and release histogram

Worker timing constants live here: the worker (worker.py), its client (coordinator_client.py) and the status shown
for a silent worker depend on them together.
"""

from __future__ import annotations

import time

import torch
import zmq

from tlt.services.common.logging import get_logger
from tlt.services.common.weights import unpack
from tlt.services.drafter.training import own_tensors, tensors_message
from tlt.v1 import drafter_pb2, rollout_pb2

log = get_logger("drafter.coordinator")

WORKER_HEARTBEAT_S = 2.0  # a running worker says hello this often, whatever it does (worker.py: its own thread)
WORKER_REQUEST_TIMEOUT_S = 10.0  # a worker's wait for an answer before it asks again on a fresh socket
# A worker not heard from for this long is shown as neither alive nor training (killed, or cut off). A live one is
# heard at least every heartbeat plus the timeout of one unanswered request; twice that leaves room for a slow host.
WORKER_SILENT_S = 2 * (WORKER_HEARTBEAT_S + WORKER_REQUEST_TIMEOUT_S)


class WorkerRequests:
    """The worker-facing half of `Coordinator`: it uses the coordinator's lock, candidate, buffer, history and metrics."""

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
