"""The GRPO training loop against running rollout (and optionally reward) services.

    resume (checkpoint) -> sync weights with the rollout server(s)
    per step:
      prompts (PromptSampler) -> collect (rollout stream + rewards as they finish)
      -> check every completion came from the current policy version
      -> [lend_rollout_devices: borrow the rollout's devices (colocate.py)]
      -> grpo_step (old logprobs, advantages, DeepSpeed update, version + 1)
      -> [give the devices back] -> push weights -> metrics.jsonl line -> held-out eval (when due) -> checkpoint
    held-out eval (evaluate.py): before step 0, every eval_interval steps, after the last -> eval.jsonl
    end: final checkpoint, a record that the export has begun, the trained policy as a Hugging Face folder
         (output_dir/policy) and, last, the record of the steps it was trained for replacing the first
         (policy/tlt_export.json, run_folder.py: an export cut short still says "exporting")

Under the DeepSpeed launcher with W ranks, rank 0 alone talks to the
services (rollout, rewards, pushes) and writes metrics; it broadcasts each
step's scored completions and every rank trains on its share (step.py).
Under ZeRO-3 (parameters partitioned) reading the whole weights is a
collective: every rank takes part in each push's gather and in the final
export (Policy.save_pretrained), and rank 0 alone sends / writes them.
A rollout server restarted mid-run needs the weights again while rank 0
is rolling out or evaluating: the other ranks then wait in a broadcast
(the step's rollout, or the end of the step's eval, `_meet`), and rank 0
calls them into the gather through it (`GATHER`, `_follow`).

Exactly-once bookkeeping: a step's metrics line is written before its
checkpoint; on resume from the checkpoint after k steps, lines of steps >= k
(written by the killed run after its last checkpoint) are dropped, and those
steps run again from the same data position. When the kill fell between a
push and the next checkpoint, the rollout server serves a newer version than
the resumed trainer: `sync_version` + a push send the resumed weights under a newer
version number (versions only grow), so rollouts never mix the two.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.run_stats import json_line

log = get_logger("trainer")
# Copied from the input model into the export: every file a tokenizer's save_pretrained writes, for the fast
# (tokenizer.json) and the slow forms (sentencepiece tokenizer.model / spiece.model, BPE vocab.json + merges.txt,
# WordPiece vocab.txt, added_tokens.json), and the generation config. A model that ships only tokenizer.model
# exported with no tokenizer at all.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt", "generation_config.json")


@dataclass(frozen=True)
class TrainSummary:
    steps_done: int
    policy_version: int
    resumed_from: int | None
    output_dir: str


def sync_version(policy, clients, probes: dict | None = None) -> bool:  # noqa: ANN001
    """Before the first rollout (rank 0): True when the rollout servers must get the trainer's weights pushed,
    under `policy.version`, raised here past every server's own version. `probes`: `probe_values(policy)`, read here
    when not given; under ZeRO-3 every rank must have gathered them together before (none given: no comparison)."""
    serving = [c.status().versions.policy for c in clients]
    if all(v == policy.version for v in serving):
        # a resume that pushed this very version; or a fresh start (both 0), where equal versions prove nothing: a
        # rollout started from another checkpoint of the same shapes would sample every rollout from that model
        if policy.version > 0:
            return False
        if probes is None and policy.gathers:  # not gathered: unknown, as before session 55
            return False
        probes = probes if probes is not None else probe_values(policy)
        if all(_serves_these_weights(probes, c) for c in clients):
            return False
        log.warning("rollout_serves_other_weights", action="pushing the trainer's weights before the first rollout")
    # Servers refuse a version not newer than their own, and one server may lag the others (restarted).
    policy.version = max(policy.version, max(serving) + 1)
    return True


def probe_values(policy) -> dict:  # noqa: ANN001
    """The policy's smallest matrix and smallest vector (a few MB for a 7B model) by name, on CPU: what the startup
    sync compares with a rollout's start checkpoint. Under ZeRO-3 (shapes read from `ds_shape`) the two are gathered:
    a collective, every rank calls it."""
    import math

    from tlt.services.trainer.weight_sync import partitioned

    params = dict(policy.module.named_parameters())
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in params.items()}
    names = [min((math.prod(s), n) for n, s in shapes.items() if len(s) == dim)[1] for dim in (2, 1)
             if any(len(s) == dim for s in shapes.values())]
    if not partitioned(policy.module):
        return {n: params[n].detach().to("cpu", copy=True) for n in names}
    import deepspeed

    with deepspeed.zero.GatheredParameters([params[n] for n in names], modifier_rank=None):
        return {n: params[n].detach().to("cpu", copy=True) for n in names}


def _serves_these_weights(probes: dict, client) -> bool:  # noqa: ANN001
    """Whether the rollout's start checkpoint holds the trainer's weights, by the `probes` (probe_values), compared
    exactly in the dtype the rollout serves them in."""
    import grpc
    import torch

    try:
        _, served = client.get_weights(list(probes))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return False  # a tensor the rollout's model lacks: not this model (the push says what differs)
    return all(torch.equal(served[n], t.to("cpu", served[n].dtype)) for n, t in probes.items())


def sync_weights(policy, publisher, clients) -> None:  # noqa: ANN001
    """Make every rollout server serve the trainer's weights before the first rollout (one process; `train`
    runs the two halves itself, so that under ZeRO-3 every rank takes part in the push's gather)."""
    probes = probe_values(policy) if policy.version == 0 and getattr(policy, "gathers", False) else None
    if sync_version(policy, clients, probes):
        publisher.push(push_tensors(policy), policy.version)


