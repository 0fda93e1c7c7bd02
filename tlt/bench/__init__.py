"""Benchmarks behind `tlt bench ...`: each prints a table (or JSON) of figures it measured itself."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL = Path("artifacts/tiny")


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """argparse `type` of an integer option that must be >= `minimum`: a bad count is a usage error
    naming the option (exit 2) at parsing, not an IndexError or ZeroDivisionError at the end of a run."""
    return lambda text: _int_at_least(text, minimum)


def positive_ints(text: str) -> list[int]:
    """argparse `type` of a comma-separated list of integers >= 1 (at least one), e.g. batch sizes."""
    values = [_int_at_least(x.strip(), 1) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers >= 1, got {text!r}")
    return values


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
