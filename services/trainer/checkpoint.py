"""Atomic trainer checkpoints: a kill -9 at any moment resumes with no step lost or repeated.

    <output_dir>/checkpoints/
        step-00000004/            one complete checkpoint (after 4 finished steps)
            engine/               DeepSpeed: model, optimizer (ZeRO partitions), LR scheduler
            trainer_state.pt      steps done, policy version, data position, RNG states, model config,
                                  ZeRO stage / bf16 / ranks (a resume with others is refused: engine_change)
        latest                    text file naming the newest complete checkpoint
        .tmp-step-00000006/       a save in progress (ignored, removed on the next save)

A save writes everything into a temporary folder, fsyncs it, renames it to
its final name (atomic on one file system), then replaces `latest` with a
write-temp-then-`os.replace`. A crash before the rename leaves only a `.tmp`
folder; a crash between the rename and the pointer update leaves `latest` on
the previous checkpoint, which is still complete. Resuming from checkpoint k
restarts at step k with the same data position, RNG and optimizer state, and
the rollout's sampling seeds derive from the run's seed and the step
(collect.request_seed), so the steps after k are recomputed exactly as they
would have run (where the rollout's numerics are deterministic: one CPU replica
is; GPU kernels need not be). A resume keeps the ZeRO stage, bf16 and (ZeRO >= 1)
the rank count the checkpoint was saved with; lr, weight_decay and betas are
this run's config's (Policy.keep_configured_settings). With several
ranks, every rank writes its DeepSpeed state into the temporary folder and
rank 0 alone does the renames (the folder must be on a shared file system).
RNG states saved are rank 0's.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tlt.services.common.logging import get_logger

log = get_logger("trainer.checkpoint")
LATEST = "latest"
STATE_FILE = "trainer_state.pt"
ENGINE_TAG = "engine"
# Config keys that do not tell one model from another: they change with the transformers version, the dtype the
# weights were loaded in, the folder's name, or runtime switches (the trainer turns use_cache off).
_NOT_IDENTITY = frozenset({"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache",
                           "output_hidden_states", "output_attentions", "return_dict"})


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk); the message says where and how the run resumes."""


class CheckpointError(ValueError):
    """A checkpoint that must not be resumed into this run; the message names it and the fix."""


@dataclass(frozen=True)
class TrainerState:
    steps_done: int
    policy_version: int
    sampler: dict[str, Any]  # PromptSampler.state_dict(): position, seed, size, content fingerprint
    rng: dict[str, Any]
    model: dict[str, Any] | None = None  # model_identity() of the trained model (None: saved before it was kept)
    # how the engine state is laid out (engine_settings; None: saved before they were kept)
    zero_stage: int | None = None
    bf16: bool | None = None
    world_size: int | None = None


def model_identity(config) -> dict[str, Any]:  # noqa: ANN001 - a transformers PretrainedConfig
    """The model's config as plain data, less the keys that do not identify the model."""
    return {k: v for k, v in config.to_dict().items() if k not in _NOT_IDENTITY and not k.startswith("_")}


