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
