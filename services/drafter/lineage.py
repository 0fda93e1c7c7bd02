"""Which init drafter a coordinator checkpoint grew from (its lineage), and moving one of another lineage aside.

A coordinator's checkpoint records the identity of the drafter it started from: "random" (no `init_drafter`: the
seeded random drafter) or `sha256:` of the init drafter's own tensors (so the same weights in another folder are
the same lineage). A restart whose configured `init_drafter` is another drafter (DEPLOY.md's switch to a learned
drafter reuses the checkpoint_dir of a coordinator that started from a random drafter under an n-gram rollout)
restored the old checkpoint and pushed its owed drafter over the one the user chose, never scored against it.
Now that checkpoint, and the workers' beside it (their optimizer moments belong to its weights), are moved into a
folder of their own (`other-lineage-<time>`: nothing is lost) and the coordinator starts from the configured init.
A checkpoint written before lineages were recorded is taken as of the configured one.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tlt.model.drafter import tensors_identity
from tlt.services.common.logging import get_logger

log = get_logger("drafter.coordinator")
RANDOM = "random"


def identity(init_drafter: str, tensors: dict[str, torch.Tensor]) -> str:
    """The lineage of a coordinator started from `init_drafter` ("" = random), whose own tensors are `tensors`: the
    same identity a rollout started on that drafter publishes in its capacity events (`start_drafter`)."""
    if not init_drafter:
        return RANDOM
    return tensors_identity(tensors)


def move_aside(checkpoint: Path) -> Path:
    """Move `checkpoint` (coordinator.pt) and the workers' checkpoints beside it into a new folder there."""
    folder = checkpoint.parent / f"other-lineage-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while folder.exists():  # two switches within a second
        n += 1
        folder = checkpoint.parent / f"other-lineage-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    folder.mkdir()
    for path in [checkpoint, *sorted(checkpoint.parent.glob("worker-*.pt"))]:
        path.rename(folder / path.name)
    return folder


def moved_aside(state: dict, lineage: str, checkpoint: Path, init_drafter: str) -> bool:
    """Whether the restored `state` of `checkpoint` is of another lineage than `lineage` (the configured init's), and
    so was moved aside, said in one warning naming both (a state of before lineages: taken as of this one)."""
    if state.get("lineage", lineage) == lineage:
        return False
    folder = move_aside(checkpoint)
    log.warning("drafter_checkpoint_other_lineage", checkpoint_from=state["lineage"], moved_to=str(folder),
                init_drafter=init_drafter or RANDOM, init=lineage,
                detail="that checkpoint grew from another init drafter: starting from init_drafter, none of it pushed")
    return True