def push_tensors(policy):  # noqa: ANN001, ANN201
    """The weights as the rollout gets them. Under ZeRO-3 a collective: every rank calls it, rank 0 gets them."""
    from tlt.services.trainer.weight_sync import policy_tensors, resolve_dtype

    return policy_tensors(policy.module, resolve_dtype(policy.cfg.push_dtype, policy.bf16))


# What rank 0 broadcasts, under ZeRO-3 with several ranks, to the other ranks waiting on its rollout or eval: GATHER
# (join a gather of the weights: a restarted rollout server is pushed them again), then DONE after an eval.
GATHER, DONE = "tlt:gather-the-weights", "tlt:eval-done"


def _gathered_by_every_rank(policy):  # noqa: ANN001, ANN202
    """Rank 0, mid-rollout or mid-eval: the weights for a repush, every other rank called into the gather."""
    from tlt.services.trainer.distributed import broadcast

    broadcast(GATHER)
    return push_tensors(policy)


def _follow(policy, value):  # noqa: ANN001, ANN202
    """The other ranks, given rank 0's broadcast `value`: join each gather it calls for until it sends another."""
    from tlt.services.trainer.distributed import broadcast

    while isinstance(value, str) and value == GATHER:
        push_tensors(policy)  # this rank's part; rank 0 keeps the tensors and pushes them
        value = broadcast(None)
    return value


def _meet(policy, services) -> None:  # noqa: ANN001
    """After rank 0's eval (which may have repushed), under ZeRO-3 with several ranks: every rank on together."""
    from tlt.services.trainer.distributed import broadcast

    if services is not None:
        broadcast(DONE)
    elif (done := _follow(policy, broadcast(None))) != DONE:
        raise RuntimeError(f"rank 0 sent {done!r} where the end of its eval was due: the ranks are out of step")


