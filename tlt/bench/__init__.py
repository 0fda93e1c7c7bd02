"""Benchmarks behind `tlt bench ...`: each prints a table (or JSON) of figures it measured itself."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path("artifacts/tiny")


def resolve_model(arg: str | None) -> tuple[Path, str] | None:
    """The checkpoint a bench runs on and how to describe it.

    An explicit `--model` must be a checkpoint folder (None is returned so the
    caller can fail with exit code 2); without one, `artifacts/tiny` when it
    was built, else a random checkpoint of the tiny preset's shape.
    """
    model_dir = Path(arg) if arg else DEFAULT_MODEL
    if (model_dir / "config.json").is_file():
        return model_dir, str(model_dir)
    if arg:
        return None
    import tempfile

    from tlt.services.rollout.engine.testing import random_checkpoint

    path = random_checkpoint(Path(tempfile.mkdtemp(prefix="tlt-bench-")) / "model", weight_scale=0.02)
    return path, "random checkpoint, tiny preset shape"
