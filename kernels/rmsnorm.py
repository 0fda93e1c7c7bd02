"""RMSNorm and fused residual-add + RMSNorm: Triton kernel, PyTorch reference, one dispatch.

    rmsnorm(x, w, eps)                     = w * cast(x / sqrt(mean(x^2) + eps))
    fused_add_rmsnorm(x, residual, w, eps) = (rmsnorm(s, w, eps), s)   with s = cast(x + residual)

Rounding follows Hugging Face's Qwen2RMSNorm / Qwen2DecoderLayer exactly:
the residual sum is rounded to the activation dtype (HF adds in that dtype),
the statistics are computed in fp32 on that rounded sum, the normalised value
is rounded to the activation dtype *before* the weight multiply, and the
product is rounded again. So the reference equals HF bit for bit and the
kernel differs from it only by fp32 summation order in the mean of squares.

Layout: `x`, `residual` [..., H] with a contiguous last dim (rows may be
strided in the 2-D case); `weight` [H] contiguous, same dtype as `x`.
The kernel runs one program per row with the whole row in one tile (H up to
`MAX_HIDDEN`), which covers every dense Qwen2/Llama hidden size.
"""

from __future__ import annotations

import torch
import triton.language as tl

from tlt.kernels.launch import Impl, LazyKernel, check, next_pow2, use_triton

MAX_HIDDEN = 65536


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm, identical to HF Qwen2RMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference fused add + RMSNorm: returns (rmsnorm(x + residual), x + residual)."""
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_res, stride_out, stride_new_res,
    H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activation dtype, as HF's `residual + hidden_states` does.
        s = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_new_res + offs, s, mask=mask)
        x = s.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    normed = x * tl.rsqrt(variance + eps)
    # HF rounds the normalised value to the input dtype before the weight multiply.
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


rmsnorm_kernel = LazyKernel(_rmsnorm_kernel)


def _rows(t: torch.Tensor, name: str, hidden: int) -> torch.Tensor:
    check(t.dim() >= 1 and t.shape[-1] == hidden, f"{name} must end in the hidden size {hidden}, got {tuple(t.shape)}")
    check(t.stride(-1) == 1, f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if t.dim() == 2:
        return t
    check(t.is_contiguous(), f"{name} with {t.dim()} dims must be contiguous (2-D inputs may have strided rows)")
    return t.view(-1, hidden)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None, new_residual: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    check(hidden <= MAX_HIDDEN, f"hidden size {hidden} exceeds the single-tile limit {MAX_HIDDEN}")
    check(x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}")
    check(weight.shape == (hidden,) and weight.is_contiguous(), f"weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} must equal the activation dtype {x.dtype}")
    check(weight.device == x.device, "weight and x must be on the same device")
    x2 = _rows(x, "x", hidden)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check(out.shape == x.shape and out.dtype == x.dtype, f"out must be {tuple(x.shape)} {x.dtype}")
    out2 = _rows(out, "out", hidden)
    if residual is None:
        res2, new2 = x2, out2  # unused by the kernel when HAS_RESIDUAL is False
    else:
        check(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype")
        check(residual.device == x.device, "residual and x must be on the same device")
        res2 = _rows(residual, "residual", hidden)
        if new_residual is None:
            new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        check(new_residual.shape == x.shape and new_residual.dtype == x.dtype, "new_residual must match x")
        new2 = _rows(new_residual, "new_residual", hidden)
    rows = x2.shape[0]
    if rows > 0:
        rmsnorm_kernel[(rows,)](
            x2, res2, weight, out2, new2,
            x2.stride(0), res2.stride(0), out2.stride(0), new2.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden),
        )
    return out, new_residual


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm with the Triton kernel; `out` (optional) is written in place and returned."""
    result, _ = _launch(x, None, weight, eps, out, None)
    return result


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, new_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused add + RMSNorm with the Triton kernel; optional output buffers are written and returned."""
    result, summed = _launch(x, residual, weight, eps, out, new_residual)
    assert summed is not None
    return result, summed


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl = "auto") -> torch.Tensor:
    """RMSNorm: the Triton kernel on CUDA, the reference elsewhere (see `tlt.kernels.launch`)."""
    if use_triton(x, impl):
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, new_residual)` with new_residual = x + residual and out = rmsnorm(new_residual) * weight."""
    if use_triton(x, impl):
        return fused_add_rmsnorm_triton(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)