def train(cfg: TrainerConfig) -> TrainSummary:
    from tlt.services.trainer.checkpoint import CheckpointManager
    from tlt.services.trainer.data import PromptSampler, trainer_prompts
    from tlt.services.trainer.distributed import broadcast, is_main, world_size
    from tlt.services.trainer.policy import Policy, ReferencePolicy
    from tlt.services.trainer.step import grpo_step

    from tlt.services.trainer.evaluate import eval_items

    sampler = PromptSampler(trainer_prompts(cfg), cfg.seed)  # every rank keeps the same position (checkpoints)
    # the eval set too, before the policy loads (minutes for a large model): a file the reward cannot read is refused
    # now, as the data file is; every rank reads it, so that every rank stops alike
    held_out = eval_items(cfg) if cfg.eval_problems else []
    policy = Policy(cfg)
    reference = None
    if cfg.kl_beta > 0:
        import torch

        ref_dtype = torch.bfloat16 if policy.bf16 else torch.float32
        reference = ReferencePolicy(cfg.reference_model_dir or cfg.model_dir, policy.device, cfg.temperature, ref_dtype,
                                    vocab_size=policy.model_config.vocab_size)
    out = Path(cfg.output_dir)
    ckpt = CheckpointManager(out / "checkpoints", cfg.keep_checkpoints)
    start, resumed_from = 0, None
    if cfg.resume and (state := ckpt.load(policy, sampler)) is not None:
        start = resumed_from = state.steps_done
    # Rank 0 talks to the services and writes the run's files; other ranks only train.
    services = _Services(cfg, out, start, held_out) if is_main() else None
    features = _FeatureHook(cfg.drafter_features_address, cfg.rollout_token) if cfg.drafter_features_address else None
    try:
        # a fresh start compares two weights with the rollout's (sync_version): under ZeRO-3 every rank gathers them
        probes = probe_values(policy) if policy.gathers and policy.version == 0 else None
        synced = services.sync(policy, probes) if services else None  # rank 0: (version, whether to push it)
        del probes
        policy.version, push_due = broadcast(synced)
        if push_due:  # every rank: under ZeRO-3 the gather is a collective; rank 0 sends
            tensors = push_tensors(policy)
            if services:
                services.publisher.push(tensors, policy.version)
            del tensors
        together = policy.gathers and world_size() > 1  # reading the weights is a collective of every rank
        if services:  # a rollout server restarted mid-run gets the weights again
            services.allow_repush(lambda: _gathered_by_every_rank(policy) if together else push_tensors(policy))
        if services and start == 0:
            services.evaluate(0, policy.version)
        if together:
            _meet(policy, services)
        for step in range(start, cfg.steps):
            t_step, t_wall = time.perf_counter(), time.time()
            prompts = sampler.next_batch(cfg.prompts_per_step)
            more = lambda: sampler.next_batch(cfg.prompts_per_step)  # noqa: E731 - dynamic sampling's next round
            rollout = services.rollout(prompts, step, policy.version, more) if services else None
            rollout = broadcast(rollout)
            if services is None:
                rollout = _follow(policy, rollout)  # a repush mid-rollout: each gather rank 0 called for first
                for _ in range(rollout.rounds - 1):  # the samplers move on as rank 0's did (their checkpoints agree)
                    more()
            if rollout.selection is not None:
                prompts = rollout.selection.prompts
            lend_s = services.borrow() if services else 0.0
            result = grpo_step(policy, rollout.samples, step, reference, with_features=features is not None)
            m = result.metrics
            if features is not None:  # hidden states of the pre-update weights: version - 1
                m.times["features_push_s"] = features.push(result, policy.version - 1)
            if services and services.loan is not None:
                m.times["lend_s"] = lend_s + services.give_back()
            m.times.update(rollout.times)
            m.sd_verify_steps, m.sd_accepted_tokens = rollout.spec.verify_steps, rollout.spec.accepted_tokens
            m.sd_plain_steps, m.drafter_version = rollout.spec.plain_steps, rollout.spec.drafter_version
            m.sd_response_tokens = rollout.spec.response_tokens
            m.rollout_retries = rollout.retries
            m.reward_loop_blocked = services.reward_loop_blocked() if services else 0
            _record_sampling(m, rollout, cfg.prompts_per_step)
            m.started_at = t_wall
            done = step + 1
            if services:
                services.publish(policy, m, prompts, t_step)
                services.evaluate(done, policy.version)
            elif policy.gathers and cfg.weight_push != "none":
                push_tensors(policy)  # ZeRO-3: this rank's part of the gather rank 0 pushes (it keeps nothing)
            if together:
                _meet(policy, services)
            if done == cfg.steps or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0):
                ckpt.save(policy, sampler, done)
        steps_done = max(start, cfg.steps)
        if services:  # first a record saying the export has begun: one cut short is known as such (run_folder)
            services.export_begins(steps_done, policy.version)
        policy.save_pretrained(str(out / "policy"))  # every rank (ZeRO-3 gathers); rank 0 writes
        if services:
            services.export(steps_done, policy.version)
    finally:
        if services:
            services.close()
        if features is not None:
            features.close()
    return TrainSummary(steps_done, policy.version, resumed_from, str(out))


