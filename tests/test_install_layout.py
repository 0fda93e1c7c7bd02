"""A non-editable install (`pip install .`, a wheel) carries what the code reads from the checkout.

`make` installs editable, where deploy/configs sits beside the code. Found in session 30, when the GPU check
installed the package with `pip install --target` and `tlt rollout serve` knew no preset at all ("choose one of
[]"): the presets now ship in the package as tlt/presets (setup.py), and services/common/config.py looks there
when the checkout's folder is not beside the code. Nothing is faked: the real pip builds the real package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_non_editable_install_finds_every_preset(tmp_path):
    src, site = tmp_path / "src", tmp_path / "site"
    for name in ("setup.py", "pyproject.toml", "README.md"):  # a copy of what the build reads: setuptools builds in
        (src / name).parent.mkdir(parents=True, exist_ok=True)  # the source tree (build/), not in the checkout
        shutil.copy(ROOT / name, src / name)
    for folder in ("tlt", "services", "kernels", "deploy/configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                    "--no-compile", "--no-cache-dir", "--target", str(site), str(src)],
                   check=True, cwd=tmp_path, timeout=300)
    code = ("from tlt.services.common.config import PRESETS_DIR, preset_path; import tlt; "
            "print(tlt.__file__); print(PRESETS_DIR); print(sorted(p.name for p in PRESETS_DIR.glob('*.toml'))); "
            "print(preset_path('cpu-tiny'))")
    out = subprocess.run([sys.executable, "-P", "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site)}, timeout=120).stdout.splitlines()
    assert out[0].startswith(str(site))  # the installed copy, not the checkout
    assert out[1] == str(site / "tlt" / "presets")
    assert out[2] == str(sorted(p.name for p in (ROOT / "deploy" / "configs").glob("*.toml")))
    assert (site / "tlt" / "presets" / "cpu-tiny.toml").read_text() == (ROOT / "deploy/configs/cpu-tiny.toml").read_text()
    assert out[3].endswith("cpu-tiny.toml")


def test_the_dockerfiles_dependency_only_install_builds_without_the_presets(tmp_path):
    """deploy/Dockerfile installs the dependencies first from a stub tree (pyproject.toml, setup.py, README.md and
    tlt/__init__.py: no deploy/configs), so that the code's layer does not rebuild them. setup.py must not ask for
    the presets' folder there (it did: "package directory 'deploy/configs' does not exist")."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "COPY pyproject.toml setup.py README.md ./" in dockerfile and "COPY tlt/__init__.py ./tlt/" in dockerfile
    stub = tmp_path / "stub"
    (stub / "tlt").mkdir(parents=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "tlt/__init__.py"):
        shutil.copy(ROOT / name, stub / name)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-build-isolation",
                           "--no-index", "-e", str(stub)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
