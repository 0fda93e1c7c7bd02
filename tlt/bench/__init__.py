"""Benchmarks behind `tlt bench ...`: each prints a table (or JSON) of figures it measured itself."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path("artifacts/tiny")


def resolve_model(arg: str | None) -> tuple[Path, str]:
    """The checkpoint a bench runs on and how to describe it.

    An explicit `--model` must be a checkpoint folder with weights (else CheckpointError: `tlt` reports it in
    one line, exit code 2); without one, `artifacts/tiny` when it was built, else a random checkpoint of the
    tiny preset's shape.
    """
    if arg:
        from tlt.model.folder import check_checkpoint

        check_checkpoint(arg)
        return Path(arg), arg
    if (DEFAULT_MODEL / "config.json").is_file():
        return DEFAULT_MODEL, str(DEFAULT_MODEL)
    import tempfile

    from tlt.services.rollout.engine.testing import random_checkpoint

    path = random_checkpoint(Path(tempfile.mkdtemp(prefix="tlt-bench-")) / "model", weight_scale=0.02)
    return path, "random checkpoint, tiny preset shape"
