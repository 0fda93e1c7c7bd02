"""Rotary position embedding (RoPE) on q and k: Triton kernel, PyTorch reference, one dispatch.

Convention: Hugging Face "rotate_half" (non-interleaved), as in Qwen2 / Llama.
With x = [x1, x2] split at D/2 and (c, s) = cos/sin of position * inv_freq:

    out = [x1 * c - x2 * s,  x2 * c + x1 * s]

which is HF's `x * cat(c, c) + rotate_half(x) * cat(s, s)`.

Layouts: q [T, Hq, D], k [T, Hkv, D] (last dim contiguous; token and head
dims may be strided, e.g. views into a fused qkv projection), positions [T]
(int32 or int64), cos and sin caches [max_pos, D/2] or [max_pos, D] (the HF
layout, whose second half repeats the first; only the first half is read).

Precision: both paths compute in fp32 and round once at the end. For fp32
inputs this equals HF exactly; for fp16/bf16 HF rounds cos/sin and the two
products to the activation dtype first, so the results may differ from HF by
an ulp (the engine uses these functions on both of its paths, so the engine is
consistent with itself). `rope_cache` builds the cache the same way HF's
default rotary embedding does (no rope scaling).
"""

from __future__ import annotations

import torch
import triton.language as tl

from tlt.kernels.launch import Impl, LazyKernel, check, next_pow2, use_triton


def rope_cache(max_pos: int, head_dim: int, base: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) caches [max_pos, head_dim/2], computed as HF's default rotary embedding."""
    check(head_dim % 2 == 0, f"head_dim must be even, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    freqs = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x32 = x.to(torch.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference RoPE; with `inplace` q and k are overwritten and returned."""
    half = q.shape[-1] // 2
    c = cos[positions.long(), :half].to(torch.float32)
    s = sin[positions.long(), :half].to(torch.float32)
    q_out, k_out = _rotate_ref(q, c, s), _rotate_ref(k, c, s)
    if inplace:
        q.copy_(q_out)
        k.copy_(k_out)
        return q, k
    return q_out, k_out


def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cos, stride_sin,
    HQ, HKV, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]

    offs_hq = tl.arange(0, BLOCK_HQ)
    qmask = (offs_hq < HQ)[:, None] & dmask[None, :]
    q_in = q_ptr + t * stride_qt + offs_hq[:, None] * stride_qh + offs_d[None, :]
    q1 = tl.load(q_in, mask=qmask, other=0.0).to(tl.float32)
    q2 = tl.load(q_in + HALF, mask=qmask, other=0.0).to(tl.float32)
    q_o = q_out_ptr + t * stride_qot + offs_hq[:, None] * stride_qoh + offs_d[None, :]
    tl.store(q_o, (q1 * c - q2 * s).to(q_out_ptr.dtype.element_ty), mask=qmask)
    tl.store(q_o + HALF, (q2 * c + q1 * s).to(q_out_ptr.dtype.element_ty), mask=qmask)

    offs_hk = tl.arange(0, BLOCK_HKV)
    kmask = (offs_hk < HKV)[:, None] & dmask[None, :]
    k_in = k_ptr + t * stride_kt + offs_hk[:, None] * stride_kh + offs_d[None, :]
    k1 = tl.load(k_in, mask=kmask, other=0.0).to(tl.float32)
    k2 = tl.load(k_in + HALF, mask=kmask, other=0.0).to(tl.float32)
    k_o = k_out_ptr + t * stride_kot + offs_hk[:, None] * stride_koh + offs_d[None, :]
    tl.store(k_o, (k1 * c - k2 * s).to(k_out_ptr.dtype.element_ty), mask=kmask)
    tl.store(k_o + HALF, (k2 * c + k1 * s).to(k_out_ptr.dtype.element_ty), mask=kmask)


rotary_kernel = LazyKernel(_rotary_kernel)


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    inplace: bool = False, q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE with the Triton kernel. Out of place unless `inplace`; `q_out`/`k_out` may be preallocated."""
    check(q.dim() == 3 and k.dim() == 3, f"q, k must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    tokens, hq, dim = q.shape
    check(k.shape[0] == tokens and k.shape[2] == dim, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(dim % 2 == 0, f"head dim must be even, got {dim}")
    check(q.stride(-1) == 1 and k.stride(-1) == 1, "q and k need a contiguous last dim")
    check(q.dtype == k.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"bad dtypes {q.dtype}, {k.dtype}")
    check(positions.shape == (tokens,) and positions.dtype in (torch.int32, torch.int64), "positions must be int32/int64 [T]")
    check(positions.is_contiguous(), "positions must be contiguous")
    half = dim // 2
    for name, cache in (("cos", cos), ("sin", sin)):
        check(cache.dim() == 2 and cache.shape[1] in (half, dim), f"{name} cache must be [max_pos, {half} or {dim}], got {tuple(cache.shape)}")
        check(cache.stride(1) == 1, f"{name} cache needs a contiguous last dim")
        check(cache.device == q.device, f"{name} cache must be on {q.device}")
    check(q.device == k.device == positions.device, "q, k and positions must be on one device")
    if inplace:
        check(q_out is None and k_out is None, "inplace writes q and k: do not pass q_out/k_out")
        q_out, k_out = q, k
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    check(q_out.shape == q.shape and q_out.dtype == q.dtype and q_out.stride(-1) == 1, "q_out must match q")
    check(k_out.shape == k.shape and k_out.dtype == k.dtype and k_out.stride(-1) == 1, "k_out must match k")
    if tokens > 0:
        rotary_kernel[(tokens,)](
            q, k, q_out, k_out, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0),
            hq, k.shape[1], half,
            BLOCK_HQ=next_pow2(hq), BLOCK_HKV=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(half),
        )
    return q_out, k_out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    inplace: bool = False, impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k: the Triton kernel on CUDA, the reference elsewhere (see `tlt.kernels.launch`)."""
    if use_triton(q, impl):
        return apply_rotary_triton(q, k, positions, cos, sin, inplace=inplace)
    return apply_rotary_ref(q, k, positions, cos, sin, inplace=inplace)
