"""Every `tlt` child process the package starts runs the same installed tlt as its parent.

deploy/gpu_check.sh runs an installed copy (`python -P`, PYTHONPATH=/tmp/site) from the root of a checkout,
whose ./tlt lacks the services/ and kernels/ that setup.py maps under `tlt`. A child started as
`python -m tlt.cli ...` (no -P) put the current folder first on sys.path and imported that ./tlt: on the
H200 in session 31, `tlt bench e2e`'s `tlt run` children exited with "invalid choice: 'run'". `tlt.cli.tlt_command`
passes -P on; these tests hold every spawner to it and show that it works with a decoy package in the way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPAWN = re.compile(r"""["']-m["']\s*,\s*["']tlt\.cli["']""")


def test_no_module_starts_tlt_children_except_through_tlt_command() -> None:
    offenders = []
    for folder in ("tlt", "services", "kernels", "deploy"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "tlt" / "cli.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if SPAWN.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "start `tlt` children with tlt.cli.tlt_command (it passes -P on):\n" + "\n".join(offenders)


def test_the_pattern_finds_a_direct_spawn() -> None:
    """The check above can fail: the pattern matches the line session 31 fixed in tlt/bench/e2e.py."""
    assert SPAWN.search('    cmd = [sys.executable, "-m", "tlt.cli", "run", "--quiet"]')
    assert not SPAWN.search('    cmd = tlt_command("run", "--quiet")')


def _child_version(tmp_path: Path, safe_path: bool) -> subprocess.CompletedProcess:
    """From a folder holding a decoy `tlt` package, a parent (with or without -P) starts `tlt --version`."""
    decoy = tmp_path / "tlt"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy ./tlt was imported')\n")
    (decoy / "cli.py").write_text("raise ImportError('the decoy ./tlt was imported')\n")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import subprocess; from tlt.cli import tlt_command; "
            "sys.exit(subprocess.run(tlt_command('--version')).returncode)")
    argv = [sys.executable, *(["-P"] if safe_path else []), "-c", code]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_a_child_of_a_safe_path_parent_ignores_a_decoy_tlt_in_its_folder(tmp_path: Path) -> None:
    done = _child_version(tmp_path, safe_path=True)
    assert done.returncode == 0, done.stderr
    assert "decoy" not in done.stderr


def test_a_child_of_a_script_parent_ignores_a_decoy_tlt_in_its_folder(tmp_path: Path) -> None:
    """A parent run as a script (as the `tlt` console script runs) has its own folder first on sys.path, not the
    current one: its children get -P too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "parent.py"
    script.write_text(f"import sys; sys.path.append({str(ROOT)!r}); import subprocess; from tlt.cli import tlt_command; "
                      "sys.exit(subprocess.run(tlt_command('--version')).returncode)\n")
    folder = tmp_path / "checkout"
    (folder / "tlt").mkdir(parents=True)
    for name in ("__init__.py", "cli.py"):
        (folder / "tlt" / name).write_text("raise ImportError('the decoy ./tlt was imported')\n")
    done = subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_without_safe_path_the_child_would_import_the_decoy(tmp_path: Path) -> None:
    """What -P guards against, shown: the same parent without -P starts a child that imports ./tlt."""
    done = _child_version(tmp_path, safe_path=False)
    assert done.returncode != 0
    assert "decoy" in done.stderr


def test_a_parent_that_imports_from_the_current_folder_gives_its_children_the_same(monkeypatch) -> None:
    """`python -m tlt.cli run` from an uninstalled checkout imports tlt through the current folder, which `-m` puts on
    sys.path as its absolute path: its children must keep it (no -P) or they cannot import tlt at all. Only a parent
    without the current folder on its path ("", "." or that path) passes -P."""
    from tlt.cli import tlt_command

    if sys.flags.safe_path:
        pytest.skip("this interpreter runs with -P: every child gets it")
    others = [p for p in sys.path if p not in ("", ".", os.getcwd())]
    monkeypatch.setattr(sys, "path", [os.getcwd(), *others])
    assert "-P" not in tlt_command("--version")
    monkeypatch.setattr(sys, "path", others)
    assert tlt_command("--version")[1] == "-P"
