"""`tlt bench ...` without --model outside the repository built a 20 MB random checkpoint in a new folder of the
temporary directory and left it there, one per run (the drafter benches also left their checkpoint and ready-file
folders, with --model too). Those folders now go when the bench's process ends: normally, on an error or on Ctrl-C.

Real parts: `tlt bench engine` as a subprocess (no artifacts/tiny in its working folder), and the Python that
`tlt bench` runs, in subprocesses whose TMPDIR is the test's own folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp)}


def _left(tmp: Path) -> list[str]:
    """What stayed in the temporary folder, less torch's compile cache and the 16 KB tokenizer folder that
    random_checkpoint's test_tokenizer() leaves (tlt/model/tokenizer.py, not a bench's)."""
    return [p.name for p in tmp.iterdir() if not p.name.startswith(("tlt-tokenizer-", "torchinductor"))]


def test_bench_without_a_model_leaves_no_checkpoint_behind(tmp_path):
    scratch, work = tmp_path / "tmp", tmp_path / "work"
    scratch.mkdir()
    work.mkdir()
    r = subprocess.run([sys.executable, "-m", "tlt.cli", "bench", "engine", "--batch-sizes", "1", "--max-tokens", "2",
                        "--prompt-len", "3", "--repeats", "1", "--json"], cwd=work, env=_env(scratch),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "random checkpoint" in r.stdout, r.stdout  # it did build one
    assert _left(scratch) == []


@pytest.mark.parametrize("ending", ["pass", "raise RuntimeError('bench failed')", "raise KeyboardInterrupt"])
def test_scratch_folders_go_however_the_bench_ends(tmp_path, ending):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code = ("import sys; from tlt.bench import resolve_model, scratch_dir\n"
            "model, _ = resolve_model(None); print(model, flush=True)\n"
            "d = scratch_dir('tlt-preempt-'); (d / 'ready.json').write_text('{}'); print(d, flush=True)\n"
            f"{ending}\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(scratch), capture_output=True, text=True,
                       timeout=120)
    made = [Path(p) for p in r.stdout.split()]
    assert len(made) == 2 and all(str(p).startswith(str(scratch)) for p in made), (r.stdout, r.stderr)
    assert (made[0] / "config.json").parent == made[0]
    assert _left(scratch) == [], r.stderr
