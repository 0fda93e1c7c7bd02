"""What `tlt run` refuses before a resume starts any service: a trainer that would draw other prompts than its
checkpoint's (another seed, data set or edited data file), train another model, or could not load its DeepSpeed
state (another ZeRO stage, bf16 or rank count). The trainer refuses each of these too, but only after every
service had started, and run.json by then held the new value (every later resume of the folder failed alike).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt.services.common.config import load_config
from tlt.services.trainer.procs import ServiceError

if TYPE_CHECKING:
    from tlt.services.trainer.config import TrainerConfig


# what the checkpoint's data position is a position in
DATA_FIELDS = ("seed", "data_path", "answer_field", "synthetic_problems")


def latest_state(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The run's latest complete trainer checkpoint and its state (our own file, as the trainer loads it); None when
    there is none, or `latest` names no complete one (the trainer says so). ServiceError when its state file cannot
    be read (cut short, overwritten)."""
    from tlt.services.trainer.checkpoint import STATE_FILE, CheckpointError, CheckpointManager

    try:
        latest = CheckpointManager(run_dir / "checkpoints").latest()
    except (CheckpointError, ValueError):  # the trainer says so (a `latest` naming no step: checkpoint_steps did)
        return None
    if latest is None:
        return None
    import torch

    try:
        return latest, torch.load(latest / STATE_FILE, weights_only=False)
    except Exception as e:  # noqa: BLE001 - a file cut short or overwritten: EOFError, OSError, UnpicklingError...
        raise ServiceError(damaged(run_dir, f"{latest / STATE_FILE} cannot be read ({type(e).__name__}: "
                                            f"{' '.join(str(e).split())[:160]})")) from None


def damaged(run_dir: Path, what: str) -> str:
    """The one line for a run whose last checkpoint is damaged: what, and the two ways on."""
    return (f"{what}: point {run_dir / 'checkpoints' / 'latest'} at an earlier complete step-* folder there, or "
            "start a new run (--run-id ID)")


def checkpoint_steps(run_dir: Path) -> int:
    """Steps done at the run folder's last trainer checkpoint (0: none): where its trainer resumes. ServiceError
    for a `latest` pointer that names no step (emptied, overwritten): it was a ValueError traceback."""
    from tlt.services.trainer.checkpoint import CheckpointManager

    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return 0
    text = pointer.read_text()
    try:
        return CheckpointManager.steps_of(text)
    except ValueError:
        raise ServiceError(damaged(run_dir, f"{pointer} names no checkpoint ({text.strip()[:60]!r})")) from None


def check_resume(run_dir: Path, trainer: dict[str, Any], model_dir: str) -> None:
    """Refuse a resume whose trainer would draw other prompts than the checkpoint's (another --seed, data set or
    data file), train another model (`--model`) or could not load its engine state (another zero_stage or bf16). The
    trainer refuses these too (PromptSampler.load_state_dict, checkpoint.check_same_model, checkpoint.engine_change),
    but only after every service had started, and run.json then held the new value: every later resume of the
    folder failed the same way."""
    from tlt.services.trainer.config import TrainerConfig

    old_path = run_dir / "config.toml"
    new = load_config(TrainerConfig, "trainer", None, trainer, environ={})  # the environment is in it
    if not new.resume:  # the trainer starts over
        return
    if old_path.exists():
        old = load_config(TrainerConfig, "trainer", old_path, environ={})  # and in the run's config.toml
        changed = [f"{k} {getattr(old, k)!r} -> {getattr(new, k)!r}"
                   for k in DATA_FIELDS if getattr(old, k) != getattr(new, k)]
        if changed:
            raise ServiceError(f"{run_dir} continues from its trainer checkpoint, and a resume keeps the data it was "
                               f"trained on ({', '.join(changed)}); drop that option, or start a new run (--run-id)")
    state = latest_state(run_dir)
    if state is None:
        return
    if (change := _engine_change(new, state)) is not None:
        raise ServiceError(f"{run_dir} continues from its trainer checkpoint, {change}: set trainer.zero_stage and "
                           "trainer.bf16 (default: on only with a GPU) to the checkpoint's, or start a new run (--run-id)")
    if old_path.exists() and (edited := data_file_change(new, state)):
        raise ServiceError(f"{run_dir} continues from its trainer checkpoint, and a resume keeps the data it was "
                           f"trained on ({edited}); restore that file, or start a new run (--run-id)")
    _check_same_model(state, model_dir)


def _engine_change(cfg: TrainerConfig, state: tuple[Path, dict[str, Any]]) -> str | None:
    """How the trainer's DeepSpeed settings (ZeRO stage, bf16, ranks) differ from those the checkpoint `state` was
    saved with (checkpoint.engine_change); None when it can load it. The trainer refuses it too, but only after
    every service had started."""
    from tlt.services.trainer.checkpoint import engine_change
    from tlt.services.trainer.policy import train_bf16

    # `tlt run` starts one trainer process: a world of one unless a launcher's WORLD_SIZE is inherited
    ranks = int(os.environ.get("WORLD_SIZE", 1))
    current = {"zero_stage": cfg.zero_stage, "bf16": train_bf16(cfg), "world_size": ranks}
    return engine_change(state[1], current)


def _check_same_model(state: tuple[Path, dict[str, Any]], model_dir: str) -> None:
    """`--model` must be the model the checkpoint `state` trained (checkpoint.check_same_model)."""
    from transformers import AutoConfig

    from tlt.services.trainer.checkpoint import CheckpointError, check_same_model, model_identity

    try:
        current = model_identity(AutoConfig.from_pretrained(model_dir))
    except (OSError, ValueError):  # not a model transformers reads: the trainer says so, as without a checkpoint
        return
    try:
        check_same_model(state[1].get("model"), current, state[0])
    except CheckpointError as e:
        raise ServiceError(f"{e} (--model {model_dir}; drop --model to resume with the run's own)") from None


def data_file_change(cfg: TrainerConfig, state: tuple[Path, dict[str, Any]]) -> str | None:
    """How the data file (`cfg.data_path`) differs from the one the latest checkpoint's data position is a position
    in (`state`: that checkpoint, `latest_state`): its prompt count, or its content
    fingerprint (PromptSampler's; a checkpoint saved before it was kept is checked on the count alone), as the
    trainer's PromptSampler.load_state_dict judges it; None when it does not. The synthetic set is fixed by the
    DATA_FIELDS compared before. ServiceError, in the trainer's own words, when the trainer would refuse the file
    for its references (reward = 'task' reads integers only: trainer_prompts): that is no change of the data."""
    if not cfg.data_path:
        return None
    saved = state[1]["sampler"]
    from tlt.services.trainer.data import DataError, PromptSampler, load_prompts
    from tlt.services.trainer.rewards import task_reference_problem

    try:  # the items trainer_prompts gives the trainer (chat template, answer_field), before its reward check
        now = PromptSampler(load_prompts(cfg.data_path, cfg.answer_field, cfg.model_dir), cfg.seed)
    except DataError as e:  # gone, or no longer readable
        return str(e)
    if saved["size"] != len(now.items):
        return f"{cfg.data_path} now holds {len(now.items)} prompts, {saved['size']} at the checkpoint"
    if saved.get("fingerprint") not in (None, now.fingerprint):
        return (f"{cfg.data_path} was edited since: other content in its {len(now.items)} prompts, fingerprint "
                f"{str(saved['fingerprint'])[:12]} at the checkpoint, {now.fingerprint[:12]} now")
    if cfg.reward == "task" and (problem := task_reference_problem(now.items, cfg.data_path)) is not None:
        raise ServiceError(problem)
    return None
