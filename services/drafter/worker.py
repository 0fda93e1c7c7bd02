"""A drafter worker: trains the drafter on one replica's device, only while that replica is IDLE.

    capacity events (SUB + snapshot) -> state of replica K, and the policy version the rollout serves
    IDLE  -> open a window: if a newer policy was seen, fetch its embedding / lm_head from the rollout
             (GetWeights, shared.py; on failure train on with the old ones); load drafter (candidate
             from the coordinator, sharing them) + optimizer (own checkpoint)
             onto the device; loop { check events; batch from the coordinator; one micro-step;
             every submit_every steps: send delta, checkpoint, re-pull (a BUSY during the send: stop there,
             the checkpoint deferred) }
    BUSY / DRAINING (seen between two micro-steps), or IDLE not heard again (heartbeat or event) for
    `stale_s` (a silent feed: the rollout froze or its network path broke)
          -> stop; copy state off the device and free it
             (`released`), then send the delta, checkpoint atomically, report the window

So a worker never starts a micro-step after its replica turned busy, and a step that sees BUSY at one of its
checkpoints (after the fc, the attention and the output of its forward pass, at its loss, and at three points of its
backward pass: `micro_step(should_stop=...)`) is abandoned before its update: the busy-to-released latency is at most one
stretch between two checkpoints plus the release, a few ms of the replica's time on the tiny model. That is CPU time
(`release_cpu_ms` in the window log); `release_ms` is wall clock, and a worker at worker_nice on a busy CPU replica's
cores waits for the cycles the replica leaves it. The once-a-process optimizer set-up (torch._dynamo's import, ~1 s of
CPU) is paid when the worker starts (`warm_up_optimizer`), not in its first window after the drafter is on the device. Optimizer state
and step counts live in `<checkpoint_dir>/worker-<id>.pt` (atomic rename): after a preemption, a restart or `kill -9` the
worker resumes from the last checkpoint; the work since then is lost, never half-applied (the
coordinator applies a delta whole or not at all). The coordinator connection is a REQ socket with
a timeout; a coordinator that does not answer (its first hello included) makes the worker wait and retry, not
crash. A request a window makes with the drafter on the device (pull, batch, delta) looks at the events every 10 ms
while it waits, and a BUSY gives it up there (CoordinatorInterrupted): a slow coordinator does not keep the device
(a delta given up is sent again with the deferred change; the coordinator applies it once). A batch
request it answers with an error (a batch it cannot build) is skipped, logged, and asked again. A delta
it refuses (e.g. non-finite after a diverged step) is logged and dropped together with the optimizer state
that produced it (back to the last checkpoint), as a kill -9 would lose it; the worker trains on. While it runs,
a thread of its own says hello every `heartbeat_s` (a worker whose replica is busy asks nothing, one in a long step
nothing for a while): the coordinator shows a worker it has not heard from for a while as dead. A restarted worker
trains with the lr and weight_decay of its config (betas fixed, training.make_optimizer), and the optimizer moments of its checkpoint; a
checkpoint of another model's drafter is refused when it starts.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from tlt.services.common.events import CapacitySubscriber
from tlt.services.common.logging import get_logger
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import WORKER_HEARTBEAT_S
from tlt.services.drafter.coordinator_client import (CoordinatorClient, CoordinatorInterrupted, CoordinatorRefused,
                                                     CoordinatorUnavailable)
from tlt.services.drafter.packing import PackedBatch
from tlt.services.drafter.rollout_idle import BUSY_POLL_S, STALE_S, fresh_all_idle
from tlt.services.drafter.shared import Fetch, SharedTensors, SharedWeights
from tlt.model.drafter import Drafter, DrafterError
from tlt.services.drafter.training import load_state, make_optimizer, micro_step, own_tensors, save_atomic, target_shared
from tlt.services.drafter.training import tensors_from, tensors_message, warm_up_optimizer
from tlt.services.drafter.worker_state import WindowResult, cpu_copy, optimizer_misfit
from tlt.v1 import common_pb2, drafter_pb2

log = get_logger("drafter.worker")
IDLE = common_pb2.REPLICA_STATE_IDLE
# other replicas heard for this long and never the worker's own: its replica id is not one the rollout has
# (`tlt drafter serve --workers` over the rollout's replicas), said once in the log
REPLICA_UNHEARD_S = 15.0


@dataclass(frozen=True)
class _Deferred:
    """A preempted window's change and checkpoint, sent and written at the next idle moment."""

    local: dict  # own tensors at the end of the window
    base: dict  # the candidate they started from
    base_version: int
    steps: int  # micro-steps since the last submission (0: only the checkpoint is due)
    losses: list[float]
    opt_state: dict


