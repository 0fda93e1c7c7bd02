"""`tlt bench ...` without --model outside the repository built a 20 MB random checkpoint in a new folder of the
temporary directory and left it there, one per run (the drafter benches also left their checkpoint and ready-file
folders, with --model too). Those folders now go when the bench's process ends: normally, on an error or on Ctrl-C.

Real parts: `tlt bench engine` as a subprocess (no artifacts/tiny in its working folder), and the Python that
`tlt bench` runs, in processes (forked from one interpreter) whose TMPDIR is the test's own folder.
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


ENDINGS = ["pass", "raise RuntimeError('bench failed')", "raise KeyboardInterrupt"]

# One interpreter imports what a bench imports (torch, transformers: seconds) once, then forks one child per ending;
# each child is a whole process of its own that makes the folders in its own TMPDIR and ends that way (atexit runs
# as a bench's process ends). A fresh interpreter per ending added only those imports.
_FORK_PER_ENDING = (
    "import os, sys, tempfile\n"
    "from tlt.bench import resolve_model, scratch_dir\n"
    "import tlt.services.rollout.engine.testing  # what resolve_model(None) imports\n"
    "pids = []\n"
    "for i, (scratch, ending) in enumerate(zip(sys.argv[1::2], sys.argv[2::2])):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        os.environ['TMPDIR'] = scratch; tempfile.tempdir = None\n"
    "        sys.stdout = open(f'made-{i}', 'w', buffering=1)\n"
    "        model, _ = resolve_model(None); print(model, flush=True)\n"
    "        d = scratch_dir('tlt-preempt-'); (d / 'ready.json').write_text('{}'); print(d, flush=True)\n"
    "        exec(ending)\n"
    "        sys.exit(0)\n"
    "    pids.append(pid)\n"
    "print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])\n"
)


@pytest.fixture(scope="module")
def endings(tmp_path_factory) -> dict[str, tuple[Path, list[Path], str]]:
    """For each ending: its TMPDIR, the two folders its process made (the model, the ready-file folder), stderr."""
    root = tmp_path_factory.mktemp("endings")
    scratches = [root / f"tmp-{i}" for i in range(len(ENDINGS))]
    for d in [root / "parent", *scratches]:
        d.mkdir()
    r = subprocess.run([sys.executable, "-c", _FORK_PER_ENDING,
                        *[a for pair in zip(map(str, scratches), ENDINGS) for a in pair]],
                       cwd=root, env=_env(root / "parent"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return {ending: (scratch, [Path(p) for p in (root / f"made-{i}").read_text().split()], r.stderr)
            for i, (scratch, ending) in enumerate(zip(scratches, ENDINGS))}


@pytest.mark.parametrize("ending", ENDINGS)
def test_scratch_folders_go_however_the_bench_ends(endings, ending):
    scratch, made, stderr = endings[ending]
    assert len(made) == 2 and all(str(p).startswith(str(scratch)) for p in made), (made, stderr)
    assert (made[0] / "config.json").parent == made[0]
    assert _left(scratch) == [], stderr