WAIT_QUIET_S = 2.0  # a service not up within this long at start is named in the log while the trainer waits on


def _wait_for(service: str, address: str, wait: Callable[[float], None], timeout_s: float) -> None:
    """`wait(timeout_s)` for a service at start, saying so (`waiting_for_service`) once it is not up within
    WAIT_QUIET_S, and when it comes up after that: a trainer started beside its services (compose) or given a
    wrong address sat silent for up to connect_timeout_s each. What `wait` raises propagates."""
    import threading

    began = time.monotonic()
    said = threading.Event()

    def say() -> None:
        said.set()
        log.info("waiting_for_service", service=service, address=address, timeout_s=timeout_s,
                 hint=f"not up after {WAIT_QUIET_S:g} s; waiting up to connect_timeout_s")

    timer = threading.Timer(WAIT_QUIET_S, say)
    timer.daemon = True
    timer.start()
    try:
        wait(timeout_s)
    finally:
        timer.cancel()
    if said.is_set():
        log.info("service_ready", service=service, address=address, waited_s=round(time.monotonic() - began, 1))


class _FeatureHook:
    """Hands the old-logprob pass's hidden states to the drafter (TLT.md section 6); drops, never waits."""

    def __init__(self, address: str, token: str = "") -> None:
        from tlt.services.common.events import FeaturePusher

        self.pusher = FeaturePusher(address, token=token)  # CURVE under the control token (zmq_auth.py)

    def push(self, result, version: int) -> float:  # noqa: ANN001 - StepResult
        from tlt.services.drafter.trainer_hook import push_trainer_features

        t0 = time.perf_counter()
        mine = [(s, h) for s, h in zip(result.ordered, result.features or []) if h is not None]
        if mine:
            sent = push_trainer_features(self.pusher, [list(s.prompt_ids) + list(s.response_ids) for s, _ in mine],
                                         [h for _, h in mine], [len(s.prompt_ids) for s, _ in mine], version,
                                         groups=[f"p{s.prompt_index}" for s, _ in mine])
            if not sent:
                log.debug("features_dropped", sequences=len(mine), dropped_total=self.pusher.dropped)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pusher.close()


