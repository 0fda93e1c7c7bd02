"""Choosing between a Triton kernel and its PyTorch reference, and jitting kernels lazily.

Every kernel module in `tlt.kernels` exposes one dispatch function (e.g.
`fused_add_rmsnorm`) that takes `impl`:

- "auto"   (default): the Triton kernel for CUDA tensors, the PyTorch reference otherwise;
- "torch":  always the reference (any device);
- "triton": always the kernel; on CPU tensors this needs `TRITON_INTERPRET=1`
            (Triton's interpreter, which is how the parity tests run on CPU).

Why lazy jitting: `triton.jit` decides at *decoration* time whether it builds
a compiled `JITFunction` or an interpreter `InterpretedFunction`, by reading
`TRITON_INTERPRET`. `LazyKernel` keeps the plain Python kernel function and
decorates it on first launch, once per setting, so our modules never freeze
the choice at import. Kernels must not call other jitted helpers of their own
(a plain helper would not be a JITFunction in the compiled path): each kernel
body is self-contained.

The interpreter has one more condition we cannot lift: Triton's own library
functions (`tl.sum`, `tl.max`, `tl.cdiv`, ...) are jitted when
`triton.language` is first imported, so TRITON_INTERPRET must already be set
then. `interpreter_ready()` checks both; the CPU parity tests run in a child
process started with the variable set (tests/test_kernels_interpreter.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch

Impl = Literal["auto", "torch", "triton"]
IMPLS: tuple[str, ...] = ("auto", "torch", "triton")


def interpreter_enabled() -> bool:
    """True when Triton would build interpreter kernels now (TRITON_INTERPRET set truthy)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def interpreter_ready() -> bool:
    """True when kernels can run under Triton's interpreter in this process.

    Needs TRITON_INTERPRET set now and when `triton.language` was first imported
    (its library functions, e.g. `tl.sum`, were decorated then).
    """
    if not interpreter_enabled():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def use_triton(x: torch.Tensor, impl: Impl) -> bool:
    """Decide whether a call on tensor `x` runs the Triton kernel (True) or the reference (False)."""
    if impl == "auto":
        return x.is_cuda
    if impl == "torch":
        return False
    if impl == "triton":
        if not x.is_cuda and not interpreter_ready():
            raise RuntimeError(
                "impl='triton' on a CPU tensor needs Triton's interpreter: start the process with "
                "TRITON_INTERPRET=1 (it must be set before triton is first imported), "
                "or use impl='auto'/'torch' for the PyTorch reference"
            )
        return True
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def resolve_impl(impl: Impl, device: torch.device) -> Literal["torch", "triton"]:
    """The implementation a model on `device` runs for the whole process (the engine's `kernels` knob).

    "auto": "triton" on CUDA when `triton.language` imports, "torch" otherwise (never the
    interpreter); "triton" on a CPU device needs TRITON_INTERPRET=1 from process start (checked
    here, so a misconfigured engine fails when it is built rather than at its first step).
    """
    if impl == "torch":
        return "torch"
    if impl == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import triton.language  # noqa: F401
        except ImportError:  # a CUDA torch without triton: the references still run
            return "torch"
        return "triton"
    if impl == "triton":
        if device.type != "cuda" and not interpreter_ready():
            raise RuntimeError(
                f"kernels='triton' on device {device} needs Triton's interpreter: start the process with "
                "TRITON_INTERPRET=1 (set before triton is first imported), or use kernels='auto'/'torch'"
            )
        return "triton"
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _interpreter_scalar_compat() -> None:
    """Let Triton 3.6's interpreter use runtime scalars as Python ints (loop bounds) under NumPy >= 2.4.

    Triton 3.6's interpreter converts a scalar tensor with `int(data)` on its shape-(1,) array, which
    NumPy >= 2.4 refuses, so `range(start, end)` over loaded values failed in every kernel that loops
    over runtime bounds; Triton 3.7 converts with `int(data.squeeze())`, which this installs (each
    launch re-checks, so it also holds if something swapped the interpreter's patcher since). Only
    the interpreter is touched: compiled kernels never see it.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_tlt_scalar_compat", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._tlt_scalar_compat = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


class LazyKernel:
    """A Triton kernel decorated with `triton.jit` on first launch, per interpreter setting.

    Launch exactly like a jitted kernel: `kernel[grid](*args, **constexprs)`.
    `raw` is the undecorated function (the compile-only tests build their own
    `JITFunction` from it).
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.raw = fn
        self._built: dict[bool, Any] = {}

    def jitted(self) -> Any:
        key = interpreter_enabled()
        if key and not interpreter_ready():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton.language was imported, so Triton's own library "
                "functions are compiled-mode and cannot run in the interpreter: set it before the process starts"
            )
        if key:
            _interpreter_scalar_compat()
        if key not in self._built:
            import triton

            self._built[key] = triton.jit(self.raw)
        return self._built[key]

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.jitted()[grid]


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1): `tl.arange` needs power-of-two extents."""
    return 1 << max(0, int(n) - 1).bit_length()


def check(cond: bool, message: str) -> None:
    """Raise ValueError(message) when a launch precondition fails (unlike `assert`, never compiled out)."""
    if not cond:
        raise ValueError(message)
