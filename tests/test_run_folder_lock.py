"""The run folder's lock (services/trainer/run_folder.py lock_run_dir): a lock taken on a `.lock` file that is no
longer the folder's guards nothing, and is given up. Real files and real flock; the one thing arranged is the timing:
fcntl.flock is wrapped so that the folder changes between the `.lock` file's open and its lock, the window in which a
refused `tlt run` removes the folder it made (or another launch makes it again)."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tlt.services.trainer.run_folder import LOCK_FILE, lock_run_dir


def _flock_after(monkeypatch: pytest.MonkeyPatch, change) -> None:  # noqa: ANN001 - change(): the folder changes
    real = fcntl.flock

    def flock(fd: int, op: int) -> None:
        change()
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)


def test_a_folder_removed_before_its_lock_was_taken_is_not_locked(tmp_path: Path, monkeypatch) -> None:
    """Locked, the removed folder's `.lock` (an unlinked file) would let this launch run in a folder that a second
    `tlt run` then makes and locks again: two runs sharing one folder's checkpoints."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    _flock_after(monkeypatch, lambda: shutil.rmtree(run_dir))
    assert lock_run_dir(run_dir) is None


def test_a_folder_made_again_before_its_lock_was_taken_is_not_locked(tmp_path: Path, monkeypatch) -> None:
    """Removed and made again by another launch: the path's `.lock` is another file than the one opened; the other
    launch's lock is on that one, so this lock guards nothing either."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()

    def remade() -> None:
        shutil.rmtree(run_dir)
        run_dir.mkdir()
        (run_dir / LOCK_FILE).write_text("")

    _flock_after(monkeypatch, remade)
    assert lock_run_dir(run_dir) is None
    monkeypatch.undo()
    lock = lock_run_dir(run_dir)  # nothing changes meanwhile: locked, with this process's pid in the file
    assert lock is not None and (run_dir / LOCK_FILE).read_text().split() == [str(os.getpid())]
    lock.close()