class _Services:
    """Rank 0's side of the loop: rollout + reward clients, weight pushes, metrics, the final export."""

    def __init__(self, cfg: TrainerConfig, out: Path, start: int, eval_set: list | None = None) -> None:
        from tlt.services.rollout.client import RolloutClient
        from tlt.services.trainer.collect import training_params
        from tlt.services.trainer.rewards import make_reward_source

        self.cfg, self.out = cfg, out
        out.mkdir(parents=True, exist_ok=True)
        from tlt.services.trainer.evaluate import eval_items, trim_evals
        from tlt.services.trainer.run_stats import trim_jsonl

        self.metrics_path = out / "metrics.jsonl"
        self.eval_path = out / "eval.jsonl"
        if start:
            trim_jsonl(self.metrics_path, lambda m: m["step"] < start)
        else:
            self.metrics_path.unlink(missing_ok=True)
        trim_evals(self.eval_path, start)
        # (train() reads it before the policy loads)
        self.eval_items = eval_set if eval_set is not None else eval_items(cfg) if cfg.eval_problems else []
        self.prom = Metrics("trainer")
        self.g_step = self.prom.gauge("step", "RL steps done")
        self.g_reward = self.prom.gauge("reward_mean", "mean reward of the last step")
        self.g_eval = self.prom.gauge("eval_accuracy", "held-out accuracy of the last eval")
        self.g_eval_greedy = self.prom.gauge("eval_greedy_accuracy", "held-out greedy accuracy of the last eval "
                                             "([trainer] eval_greedy)")
        self.g_seconds = self.prom.gauge("step_seconds", "wall time of the last step", labels=("phase",))
        if start:  # a resume: where the run stands, not zeros until its first new step ends
            self._restore_gauges(start)
        if cfg.metrics_port:
            self.prom.serve(cfg.metrics_port, cfg.metrics_host)
        # seeded by the run: each server's request gets its own seed (collect.request_seed), so a resumed run rolls
        # the steps after its checkpoint out as the uninterrupted run did
        self.params = training_params(cfg)
        self.clients = [RolloutClient(a, control_token=cfg.rollout_token) for a in cfg.rollout_addresses]
        self.rewards = make_reward_source(cfg)
        self._blocked = 0  # the reward loop's stalls while the step's rollout was scored
        self.publisher = None
        self.guard = None  # a VersionGuard once weights are pushed: every rollout carries the version pushed
        self.loan = None
        if cfg.lend_rollout_devices:
            from tlt.services.trainer.colocate import DeviceLoan

            self.loan = DeviceLoan(self.clients, cfg.lend_lease_s)

    def _restore_gauges(self, start: int) -> None:
        """The gauges as the kept steps and evals left them (metrics.jsonl and eval.jsonl, trimmed to the checkpoint)."""
        from tlt.services.trainer.evaluate import read_evals
        from tlt.services.trainer.run_stats import read_jsonl

        self.g_step.set(start)
        if rows := read_jsonl(self.metrics_path):
            self.g_reward.set(rows[-1].get("reward_mean", 0.0))
            for phase, seconds in rows[-1].get("times", {}).items():
                self.g_seconds.labels(phase).set(seconds)
        if evals := read_evals(self.eval_path):
            self.g_eval.set(evals[-1].accuracy)
            greedy = [e.greedy_accuracy for e in evals if e.greedy_accuracy is not None]
            if greedy:
                self.g_eval_greedy.set(greedy[-1])

    def sync(self, policy, probes: dict | None = None) -> tuple[int, bool]:  # noqa: ANN001
        """Wait for the services; (the policy version, whether the rollout needs the weights pushed first).
        `probes`: the weights sync_version compares, gathered by every rank under ZeRO-3 (probe_values)."""
        from tlt.services.trainer.weight_sync import VersionGuard, WeightPublisher, check_push_dtype

        import grpc

        from tlt.services.trainer.collect import RolloutError

        wait_rewards = getattr(self.rewards, "wait_ready", None)
        if wait_rewards is not None:  # a reward server: found down now, not after the first rollout
            _wait_for("reward", self.cfg.reward_address, wait_rewards, self.cfg.connect_timeout_s)
        for c in self.clients:
            try:
                _wait_for("rollout", c.address, c.wait_ready, self.cfg.connect_timeout_s)
            except grpc.FutureTimeoutError:
                raise RolloutError(
                    f"rollout server {c.address} not reachable within {self.cfg.connect_timeout_s}s; start it "
                    "(tlt rollout serve --model DIR) or fix rollout_addresses"
                ) from None
        if self.cfg.weight_push != "none" or self.loan is not None:
            for c in self.clients:  # a missing or wrong token: refused now, not at the first push after a step
                c.check_control()
        if self.cfg.weight_push != "none":
            check_push_dtype(self.cfg, policy.bf16, self.clients)  # a dtype the rollout refuses: now, not at step 1
            self.publisher = WeightPublisher(self.clients, self.cfg.weight_push)
            self.guard = VersionGuard(self.clients)
            push_due = sync_version(policy, self.clients, probes)  # first: it raises policy.version past the servers'
            return policy.version, push_due
        return policy.version, False

    def rollout(self, prompts, step: int, version: int, more):  # noqa: ANN001, ANN201
        """The step's scored samples; with dynamic sampling, further rounds on `more()` (dynamic_sampling.py)."""
        from tlt.services.trainer.dynamic_sampling import roll_out_rounds

        if (state := getattr(self.rewards, "trainer_state", None)) is not None:  # TRL's, for reward functions
            state.global_step = step
        before = getattr(self.rewards, "loop_blocked", 0)
        try:
            if not self.cfg.dynamic_sampling:
                return self._collect(prompts, step, version)
            return roll_out_rounds(
                prompts, more, lambda ps, r: self._collect(ps, step if r == 0 else f"{step}.{r}", version),
                self.cfg.prompts_per_step, self.cfg.n_samples, self.cfg.dynamic_sampling_max_rounds)
        finally:  # counted while the rollout was scored, not later (a late wake-up during the update is no stall)
            self._blocked = getattr(self.rewards, "loop_blocked", 0) - before

    def reward_loop_blocked(self) -> int:
        """Stalls of the in-process reward loop (FunctionRewards.loop_blocked) while the step's rollout was scored."""
        return self._blocked

    def allow_repush(self, tensors) -> None:  # noqa: ANN001 - () -> the weights as pushed
        """A rollout server restarted mid-run gets the weights again instead of ending the run (VersionGuard).
        Under ZeRO-3 with several ranks `tensors` calls the other ranks into the gather (`_gathered_by_every_rank`)."""
        if self.guard is not None:
            self.guard.repush = lambda behind, version: self.publisher.push(tensors(), version, clients=behind)

    def _collect(self, prompts, step: int | str, version: int):  # noqa: ANN001, ANN202
        from tlt.services.trainer.collect import collect_retrying

        def roll_out():  # noqa: ANN202
            return collect_retrying(prompts, self.clients, self.rewards, self.cfg.n_samples, self.params, step,
                                    self.cfg.rollout_retries, self.cfg.rollout_retry_wait_s)

        return self.guard.collect(roll_out, version) if self.guard is not None else roll_out()

    def borrow(self) -> float:
        """Colocated: the rollout's devices are the trainer's until give_back() (seconds it took; 0 when off)."""
        return self.loan.borrow() if self.loan is not None else 0.0

    def give_back(self) -> float:
        return self.loan.give_back() if self.loan is not None else 0.0

    def publish(self, policy, m, prompts, t_step: float) -> None:  # noqa: ANN001
        """Push the new weights, then write the step's metrics line (before its checkpoint)."""
        from tlt.services.trainer.weight_sync import policy_tensors, resolve_dtype

        if self.publisher is not None:
            t_gather = time.perf_counter()  # the state dict to the host in the push dtype: a device copy on GPU
            tensors = policy_tensors(policy.module, resolve_dtype(self.cfg.push_dtype, policy.bf16))
            gather_s = time.perf_counter() - t_gather
            report = self.publisher.push(tensors, policy.version)
            m.times["push_s"] = gather_s + report.seconds
            m.times["push_apply_s"] = report.apply_seconds
        m.times["step_s"] = time.perf_counter() - t_step
        _append(self.metrics_path, {**m.as_dict(), "prompt_indices": [p.index for p in prompts]})
        self.g_step.set(m.step + 1)
        self.g_reward.set(m.reward_mean)
        for phase, seconds in m.times.items():
            self.g_seconds.labels(phase).set(seconds)
        log.info("step", step=m.step, version=policy.version, reward=round(m.reward_mean, 4),
                 acc=round(m.accuracy, 4), loss=round(m.loss, 5), kl=round(m.kl, 6), approx_kl=round(m.approx_kl, 6),
                 len=round(m.response_len_mean, 1), **{k: round(v, 3) for k, v in m.times.items()})

    def evaluate(self, steps_done: int, version: int) -> None:
        """The held-out eval after `steps_done` steps, when due: one line of eval.jsonl (before the checkpoint)."""
        from tlt.services.trainer.evaluate import due, run_eval

        if not due(self.cfg, steps_done):
            return
        r = run_eval(self.eval_items, self.clients, self.rewards, self.cfg, steps_done, version,
                     check_version=self.publisher is not None, guard=self.guard)
        _append(self.eval_path, r.as_dict())
        self.g_eval.set(r.accuracy)
        if r.greedy_accuracy is not None:
            self.g_eval_greedy.set(r.greedy_accuracy)
        greedy = {} if r.greedy_accuracy is None else {"greedy_accuracy": round(r.greedy_accuracy, 4)}
        log.info("eval", after_steps=steps_done, version=version, accuracy=round(r.accuracy, 4), **greedy,
                 problems=r.problems, samples=r.samples, seconds=round(r.seconds, 2))

    def export_begins(self, steps_done: int, version: int) -> None:
        """Replace the record of the export before it (run_folder.EXPORT_RECORD) with one that says this export has
        begun: killed before export() replaces it, the folder is an unfinished run (`tlt run` continues it)."""
        from tlt.services.trainer.run_folder import write_export_record

        write_export_record(self.out / "policy", steps_done, version, self.out, exporting=True)

    def export(self, steps_done: int, version: int) -> None:
        """The tokenizer files next to the trained policy's weights (written by Policy.save_pretrained), then the
        record of which policy the folder holds (run_folder.EXPORT_RECORD: `tlt report` compares it with the
        latest checkpoint)."""
        from tlt.services.trainer.run_folder import write_export_record

        export_tokenizer(self.cfg.model_dir, self.out / "policy")
        write_export_record(self.out / "policy", steps_done, version, self.out)

    def close(self) -> None:
        if self.loan is not None and self.loan.held:  # a step that failed mid-update: the devices go back now
            from tlt.services.trainer.colocate import LendError

            try:
                self.loan.give_back()
            except LendError as e:
                log.warning("device_give_back_failed", error=str(e)[:300], detail="the rollout's lease lapses by itself")
        self.rewards.close()
        for c in self.clients:
            c.close()