def check_same_model(saved: dict[str, Any] | None, current: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model, before any of its state is loaded.

    Resume is on by default in a default output_dir, so a run of a new model meets the old run's checkpoint:
    another shape failed deep in torch's load_state_dict, and a same-shape variant (another eos token) silently
    replaced the new model's weights with the old run's. Keys only one side has (a transformers upgrade) are skipped.
    """
    if saved is None:
        return
    differ = sorted(k for k in saved.keys() & current.keys() if saved[k] != current[k])
    if differ:
        k = differ[0]
        raise CheckpointError(
            f"{path} is a checkpoint of another model ({k}: {saved[k]!r} there, {current[k]!r} in this run's model; "
            f"{len(differ)} config field(s) differ): to train this model set another output_dir (or resume=false "
            "to start over in this one); to continue that run, use the model it was started from"
        )


def engine_settings(policy) -> dict[str, Any]:  # noqa: ANN001 - Policy
    """The settings DeepSpeed's saved state is laid out by: the ZeRO stage (which files hold the optimizer state),
    bf16 (fp32 master weights and no loss scaler, or neither) and the number of ranks (one optimizer partition each)."""
    return {"zero_stage": policy.cfg.zero_stage, "bf16": policy.bf16, "world_size": policy.world_size}


def engine_change(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """How `current` (engine_settings) differs from the settings a checkpoint's state `saved` was made with, as
    "saved with zero_stage=0, bf16=false; this run has zero_stage=2"; None when this run can load it. DeepSpeed
    cannot load it across any of them: it failed deep in load_checkpoint (a missing zero_pp_rank_0 file, KeyError
    'dynamic_loss_scale'). The rank count matters where each rank holds a partition (ZeRO >= 1). Settings the
    checkpoint does not name (saved before they were kept) are not compared."""
    def show(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    keys = ["zero_stage", "bf16"] + (["world_size"] if (saved.get("zero_stage") or 0) >= 1 else [])
    differ = [k for k in keys if saved.get(k) is not None and saved[k] != current[k]]
    if not differ:
        return None
    kept = ", ".join(f"{k}={show(saved[k])}" for k in keys if saved.get(k) is not None)
    return f"saved with {kept}; this run has {', '.join(f'{k}={show(current[k])}' for k in differ)}"


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves and finds checkpoints of one run under `root`."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = max(1, keep)

    @staticmethod
    def name(steps_done: int) -> str:
        return f"step-{steps_done:08d}"

    @staticmethod
    def steps_of(name: str) -> int:
        """Steps done in the checkpoint folder `name`: `step-00000002`, or `step-00000002.1` for a second save of
        the same step (a run that restarted from an earlier checkpoint writes beside the older run's)."""
        return int(name.strip().removeprefix("step-").split(".")[0])

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / STATE_FILE).is_file():  # removed by hand, or copied without it
            raise CheckpointError(f"{pointer} names {path.name}, which is not a complete checkpoint: write the name of "
                                  "a complete step-* folder there to resume from it, or set resume=false to start over")
        return path

    @contextlib.contextmanager
    def _writing(self, tmp: Path, steps_done: int):  # noqa: ANN202 - Iterator[None]
        """A write of the checkpoint that fails for the disk (full, gone, read-only) is a CheckpointWriteError saying
        where and how the run resumes, the partial folder removed; torch's C++ writers raise those as RuntimeError
        ("file write failed", "basic_ios::clear: iostream error"). Any other error passes as it is."""
        try:
            yield
        except (OSError, RuntimeError) as e:
            text = " ".join(str(e).split())
            if isinstance(e, RuntimeError) and not any(w in text for w in ("write", "iostream", "space", "Errno")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # the space it took back; `latest` still names a whole one
            raise CheckpointWriteError(
                f"the checkpoint after {steps_done} steps could not be written in {self.root} ({type(e).__name__}: "
                f"{text[:200]}); free space there and run the same command again: the trainer resumes from its last "
                "complete checkpoint") from e

    def save(self, policy, sampler, steps_done: int) -> Path:  # noqa: ANN001 - Policy, PromptSampler
        """Write a complete checkpoint after `steps_done` steps; returns its folder."""
        from tlt.services.trainer.distributed import barrier, is_main

        final = self.root / self.name(steps_done)
        tmp = self.root / f".tmp-{final.name}"
        if is_main():
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        barrier()
        with self._writing(tmp, steps_done):
            # Collective: with ZeRO 1/2 every rank writes its optimizer partition, with ZeRO-3 its parameters' too.
            policy.engine.save_checkpoint(str(tmp), tag=ENGINE_TAG, client_state={}, save_latest=False)
        barrier()
        if is_main():
            state = TrainerState(steps_done, policy.version, sampler.state_dict(), capture_rng(),
                                 model_identity(policy.model_config), **engine_settings(policy))
            with self._writing(tmp, steps_done):
                torch.save(state.__dict__, tmp / STATE_FILE)
                _fsync_tree(tmp)
        if is_main():
            # An older run got this far before being resumed from an earlier checkpoint: its folder may be the one
            # `latest` names, so it is removed only after `latest` names the new one (never a moment without a
            # complete checkpoint to resume from, whenever a kill -9 comes).
            older = [p for p in self.root.glob("step-*") if p.is_dir() and self.steps_of(p.name) == steps_done]
            k = 0
            while final.exists():
                k += 1
                final = self.root / f"{self.name(steps_done)}.{k}"
            os.rename(tmp, final)
            pointer_tmp = self.root / f".{LATEST}.tmp"
            pointer_tmp.write_text(final.name + "\n")
            with open(pointer_tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(pointer_tmp, self.root / LATEST)
            _fsync_dir(self.root)
            for p in older:
                shutil.rmtree(p, ignore_errors=True)
            self._prune(final)
            log.info("checkpoint_saved", path=str(final), steps_done=steps_done, policy_version=policy.version)
        barrier()
        return final

    def _prune(self, newest: Path) -> None:
        done = sorted((p for p in self.root.glob("step-*") if p.is_dir()),
                      key=lambda p: (self.steps_of(p.name), len(p.name), p.name))
        for old in done[: -self.keep]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def load(self, policy, sampler, path: Path | None = None) -> TrainerState | None:  # noqa: ANN001
        """Restore the latest (or given) checkpoint into `policy` and `sampler`; None when there is none."""
        path = path or self.latest()
        if path is None:
            return None
        raw = torch.load(path / STATE_FILE, weights_only=False)  # our own file: RNG states are not tensors
        state = TrainerState(**raw)
        check_same_model(state.model, model_identity(policy.model_config), path)
        if (change := engine_change(raw, engine_settings(policy))) is not None:
            raise CheckpointError(f"{path} was {change}: keep those settings to resume it, or start a new run "
                                  "(another output_dir, or resume=false)")
        sampler.load_state_dict(state.sampler)  # DataError for other data: refused, like another model, before loading
        load_path, _ = policy.engine.load_checkpoint(str(path), tag=ENGINE_TAG)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no engine state in {path / ENGINE_TAG}: resume from another "
                                  f"checkpoint (name it in {self.root / LATEST}), or set resume=false to start over")
        policy.keep_configured_settings()  # this run's lr, weight_decay and betas, not the checkpoint's
        restore_rng(state.rng)
        policy.version = state.policy_version
        log.info("checkpoint_loaded", path=str(path), steps_done=state.steps_done, policy_version=state.policy_version)
        return state
