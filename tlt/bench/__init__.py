"""Benchmarks behind `tlt bench ...`: each prints a table (or JSON) of figures it measured itself."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path("artifacts/tiny")


def scratch_dir(prefix: str) -> Path:
    """A new folder in the temporary directory that goes when this process ends (normally, on an error or on
    Ctrl-C: atexit): a bench's random checkpoint (20 MB) and ready files were left behind, one folder per run."""
    import atexit
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def resolve_model(arg: str | None) -> tuple[Path, str]:
    """The checkpoint a bench runs on and how to describe it.

    An explicit `--model` must be a checkpoint folder with weights (else CheckpointError: `tlt` reports it in
    one line, exit code 2); without one, `artifacts/tiny` when it was built, else a random checkpoint of the
    tiny preset's shape, in a scratch_dir removed when the bench ends.
    """
    if arg:
        from tlt.model.folder import check_checkpoint

        check_checkpoint(arg)
        return Path(arg), arg
    if (DEFAULT_MODEL / "config.json").is_file():
        return DEFAULT_MODEL, str(DEFAULT_MODEL)
    from tlt.services.rollout.engine.testing import random_checkpoint

    path = random_checkpoint(scratch_dir("tlt-bench-") / "model", weight_scale=0.02)
    return path, "random checkpoint, tiny preset shape"
