"""The coordinator's acceptance gate and its pushes to the rollout (services/drafter/coordinator.py: `Coordinator`
is one).

    every 0.2 s (`_gate_loop`, one thread, at SCHED_IDLE with evaluation_sched = idle):
        a push owed (`push_pending`) and the rollout idle --> sent again as it is (renumbered above the rollout's
            version when refused for a drafter this coordinator does not know: `_renumber_pending`)
        a rollout seen on an older drafter it started on --> the serving drafter owed again (`_repush_if_behind`)
        a newer candidate, eval_interval_s since the last evaluation, the rollout idle -->
            newer target embedding / lm_head (`refresh_shared`) --> `evaluate_and_publish`: offline acceptance
            length on held-out data, candidate vs serving --better by publish_margin--> push, serving := candidate
"""

from __future__ import annotations

import time

from tlt.services.common.logging import get_logger
from tlt.services.drafter.acceptance import EvaluationInterrupted, mean_accept_length, same_objects
from tlt.services.drafter.training import build_drafter, own_tensors
from tlt.services.rollout.client import WeightPushError
from tlt.v1 import drafter_pb2

log = get_logger("drafter.coordinator")

PUSH_RETRY_S = 2.0  # a push owed to the rollout (`push_pending`) is retried this often until it lands
REPUSH_S = 10.0  # after a push, a rollout seen on an older drafter is reported only after this long


class PublishGate:
    """The publishing half of `Coordinator`: it uses the coordinator's lock, candidate, serving drafter, buffer,
    shared weights, rollout view and metrics."""

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
