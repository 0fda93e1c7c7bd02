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

from pathlib import Path

import pytest

from kernel_params import run_interpreter_child
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
    run_interpreter_child(["-m", "not slow and not gpu", "-k", "interpreter", *files], at_least=40)
