"""`make` repairs a .venv whose Python is gone and reuses a healthy one.

A pyenv upgrade or removal leaves .venv/bin/python a dangling link: with the install stamp present `make run` failed
`.venv/bin/tlt: No such file or directory`, and without it `make install` failed too. The Makefile now makes the
venv again (`python -m venv --clear`) when `.venv/bin/python -c ''` fails. Checked with `make -n` (what it would
run, nothing installed) on a copy of the Makefile and its inputs, with a fake .venv: a link to this Python (healthy)
or to a Python that does not exist (broken). The real rebuild (pip, minutes) is not run here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _project(tmp_path: Path, python: str) -> Path:
    for rel in ("Makefile", "pyproject.toml", "setup.py", "deploy/constraints-cpu.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "python3"):
        (bin_dir / name).symlink_to(python)
    (tmp_path / "artifacts" / "tiny").mkdir(parents=True)
    later = time.time() + 5  # the stamps are newer than the copied inputs: an installed, up-to-date venv
    for stamp in (".venv/.tlt-installed", ".venv/.tlt-dev-installed", "artifacts/tiny/.complete"):
        (tmp_path / stamp).touch()
        os.utime(tmp_path / stamp, (later, later))
    return tmp_path


def _make_n(project: Path, *targets: str) -> str:
    # as a child of `make test` too: its MAKELEVEL / MAKEFLAGS made this make print "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", *targets], cwd=project, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_healthy_venv_is_reused(tmp_path):
    project = _project(tmp_path, sys.executable)
    assert "pip" not in _make_n(project, "install") + _make_n(project, "install-dev")
    run = _make_n(project, "run").strip().splitlines()
    assert run == [".venv/bin/tlt run --preset cpu-tiny"]


def test_a_venv_whose_python_is_gone_is_made_again(tmp_path):
    project = _project(tmp_path, str(tmp_path / "gone" / "bin" / "python3"))
    for target in ("install", "run", "install-dev"):
        plan = _make_n(project, target)
        assert "-m venv --clear .venv" in plan and "pip install" in plan, (target, plan)
    assert "pytest" in _make_n(project, "test") and "tlt.protogen" in _make_n(project, "test")
    # without the stamp too (it failed as well)
    (project / ".venv" / ".tlt-installed").unlink()
    assert "-m venv --clear .venv" in _make_n(project, "install")
