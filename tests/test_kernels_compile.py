"""Compile-only check of the GPU path: each wrapper's real launch compiled to a cubin for sm_80 and sm_90.

No GPU is needed: the wrappers are called on CPU tensors with the kernel
swapped for a recorder (`tlt.kernels.compile_check`), and the recorded launch
is compiled by Triton's real compiler and the ptxas shipped in the Triton
wheel. This catches what the interpreter cannot (type errors in loop-carried
values, unsupported ops, layouts, register allocation failures); it runs
nothing and checks no numbers: the parity tests do that (interpreter on CPU,
compiled on CUDA when a GPU is present). Faked: only the launch itself.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tlt.kernels import paged_attention, rmsnorm, rotary, tree_accept
from tlt.kernels.compile_check import compile_recorded, ptxas_available, record_launch
from tlt.kernels.launch import interpreter_ready

pytestmark = [
    pytest.mark.skipif(not ptxas_available(), reason="the Triton wheel has no ptxas"),
    pytest.mark.skipif(interpreter_ready(), reason="triton.language was imported under TRITON_INTERPRET=1"),
]

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def _rmsnorm(dtype: torch.dtype, hidden: int, residual: bool) -> Callable[[], object]:
    x, w = torch.zeros(4, hidden, dtype=dtype), torch.zeros(hidden, dtype=dtype)
    if residual:
        return lambda: rmsnorm.fused_add_rmsnorm_triton(x, x, w, 1e-6)
    return lambda: rmsnorm.rmsnorm_triton(x, w, 1e-6)


def _rotary(dtype: torch.dtype, hq: int, hkv: int, dim: int) -> Callable[[], object]:
    q, k = torch.zeros(4, hq, dim, dtype=dtype), torch.zeros(4, hkv, dim, dtype=dtype)
    cos, sin = rotary.rope_cache(64, dim, 1e6)
    return lambda: rotary.apply_rotary_triton(q, k, torch.zeros(4, dtype=torch.int64), cos, sin)


def _paged(dtype: torch.dtype, hq: int, hkv: int, dim: int, block: int, num_q: int, splits: int) -> Callable[[], object]:
    cache = torch.zeros(8, block, hkv, dim, dtype=dtype)
    tables, lens = torch.zeros(2, 64, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    if num_q == 1:
        q = torch.zeros(2, hq, dim, dtype=dtype)
        return lambda: paged_attention.paged_decode_attention_triton(q, cache, cache, tables, lens, 0.1, num_splits=splits)
    q = torch.zeros(2, num_q, hq, dim, dtype=dtype)
    mask = torch.ones(2, num_q, num_q, dtype=torch.bool)
    return lambda: paged_attention.paged_tree_attention_triton(q, cache, cache, tables, lens, 0.1, mask, num_splits=splits)


def _accept(nodes: int) -> Callable[[], object]:
    d = torch.zeros(3, nodes, dtype=torch.int64)
    return lambda: tree_accept.tree_accept_triton(d, d, d)


CASES = {
    "rmsnorm-bf16-3584-fused": (rmsnorm, ["rmsnorm_kernel"], _rmsnorm(bf16, 3584, True)),
    "rmsnorm-fp16-896": (rmsnorm, ["rmsnorm_kernel"], _rmsnorm(fp16, 896, False)),
    "rmsnorm-fp32-100": (rmsnorm, ["rmsnorm_kernel"], _rmsnorm(fp32, 100, True)),
    "rotary-bf16-28x4x128": (rotary, ["rotary_kernel"], _rotary(bf16, 28, 4, 128)),
    "rotary-fp16-12x2x64": (rotary, ["rotary_kernel"], _rotary(fp16, 12, 2, 64)),
    "decode-bf16-gqa7-d128-bs16": (paged_attention, ["paged_attention_kernel"], _paged(bf16, 28, 4, 128, 16, 1, 1)),
    "decode-bf16-split8+merge": (paged_attention, ["paged_attention_kernel", "merge_splits_kernel"], _paged(bf16, 28, 4, 128, 16, 1, 8)),
    "tree-fp16-q8-d64-bs32-split2": (paged_attention, ["paged_attention_kernel", "merge_splits_kernel"], _paged(fp16, 8, 2, 64, 32, 8, 2)),
    "accept-n48": (tree_accept, ["tree_accept_kernel"], _accept(48)),
    "accept-n8": (tree_accept, ["tree_accept_kernel"], _accept(8)),
}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_cuda(case: str, arch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module, attrs, call = CASES[case]
    recorders = []
    with record_launch(module, attrs[0]) as first:
        if len(attrs) > 1:
            with record_launch(module, attrs[1]) as second:
                call()
            recorders.append(second)
        else:
            call()
    recorders.insert(0, first)
    for recorder in recorders:
        assert len(recorder.launches) == 1, f"{recorder.kernel.raw.__name__} launched {len(recorder.launches)} times"
        compiled = compile_recorded(recorder.kernel, recorder.launches[0], arch=arch)
        assert f".target sm_{arch}" in compiled.asm["ptx"]
        assert len(compiled.asm["cubin"]) > 1000
        assert compiled.metadata.shared <= 160 * 1024  # fits the smallest (sm_80) shared-memory budget
