"""Runs the kernel parity tests under Triton's interpreter, in a child process.

Triton's interpreter must be switched on (TRITON_INTERPRET=1) before
`triton.language` is first imported, because Triton's own library functions
(`tl.sum`, `tl.max`, ...) are jitted at that import. In a normal pytest run
something else may have imported triton first, so the "interpreter" cases of
tests/test_kernels_{rmsnorm,rotary,paged_attention,tree_accept}.py skip there
and this test runs those files in a fresh `python -m pytest` with the variable
set, failing with the child's output if any case fails or skips. Nothing is
faked; the child runs the real kernels in the real interpreter on CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tlt.kernels.launch import interpreter_ready

PARITY_FILES = [
    "test_kernels_rmsnorm.py",
    "test_kernels_rotary.py",
    "test_kernels_paged_attention.py",
    "test_kernels_tree_accept.py",
]


def test_parity_suite_under_interpreter() -> None:
    if interpreter_ready():
        pytest.skip("this process already runs the interpreter: the parity cases run directly")
    here = Path(__file__).parent
    files = [str(here / name) for name in PARITY_FILES]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
         "-k", "interpreter", *files],
        env=env, cwd=here.parent, capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) >= 40, output[-4000:]
    assert "skipped" not in output, f"interpreter cases skipped in the child:\n{output[-4000:]}"