class DrafterWorker:
    def __init__(self, cfg: DrafterServiceConfig, model_dir: str, worker_id: int, replica_id: int,
                 coordinator: str, fetch_shared: Fetch | None = None) -> None:
        """`fetch_shared`: where newer target embedding / lm_head come from (shared.rollout_fetch); None: never."""
        self.cfg, self.model_dir, self.worker_id, self.replica_id = cfg, model_dir, worker_id, replica_id
        self.device = f"cuda:{replica_id}" if cfg.device.startswith("cuda") else cfg.device
        self.ckpt = os.path.join(cfg.checkpoint_dir, f"worker-{worker_id}.pt")
        saved = load_state(self.ckpt) or {}
        self.drafter_cfg, embed, head = target_shared(model_dir)  # --model is policy version 0
        problem = optimizer_misfit(saved.get("optimizer"), self.drafter_cfg, embed, head)
        if problem is not None:  # else a shape error at the first micro-step of the first idle window, and the end
            raise DrafterError(f"{self.ckpt} holds the optimizer state of another model's drafter ({problem}); give "
                               f"[drafter] checkpoint_dir a folder of its own for --model {model_dir}, or move that "
                               f"file away")
        self.coordinator = coordinator
        self.client = CoordinatorClient(coordinator, worker_id, replica_id, token=cfg.control_token)
        self.heartbeat_s = WORKER_HEARTBEAT_S  # hello from a thread of its own while `run` runs (`_heartbeats`)
        self.sub = CapacitySubscriber(cfg.capacity_pub, cfg.capacity_snapshot, token=cfg.control_token)
        self.state = common_pb2.REPLICA_STATE_UNSPECIFIED
        # train_when = rollout_idle: every replica's last state and when it was heard (monotonic); states
        # not repeated for `stale_s` (a restarted rollout's predecessor) stop counting
        self._states: dict[tuple[str, int], tuple[int, float]] = {}
        self.stale_s = STALE_S
        self._heard = 0.0  # monotonic time `state` was last heard (heartbeats too): see `_idle_now`
        self._fed = False  # an event came through the SUB socket (not only the snapshot): `_silence_hint`
        self._others: set[int] = set()  # replica ids heard of; mine once heard: `_check_replica_known`
        self._mine_heard = False
        self._watching_since: float | None = None  # monotonic, from the first event heard (run)
        self._idle_since = 0.0  # monotonic time the replica last turned IDLE (min_idle_s)
        self.last_busy = 0.0
        self.busy_seen = True  # reset when a window opens on an IDLE replica
        self._idle_cpu = 0.0  # time.process_time() of the window's last look that found its replica idle
        self._deferred: _Deferred | None = None  # what the last window left to send and save (see `window`)
        self.total_steps = int(saved.get("micro_steps", 0))
        self.preemptions = int(saved.get("preemptions", 0))
        self.budget_spent = False  # window_max_steps reached in this idle period of the replica
        self.windows = 0
        self.checkpoint_failures = 0  # optimizer checkpoints that could not be written (retried)
        self._unsaved_opt: dict | None = None  # the optimizer state of the last checkpoint that could not be written
        self.checkpoint_lock = threading.Lock()  # held while the checkpoint is written (worker_main's exit waits)
        self._gen = torch.Generator().manual_seed(worker_id)
        self.shared = SharedWeights(SharedTensors(0, embed, head), fetch_shared)  # on the CPU between windows
        if cfg.threads and self.device == "cpu":
            torch.set_num_threads(cfg.threads)
        if cfg.worker_nice:
            os.nice(cfg.worker_nice)
        if cfg.worker_sched == "idle":
            from tlt.services.common.cpus import run_when_idle

            if run_when_idle():
                log.info("worker_sched", worker=worker_id, sched="idle")
            else:
                log.warning("worker_sched_unsupported", worker=worker_id, detail="no SCHED_IDLE here; niceness only")
        if cfg.pin_cpus and self.device == "cpu":  # the cores of the replica it watches (the rollout's pin_cpus)
            from tlt.services.common.cpus import pin_group

            cores, pinned = pin_group(replica_id, cfg.threads)
            log.info("worker_cpus", worker=worker_id, replica=replica_id, cores=cores, pinned=pinned)
        warm_up_optimizer()  # at its niceness, on its cores, before `run` watches the replica: not in the first window

    # ---- capacity
    def _see(self, event: object) -> None:
        mine = getattr(event, "replica_id", None) == self.replica_id
        if mine:
            self._mine_heard = True
        elif not self._mine_heard:
            self._others.add(int(getattr(event, "replica_id", -1)))
            if self._watching_since is None:
                self._watching_since = time.monotonic()
        if self.cfg.train_when == "always":  # devices of its own: the events say only which policy serves
            if mine:
                self.shared.see(event.versions.policy)  # type: ignore[attr-defined]
            return
        if self.cfg.train_when == "rollout_idle":  # every replica's state counts: idle only when all are
            now = time.monotonic()
            seen = event.state  # type: ignore[attr-defined]
            if seen == common_pb2.REPLICA_STATE_DRAINING and event.running + event.queued:  # type: ignore[attr-defined]
                seen = common_pb2.REPLICA_STATE_BUSY  # still finishing sequences (a server stopping): as RolloutIdle
            self._states[(event.server_id, event.replica_id)] = (seen, now)  # type: ignore[attr-defined]
            state = IDLE if fresh_all_idle(self._states, now, self.stale_s) else common_pb2.REPLICA_STATE_BUSY
        elif not mine:
            return
        else:
            state = event.state  # type: ignore[attr-defined]
        self._heard = time.monotonic()
        if mine:
            self.shared.see(event.versions.policy)  # type: ignore[attr-defined]
        if state != IDLE:
            self.budget_spent = False  # window_max_steps: a new idle period may train again
        if state == IDLE and self.state != IDLE:
            self._idle_since = time.monotonic()
        if state != IDLE and not self.busy_seen:
            # the FIRST non-idle event since the window opened ends it, even when the replica is idle
            # again by the time we read it (a short request arrived during a long step)
            self.busy_seen = True
            self.last_busy = float(event.timestamp)  # type: ignore[attr-defined]
        self.state = state

    def _busy_now(self) -> bool:
        """Read the queued events: has the window's replica turned busy (or the feed gone silent)?"""
        self._poll_events(0.0)
        return self.busy_seen

    def _idle_now(self) -> bool:
        """The last state is IDLE and was heard within `stale_s`: a feed gone silent (a frozen, stopped or
        cut-off rollout still holding its port) no longer counts as idle, as in RolloutIdle. Always, with
        train_when = always."""
        if self.cfg.train_when == "always":
            return True
        return self.state == IDLE and time.monotonic() - self._heard < self.stale_s

    def _may_train(self) -> bool:
        """The replica is idle, has been for `min_idle_s`, and this idle period's budget (window_max_steps) is
        not used up."""
        if self.cfg.train_when == "always":  # no idle periods: window_max_steps bounds each window only
            return True
        settled = time.monotonic() - self._idle_since >= self.cfg.min_idle_s
        return self._idle_now() and settled and not self.budget_spent

    def _check_silence(self) -> None:
        """An IDLE gone stale ends an open window as a BUSY event would, dated when it went stale."""
        if self.busy_seen or self.state != IDLE or self._idle_now():
            return
        self.busy_seen = True
        self.last_busy = time.time() - (time.monotonic() - self._heard - self.stale_s)
        log.warning("capacity_feed_silent", worker=self.worker_id, replica=self.replica_id,
                    silent_s=round(time.monotonic() - self._heard, 2), capacity_pub=self.cfg.capacity_pub,
                    hint=self._silence_hint())

    def _silence_hint(self) -> str:
        """What a silent feed most likely means: a SUB that never got an event (its snapshot answered, its
        heartbeats never came) names a socket that is not the rollout's PUB; one that did, a rollout gone quiet."""
        if not self._fed:
            return (f"no event or heartbeat has come through capacity_pub {self.cfg.capacity_pub} since the "
                    f"snapshot from {self.cfg.capacity_snapshot} answered: if the rollout is up, check that "
                    "capacity_pub names its capacity PUB socket and is reachable from here; no window opens until "
                    "the feed speaks")
        return ("the rollout's heartbeats (about one a second) stopped: it froze, stopped or lost its network path; "
                "no window opens until it speaks again")

    def _poll_events(self, timeout_s: float) -> None:
        """Read EVERY queued event (heartbeats pile up during a long step), waiting up to `timeout_s` for one."""
        deadline = time.monotonic() + timeout_s
        while True:
            e = self.sub.recv(max(0.0, deadline - time.monotonic()))  # 0: what is queued, without waiting
            if e is None:
                break
            self._fed = True
            self._see(e)
            deadline = time.monotonic()  # got one: drain the rest without waiting
        self._check_silence()  # after draining: heartbeats queued during a long step are not silence
        self._check_replica_known()
        if not self.busy_seen:
            self._idle_cpu = time.process_time()

    def _mark_released(self, res: WindowResult) -> None:
        """The device is free: when (wall clock), and the worker's CPU since its last look found the replica idle."""
        res.released, res.release_cpu = time.time(), time.process_time() - self._idle_cpu

    def _check_replica_known(self) -> None:
        """Say once when the rollout's other replicas have been heard for REPLICA_UNHEARD_S (their heartbeats) and
        this worker's never: it watches a replica the rollout does not have, and with train_when = replica_idle
        never trains (more `--workers` than rollout replicas). A warning: a rollout restarted with more replicas
        brings it to life."""
        if self._mine_heard or self._watching_since is None or self._watching_since < 0:
            return
        if time.monotonic() - self._watching_since < REPLICA_UNHEARD_S:
            return
        self._watching_since = -1.0  # said
        heard = sorted(self._others)
        log.warning("worker_replica_unknown", worker=self.worker_id, replica=self.replica_id, rollout_replicas=heard,
                    hint=f"the rollout has replicas {heard}, none {self.replica_id}: start `tlt drafter serve` with "
                         f"--workers {len(heard)} (one worker per rollout replica)"
                         + (", this one never trains" if self.cfg.train_when == "replica_idle" else ""))

    def _snapshot(self, stop: object) -> bool:
        """Every replica's state from the rollout's snapshot socket, asked again until it answers (False: `stop`
        came first). A rollout slower to start than the worker, restarting, or answering garbage makes the
        worker wait: an exception here ended a `tlt drafter worker` process for good (nothing restarts it)."""
        failures = 0
        while not (stop is not None and stop.is_set()):  # type: ignore[attr-defined]
            try:
                for e in self.sub.snapshot(timeout_s=2.0):
                    self._see(e)
                return True
            except (TimeoutError, ValueError) as e:
                failures += 1
                if failures == 1:  # once: a rollout still loading would repeat it every 2 s
                    log.warning("capacity_snapshot_retry", worker=self.worker_id, error=str(e)[:300])
                time.sleep(0.5)
        return False

    # ---- main loop
    def run(self, stop: object = None, max_windows: int | None = None) -> None:
        """Until `stop.is_set()` (a threading.Event-like) or `max_windows` windows ran."""
        if not (self._snapshot(stop) and self._hello(stop)):
            return
        log.info("worker_started", worker=self.worker_id, replica=self.replica_id, device=self.device,
                 resumed_steps=self.total_steps)
        beating = threading.Event()
        heart = threading.Thread(target=self._heartbeats, args=(beating,), daemon=True,
                                 name=f"drafter-worker-{self.worker_id}-hello")
        heart.start()
        try:
            while not (stop is not None and stop.is_set()):  # type: ignore[attr-defined]
                if max_windows is not None and self.windows >= max_windows:
                    return
                if self._may_train():
                    self._poll_events(0.0)  # the latest state, not a stale one
                elif self.state != IDLE:  # the rollout decodes: read what queued every BUSY_POLL_S, not each event
                    _rest(stop, BUSY_POLL_S)
                    self._poll_events(0.0)
                else:
                    self._poll_events(0.2)
                if not self._may_train():
                    continue
                failed = False
                try:
                    self.window(stop)
                except CoordinatorUnavailable as e:
                    log.warning("coordinator_unavailable", error=str(e))
                    failed = True
                if failed:  # out of the except block: its traceback no longer holds the window's frame, so the
                    if self.device.startswith("cuda"):  # drafter and optimizer are gone; hand their memory back
                        gc.collect()  # to the replica now, not after the next window
                        torch.cuda.empty_cache()
                    time.sleep(1.0)
        finally:
            try:
                self._flush()  # leaving: nothing deferred may be lost
            except CoordinatorUnavailable as e:
                log.warning("final_flush_failed", error=str(e))
            beating.set()
            heart.join(1.0)  # a hello still waiting on a silent coordinator ends on its own (a daemon thread)

    def _heartbeats(self, stop: threading.Event) -> None:
        """Say hello every `heartbeat_s` until `stop`, whatever the worker does: the coordinator shows a worker it has
        not heard from for WORKER_SILENT_S as neither alive nor training (killed), and a worker whose replica is busy
        asks it nothing, one in a long micro-step, checkpoint or GetWeights fetch nothing for a while. Its own socket
        (a ZeroMQ socket belongs to one thread); the main loop reports an unavailable coordinator."""
        client = CoordinatorClient(self.coordinator, self.worker_id, self.replica_id, token=self.cfg.control_token)
        hello = drafter_pb2.WorkerHello(worker_id=self.worker_id, replica_id=self.replica_id, pid=os.getpid())
        try:
            while not stop.wait(self.heartbeat_s):
                client.shared_policy_version = self.client.shared_policy_version  # every message sets them in status
                client.shared_fetch_failures = self.client.shared_fetch_failures
                try:
                    client.ask(hello=hello)
                except (CoordinatorUnavailable, CoordinatorRefused):
                    continue
        finally:
            client.close()

    def _hello(self, stop: object) -> bool:
        """Say hello to the coordinator, asked again until it answers (False: `stop` came first). A coordinator not
        up yet or restarting (after a kill -9) made the worker's process exit for good: nothing restarts it."""
        failures = 0
        while not (stop is not None and stop.is_set()):  # type: ignore[attr-defined]
            try:
                self.client.ask(hello=drafter_pb2.WorkerHello(worker_id=self.worker_id, replica_id=self.replica_id,
                                                              pid=os.getpid()))
                return True
            except CoordinatorUnavailable as e:
                failures += 1
                if failures == 1:  # once: a coordinator still starting would repeat it every timeout
                    log.warning("coordinator_hello_retry", worker=self.worker_id, error=str(e)[:300])
                time.sleep(0.5)
        return False

    def window(self, stop: object = None) -> WindowResult:
        """One training window on an idle replica; returns when it turns busy (or `stop`)."""
        start = time.time()
        res = WindowResult()
        self.busy_seen, self.last_busy, self._idle_cpu = False, 0.0, time.process_time()
        self.shared.refresh()  # between windows only: a window trains with one embedding / lm_head throughout
        self.client.shared_policy_version = shared_version = self.shared.current.policy_version
        self.client.shared_fetch_failures = self.shared.failures
        # The fetch takes seconds on a real model: a BUSY that came meanwhile ends the window before anything else
        # runs on the replica's time (what the last window deferred stays deferred).
        self._poll_events(0.0)
        # what the last window left for an idle moment: this is one. Before anything goes on the device, and before
        # reading the checkpoint, which only then holds the optimizer state the last window ended with
        if self.busy_seen or self._flush(stop_on_busy=True):  # busy during the fetch or the send: nothing trains
            res.preempted = True
            self._mark_released(res)
            return self._close_window(res, start, shared_version)
        embed, head = self.shared.current.embed, self.shared.current.lm_head
        drafter = Drafter(self.drafter_cfg, embed.to(self.device), head.to(self.device)).to(self.device)
        opt = make_optimizer(drafter, self.cfg.lr, self.cfg.weight_decay)
        self._restore_optimizer(opt)

        def interrupt() -> bool:  # asked while the coordinator answers: the drafter is on the device meanwhile
            return self._busy_now() or (stop is not None and stop.is_set())  # type: ignore[attr-defined]

        base, base_version, since_submit = {}, 0, 0
        saved = False  # the window ends right after its checkpoint was written: nothing left to defer
        try:  # a request given up for a BUSY (`interrupt`): what the window did since its last send is deferred
            base, base_version = self._pull(drafter, interrupt)
            while True:
                if interrupt():
                    res.preempted = self.busy_seen
                    break
                try:
                    reply = self.client.ask(batch_request=drafter_pb2.BatchRequest(
                        rows=self.cfg.batch_rows, max_tokens=self.cfg.batch_tokens), should_stop=interrupt)
                except CoordinatorRefused as e:  # one bad batch: skip it; dying would not make the next one better
                    log.warning("batch_refused", worker=self.worker_id, error=str(e)[:300])
                    self._poll_events(0.5)  # do not spin on the coordinator; a BUSY event still ends the window at once
                    continue
                self.shared.see(reply.batch.policy_version)  # used from the next window on
                if reply.batch.rows == 0:
                    self._poll_events(0.05)  # nothing to train on yet; keep listening
                    continue
                if self._busy_now():  # turned busy while the batch came: do not start the step
                    res.preempted = True
                    break
                res.last_step_start = time.time()
                loss = micro_step(drafter, opt, PackedBatch.from_proto(reply.batch), self.cfg.grad_clip,
                                  self.cfg.feature_noise, self._gen, ttt_steps=self.cfg.ttt_steps,
                                  should_stop=self._busy_now)
                if loss is None:  # turned busy during the step: abandoned at a checkpoint, before its update
                    res.preempted = res.abandoned = True
                    break
                res.micro_steps += 1
                res.losses.append(float(loss.loss))
                del loss
                since_submit += 1
                if self._busy_now():  # turned busy during the step: stop now; a due submission waits (deferred)
                    res.preempted = True
                    break
                if since_submit >= self.cfg.submit_every:
                    busy = self._submit(drafter, base, base_version, since_submit, res, opt, interrupt)
                    since_submit = 0
                    if busy:  # turned busy during the send: the checkpoint waits (deferred), no re-pull
                        res.preempted = True
                        break
                    if self._busy_now():  # turned busy during the checkpoint: release now; the next window pulls
                        res.preempted = True
                        break
                    if self.cfg.train_when == "always":  # a window per submission: the next one fetches a newer
                        saved = self._unsaved_opt is None  # policy's embedding / lm_head (shared.refresh runs between
                        break  # windows only); what it leaves is sent and, unless the write failed, saved
                    base, base_version = self._pull(drafter, interrupt)
                if self.cfg.window_max_steps and res.micro_steps >= self.cfg.window_max_steps:
                    if since_submit:  # the replica is still idle: send the change now rather than defer it
                        busy = self._submit(drafter, base, base_version, since_submit, res, opt, interrupt)
                        since_submit = 0
                        if busy:  # a BUSY ends this idle period (and its budget) as in the loop above
                            res.preempted = True
                            break
                    self.budget_spent = True  # no more training until the replica is busy and idle again
                    break
        except CoordinatorInterrupted:  # turned busy while the coordinator answered (or stopped)
            res.preempted = self.busy_seen
        # stop: copy what must survive off the device, then free the device
        local = own_tensors(drafter)
        opt_state = cpu_copy(opt.state_dict())
        alive = weakref.ref(drafter)
        del drafter, opt
        if alive() is not None:  # normally freed by refcount at once; a cycle needs the (slow, ~1 s) collector
            gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        self._mark_released(res)
        self.total_steps += res.micro_steps
        # The replica is busy again: sending the change and writing the checkpoint would take CPU from it,
        # so they wait for the next idle window, or `run`'s exit (`_flush`); a kill -9 before then loses
        # at most these `since_submit` micro-steps and the worker resumes from the last checkpoint.
        self._deferred = None if saved else _Deferred(local, base, base_version, since_submit,
                                                      res.losses[-since_submit:] if since_submit else [], opt_state)
        return self._close_window(res, start, shared_version)

    def _close_window(self, res: WindowResult, start: float, shared_version: int) -> WindowResult:
        """Count a preemption and report the window to the coordinator (its training-window log)."""
        if res.preempted:
            res.busy_timestamp = self.last_busy
            self.preemptions += 1
        win = drafter_pb2.TrainingWindow(
            worker_id=self.worker_id, replica_id=self.replica_id, start=start, end=res.released,
            micro_steps=res.micro_steps, preempted=res.preempted, busy_timestamp=res.busy_timestamp,
            released=res.released, last_step_start=res.last_step_start, mean_loss=sum(res.losses) / len(res.losses) if res.losses else 0.0,
            shared_policy_version=shared_version)
        self.client.ask(window=win)
        self.windows += 1
        log.info("training_window", worker=self.worker_id, replica=self.replica_id, steps=res.micro_steps,
                 preempted=res.preempted, release_ms=round(1000 * (res.released - res.busy_timestamp), 1)
                 if res.preempted else None, release_cpu_ms=round(1000 * res.release_cpu, 1) if res.preempted else None,
                 abandoned_step=res.abandoned)
        return res

    # ---- state
    def _pull(self, drafter: torch.nn.Module, interrupt: Callable[[], bool]) -> tuple[dict[str, torch.Tensor], int]:
        cand = self.client.ask(pull=drafter_pb2.PullCandidate(), should_stop=interrupt).candidate
        tensors = tensors_from(cand.manifest, cand.payload)
        drafter.load_tensors(tensors)  # type: ignore[operator]
        return tensors, cand.version

    def _flush(self, stop_on_busy: bool = False) -> bool:
        """Send the change and write the checkpoint the last window deferred (see `window`).

        stop_on_busy (an idle moment, not the exit): when the replica turned busy during the send, the checkpoint
        waits again (the change is sent: only it stays deferred) and this returns True. A checkpoint that cannot be
        written (a full disk) stays deferred too: logged, retried at the next idle moment."""
        d = self._deferred
        if d is None:
            return False
        if d.steps:
            if not self._send_delta(d.local, d.base, d.base_version, d.steps, d.losses):  # unavailable: raises, kept
                self._deferred = None  # refused: its optimizer state goes too; the next window loads the checkpoint
                return False
            self._deferred = d = replace(d, steps=0, losses=[])  # sent: never again
            if stop_on_busy:
                if self._busy_now():
                    return True
        if self._checkpoint(d.opt_state):
            self._deferred = None
        return False

    def _send_delta(self, local: dict, base: dict, base_version: int, steps: int, losses: list[float],
                    interrupt: Callable[[], bool] | None = None) -> bool:
        """False when the coordinator refused it (logged): resending the same delta would be refused again, and
        dying would stop this worker for good, so the caller drops it. CoordinatorInterrupted: `interrupt` said stop
        before the answer came (it may have landed: sent again later, the coordinator applies it once)."""
        delta = {k: local[k] - base[k] for k in local}
        m, p = tensors_message(delta, base_version)
        loss = sum(losses) / max(1, len(losses))
        try:
            self.client.ask(update=drafter_pb2.DeltaUpdate(base_version=base_version, manifest=m, payload=p,
                                                           micro_steps=steps, mean_loss=loss), should_stop=interrupt)
        except CoordinatorRefused as e:
            log.warning("delta_refused", worker=self.worker_id, base_version=base_version, steps=steps,
                        error=str(e)[:300])
            return False
        return True

    def _submit(self, drafter: torch.nn.Module, base: dict, base_version: int, steps: int, res: WindowResult,
                opt: torch.optim.Optimizer, interrupt: Callable[[], bool]) -> bool:
        """Send the window's change, then checkpoint the optimizer, unless the replica turned busy during the
        send: then the checkpoint (twice the drafter's size) waits for the next idle moment, as after any
        preemption, and this returns True (the caller ends the window)."""
        if not self._send_delta(own_tensors(drafter), base, base_version, steps, res.losses[-steps:],  # type: ignore[arg-type]
                                interrupt):
            self._restore_optimizer(opt)  # the optimizer state that made the refused delta must not go on
            return False
        if self._busy_now():
            return True
        self._checkpoint(cpu_copy(opt.state_dict()), extra_steps=res.micro_steps)  # failed: the window's end defers one
        return False

    def _restore_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """The last saved optimizer state: the checkpoint's, or the newer one a failed write left in memory (a
        full disk; reading the file went back to an older state, and the next write lost the newer one), or a
        fresh one when there is neither. The moments and step counts are the saved ones; the settings (lr,
        weight_decay, betas) stay those `opt` was made with, the config's: `load_state_dict` brings back the saved
        ones too, and a worker restarted with a new lr (e.g. lowered after diverged steps) trained with the old."""
        state = self._unsaved_opt
        if state is None:
            saved = load_state(self.ckpt)
            state = saved.get("optimizer") if saved is not None else None
        else:  # a copy: load_state_dict keeps the tensors it is given (same device), and training changed the kept
            state = cpu_copy(state)  # state in place (a second refused delta went back to the steps the first dropped)
        if state:
            settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            opt.load_state_dict(state)
            for group, own in zip(opt.param_groups, settings):
                group.update(own)
        else:
            opt.state.clear()

    def _checkpoint(self, opt_state: dict, extra_steps: int = 0) -> bool:
        """Write the optimizer checkpoint; False (logged, counted) when it cannot be written: one failed write (a
        full disk) stopped the worker's process for good, and nothing restarts it; the coordinator's own checkpoint
        failures are retried the same way."""
        try:
            with self.checkpoint_lock:
                save_atomic(self.ckpt, {"optimizer": opt_state, "micro_steps": self.total_steps + extra_steps,
                                        "preemptions": self.preemptions})
        except OSError as e:
            self.checkpoint_failures += 1
            self._unsaved_opt = opt_state  # what the checkpoint holds for now (_restore_optimizer)
            log.error("worker_checkpoint_failed", worker=self.worker_id, path=str(self.ckpt), error=repr(e)[:300])
            return False
        self._unsaved_opt = None
        return True

    def close(self) -> None:
        self.sub.close()
        self.client.close()


def _rest(stop: object, seconds: float) -> None:
    """Sleep `seconds`, or less when `stop` (a threading.Event-like) is set meanwhile."""
    wait = getattr(stop, "wait", None)
    if wait is not None:
        wait(seconds)
    else:
        time.sleep(seconds)
