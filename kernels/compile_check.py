"""Compile the kernels for a CUDA target without a GPU: checks the compiled path gets through Triton.

On a CPU machine the parity tests can only run kernels under Triton's
interpreter, which does not exercise the real compiler (type inference of
loop-carried values, layouts, PTX generation, ptxas). This module compiles a
kernel exactly as a wrapper would launch it, down to a cubin, for a chosen
GPU architecture, using the ptxas that ships inside the Triton wheel. It does
not run anything and says nothing about speed or numerical results on a GPU.

Use: `record_launch(module, "kernel_attr")` swaps a module's LazyKernel for a
recorder while a wrapper is called on CPU tensors; `compile_recorded(...)`
turns the recorded arguments into a Triton signature and compiles.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tlt.kernels.launch import LazyKernel

_POINTER_TYPES = {
    torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
    torch.int64: "*i64", torch.int32: "*i32", torch.uint8: "*u8", torch.int8: "*i8", torch.bool: "*i1",
}


@dataclass
class Launch:
    """The arguments of one recorded kernel launch."""

    grid: Any
    args: tuple[Any, ...]
    constexprs: dict[str, Any]


@dataclass
class Recorder:
    """Stands in for a LazyKernel: records launches instead of running them."""

    kernel: LazyKernel
    launches: list[Launch] = field(default_factory=list)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **constexprs: Any) -> None:
            self.launches.append(Launch(grid, args, constexprs))

        return launch


@contextlib.contextmanager
def record_launch(module: ModuleType, attr: str) -> Iterator[Recorder]:
    """Replace `module.attr` (a LazyKernel) by a Recorder for the duration of the block."""
    original = getattr(module, attr)
    if not isinstance(original, LazyKernel):
        raise TypeError(f"{module.__name__}.{attr} is not a LazyKernel")
    recorder = Recorder(original)
    setattr(module, attr, recorder)
    try:
        yield recorder
    finally:
        setattr(module, attr, original)


def _scalar_type(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


@dataclass(frozen=True)
class Usage:
    """What ptxas reports for one compiled kernel."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int


def _ptxas() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def ptxas_available() -> bool:
    """True when the Triton wheel ships the ptxas binary this check needs."""
    return _ptxas().exists()


def ptxas_usage(compiled: Any) -> Usage:
    """Registers and spills of a compiled kernel: its PTX re-assembled by ptxas with `-v`."""
    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
    if target is None:
        raise ValueError("PTX has no .target line")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [str(_ptxas()), "-v", f"-arch={target.group(1)}", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )
    report = proc.stdout + proc.stderr
    registers = re.search(r"Used (\d+) registers", report)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or frame is None:
        raise ValueError(f"unexpected ptxas report: {report}")
    return Usage(int(registers.group(1)), int(frame.group(2)), int(frame.group(3)), int(frame.group(1)))


def compile_recorded(kernel: LazyKernel, launch: Launch, arch: int = 90, num_warps: int = 4) -> Any:
    """Compile a recorded launch for `cuda:sm_<arch>` down to a cubin; returns Triton's CompiledKernel.

    `num_warps` applies when the launch did not pass its own."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    constexprs = dict(launch.constexprs)
    options = {"num_warps": constexprs.pop("num_warps", num_warps)}  # launch options, not kernel arguments
    if "num_stages" in constexprs:
        options["num_stages"] = constexprs.pop("num_stages")
    names = list(inspect.signature(kernel.raw).parameters)
    positional = names[: len(launch.args)]
    signature: dict[str, str] = {}
    for name, value in zip(positional, launch.args):
        signature[name] = _POINTER_TYPES[value.dtype] if isinstance(value, torch.Tensor) else _scalar_type(value)
    for name in constexprs:
        signature[name] = "constexpr"
    missing = [n for n in names if n not in signature]
    if missing:
        raise ValueError(f"launch of {kernel.raw.__name__} did not bind {missing}")
    source = ASTSource(fn=JITFunction(kernel.raw), signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
