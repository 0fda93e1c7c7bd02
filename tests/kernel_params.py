"""Parametrisation shared by the kernel parity tests (test_kernels_*.py).

Each case runs on the CPU under the Triton interpreter (ids containing
"interpreter": collected by tests/test_kernels_interpreter.py's child process,
started with TRITON_INTERPRET=1) or on CUDA (marked `gpu`). Tolerances stay in
each test file: they depend on the kernel.
"""

from __future__ import annotations

import pytest
import torch

from tlt.kernels.launch import interpreter_ready

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
# The interpreter's bf16 arithmetic is not faithful: bf16 kernels are checked on CUDA only.
DEVICE_DTYPES = [
    pytest.param("cpu", torch.float32, id="interpreter-fp32"),
    pytest.param("cpu", torch.float16, id="interpreter-fp16"),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float16, id="cuda-fp16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
]


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if request.param == "cpu" and not interpreter_ready():
        pytest.skip("needs TRITON_INTERPRET=1 from process start: runs in tests/test_kernels_interpreter.py's child")
    return torch.device(request.param)


def run_interpreter_child(pytest_args: list[str], *, exactly: int | None = None, at_least: int | None = None) -> None:
    """Run `python -m pytest -q <pytest_args>` in a child started with TRITON_INTERPRET=1 (the interpreter must be
    on before any kernel is decorated, so it cannot be switched on in this process) and fail unless it passed
    `exactly` / `at_least` cases and skipped none (a skip there would hide a case that never ran)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *pytest_args],
        env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None, output[-4000:]
    if exactly is not None:
        assert int(passed.group(1)) == exactly, output[-4000:]
    if at_least is not None:
        assert int(passed.group(1)) >= at_least, output[-4000:]
    assert "skipped" not in output, f"interpreter cases skipped in the child:\n{output[-4000:]}"
