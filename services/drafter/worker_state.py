"""What a drafter worker (worker.py) carries out of a training window: its outcome (`WindowResult`, reported to the
coordinator), the state it copies off the device before freeing it (`cpu_copy`), and the check that a saved optimizer
state belongs to this drafter (`optimizer_misfit`, when the worker starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tlt.model.drafter import Drafter, DrafterConfig


@dataclass
class WindowResult:
    """A training window's outcome: what the worker reports to the coordinator (`TrainingWindow`) and logs."""

    micro_steps: int = 0
    preempted: bool = False
    busy_timestamp: float = 0.0
    released: float = 0.0
    # CPU seconds of the worker from its last look that found the replica idle to `released`: at most what a
    # preemption took from the replica, where released - busy_timestamp (wall clock) also counts the wait of a
    # worker_nice worker for cycles the busy replica leaves it (the window log's release_cpu_ms)
    release_cpu: float = 0.0
    last_step_start: float = 0.0
    losses: list[float] = field(default_factory=list)
    abandoned: bool = False  # the last micro-step was given up before its update (BUSY seen at a checkpoint)


def optimizer_misfit(state: dict | None, cfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor) -> str | None:
    """Why a saved optimizer state cannot be that of this drafter's parameters (their number, their moments'
    shapes), or None when it fits or there is none. The drafter is built on the meta device: shapes, no memory."""
    if not state:
        return None
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in Drafter(cfg, embed, head).parameters()]
    ids = [i for group in state.get("param_groups", []) for i in group.get("params", [])]
    if len(ids) != len(shapes):
        return f"{len(ids)} parameters, expected {len(shapes)}"
    for i, shape in zip(ids, shapes):
        for name, t in state.get("state", {}).get(i, {}).items():
            if isinstance(t, torch.Tensor) and t.dim() and tuple(t.shape) != shape:
                return f"parameter {i} {name}: shape {tuple(t.shape)}, expected {shape}"
    return None


def cpu_copy(obj: object) -> object:
    """A copy on the CPU of the tensors in `obj` (a state dict, nested): what survives the device's release."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(v) for v in obj]
    return obj
