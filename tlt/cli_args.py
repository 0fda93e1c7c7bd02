"""argparse `type`s of the `tlt` commands: a bad value is a usage error naming the option (exit 2) at parsing,
not a traceback, a silently misread value (a negative count run as zero, '' taken for the default or the
current folder) or a failure at the end of a long run."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


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


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """argparse `type` of a number that must be > 0 (a rate, a time budget); nan is refused."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse `type` of a number that must be >= 0 (a temperature, a noise width); nan is refused."""
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_empty(text: str) -> str:
    """argparse `type` of a path or name that must not be empty ('' would silently mean the default or '.')."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _no_file_above(path: Path) -> None:
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{parent} is a file, so {path} cannot be created under it")


def out_folder(text: str) -> str:
    """argparse `type` of an output folder: not empty (that is the current folder), not an existing file."""
    path = Path(non_empty(text))
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a file; give a folder (a new one is created)")
    _no_file_above(path)
    return text


def out_file(text: str) -> str:
    """argparse `type` of an output file: not empty, not an existing folder, its folder creatable (or there)."""
    path = Path(non_empty(text))
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; give a file path (a new file is created, its folder too)")
    _no_file_above(path)
    return text