def export_tokenizer(model_dir: str | Path, final: Path) -> None:
    """Copy the input model's tokenizer files into the exported policy folder (files already there are kept)."""
    for name in TOKENIZER_FILES:
        src = Path(model_dir) / name
        if src.is_file() and not (final / name).exists():
            shutil.copy(src, final / name)


def _record_sampling(m, rollout, want: int) -> None:  # noqa: ANN001 - StepMetrics, RolloutResult
    """Dynamic sampling's figures in the step's metrics: the reward figures over every completion generated."""
    sel = rollout.selection
    if sel is None:
        m.groups_generated, m.zero_signal_groups_trained = want, m.zero_signal_groups
        return
    m.sampling_rounds, m.groups_generated = sel.rounds, sel.groups_generated
    m.zero_signal_groups_trained = m.zero_signal_groups  # grpo_step saw only the kept groups
    m.reward_mean, m.reward_std, m.accuracy = sel.reward_mean, sel.reward_std, sel.accuracy
    m.zero_signal_groups = sel.zero_signal_groups


def _append(path: Path, record: dict) -> None:
    """One JSON line, flushed and fsynced before the checkpoint that follows it."""
    import os

    with path.open("a") as f:
        f.write(json_line(record))
        f.flush()
        os.fsync(f.fileno())
