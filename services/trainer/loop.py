"""The GRPO training loop against running rollout (and optionally reward) services.

    resume (checkpoint) -> sync weights with the rollout server(s)
    per step:
      prompts (PromptSampler) -> collect (rollout stream + rewards as they finish)
      -> check every completion came from the current policy version
      -> grpo_step (old logprobs, advantages, DeepSpeed update, version + 1)
      -> push weights -> metrics.jsonl line -> checkpoint (every checkpoint_interval)
    end: final checkpoint, the trained policy as a Hugging Face folder (output_dir/policy)

Exactly-once bookkeeping: a step's metrics line is written before its
checkpoint; on resume from the checkpoint after k steps, lines of steps >= k
(written by the killed run after its last checkpoint) are dropped, and those
steps run again from the same data position. When the kill fell between a
push and the next checkpoint, the rollout server serves a newer version than
the resumed trainer: `sync_weights` pushes the resumed weights under a newer
version number (versions only grow), so rollouts never mix the two.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.trainer.config import TrainerConfig

log = get_logger("trainer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class TrainSummary:
    steps_done: int
    policy_version: int
    resumed_from: int | None
    output_dir: str


def trim_metrics(path: Path, steps_done: int) -> None:
    """Keep only lines of steps < steps_done (atomically)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < steps_done]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def sync_weights(policy, publisher, clients) -> None:  # noqa: ANN001
    """Make every rollout server serve the trainer's weights before the first rollout."""
    from tlt.services.trainer.weight_sync import policy_tensors, resolve_dtype

    serving = max(c.status().versions.policy for c in clients)
    if serving == policy.version:
        return  # fresh start (both 0, the model folder) or a resume that pushed this very version
    policy.version = max(policy.version, serving + 1)
    tensors = policy_tensors(policy.module, resolve_dtype(policy.cfg.push_dtype, policy.bf16))
    publisher.push(tensors, policy.version)


def train(cfg: TrainerConfig) -> TrainSummary:
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.checkpoint import CheckpointManager
    from tlt.services.trainer.collect import collect, sampling_params
    from tlt.services.trainer.data import PromptSampler, load_prompts, synthetic_prompts
    from tlt.services.trainer.policy import Policy, ReferencePolicy
    from tlt.services.trainer.rewards import make_reward_source
    from tlt.services.trainer.step import grpo_step
    from tlt.services.trainer.weight_sync import WeightPublisher, check_versions, policy_tensors, resolve_dtype

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    prom = Metrics("trainer")
    g_step = prom.gauge("step", "RL steps done")
    g_reward = prom.gauge("reward_mean", "mean reward of the last step")
    g_seconds = prom.gauge("step_seconds", "wall time of the last step", labels=("phase",))
    if cfg.metrics_port:
        prom.serve(cfg.metrics_port)

    items = load_prompts(cfg.data_path) if cfg.data_path else synthetic_prompts(cfg.synthetic_problems, cfg.seed)
    sampler = PromptSampler(items, cfg.seed)
    policy = Policy(cfg)
    reference = None
    if cfg.kl_beta > 0:
        import torch

        ref_dtype = torch.bfloat16 if policy.bf16 else torch.float32
        reference = ReferencePolicy(cfg.reference_model_dir or cfg.model_dir, policy.device, cfg.temperature, ref_dtype)
    ckpt = CheckpointManager(out / "checkpoints", cfg.keep_checkpoints)
    start, resumed_from = 0, None
    if cfg.resume and (state := ckpt.load(policy, sampler)) is not None:
        start = resumed_from = state.steps_done
        trim_metrics(metrics_path, start)
    elif metrics_path.exists():
        metrics_path.unlink()

    clients = [RolloutClient(a, control_token=cfg.rollout_token) for a in cfg.rollout_addresses]
    rewards = make_reward_source(cfg)
    try:
        for c in clients:
            c.wait_ready(cfg.connect_timeout_s)
        publisher = WeightPublisher(clients, cfg.weight_push) if cfg.weight_push != "none" else None
        if publisher is not None:
            sync_weights(policy, publisher, clients)
        push_dtype = resolve_dtype(cfg.push_dtype, policy.bf16)
        params = sampling_params(cfg.max_tokens, cfg.temperature, cfg.top_p)
        for step in range(start, cfg.steps):
            t_step = time.perf_counter()
            prompts = sampler.next_batch(cfg.prompts_per_step)
            rollout = collect(prompts, clients, rewards, cfg.n_samples, params, step)
            if publisher is not None:
                check_versions((s.policy_version for s in rollout.samples), policy.version)
            result = grpo_step(policy, rollout.samples, step, reference)
            m = result.metrics
            m.times.update(rollout.times)
            done = step + 1
            if publisher is not None:
                report = publisher.push(policy_tensors(policy.module, push_dtype), policy.version)
                m.times["push_s"] = report.seconds
                m.times["push_apply_s"] = report.apply_seconds
            m.times["step_s"] = time.perf_counter() - t_step
            _append(metrics_path, {**m.as_dict(), "prompt_indices": [p.index for p in prompts]})
            if done == cfg.steps or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0):
                ckpt.save(policy, sampler, done)
            g_step.set(done)
            g_reward.set(m.reward_mean)
            for phase, seconds in m.times.items():
                g_seconds.labels(phase).set(seconds)
            log.info("step", step=step, version=policy.version, reward=round(m.reward_mean, 4),
                     acc=round(m.accuracy, 4), loss=round(m.loss, 5), kl=round(m.approx_kl, 6),
                     len=round(m.response_len_mean, 1), **{k: round(v, 3) for k, v in m.times.items()})
        final = out / "policy"
        policy.save_pretrained(str(final))
        for name in TOKENIZER_FILES:
            src = Path(cfg.model_dir) / name
            if src.is_file() and not (final / name).exists():
                shutil.copy(src, final / name)
    finally:
        rewards.close()
        for c in clients:
            c.close()
    return TrainSummary(max(start, cfg.steps), policy.version, resumed_from, str(out))


def _append(path: Path, record: dict) -> None:
    """One JSON line, flushed and fsynced before the checkpoint that follows it."""
    import os

    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
