"""The decoder layer's maths around attention, as TorchScript functions used on every device and dtype.

    pre_attention(x, ...)      RMSNorm -> qkv projection (+bias) -> Qwen3 q/k RMSNorm -> RoPE
                               -> K/V written to their cache slots -> returns q [T, nh, d]
    post_attention(x, o, ...)  o_proj + residual -> RMSNorm -> SwiGLU MLP + residual -> x
    group_attention(q, ...)    SDPA over K/V gathered from the paged cache (prefill, verify, small decode)
    dense_attention(q, ...)    SDPA over the decode mirror's dense K/V (large decode batches)

Both attention functions run grouped-query attention as `grouped_sdpa`: each K/V head's query heads
folded into query rows, so K/V are never copied per query head.

Scripting keeps the ~25 kernels of a layer out of the Python interpreter (about a tenth of a batch-1
CPU decode step); if scripting is unavailable the same Python functions run unscripted. Only CPU tensors
take the scripted function (`cpu_scripted`); on CUDA the plain Python function runs (CUDA graphs and the
Triton kernels are what take launch overhead away there), and its SDPA calls exclude cuDNN's attention, which
builds a plan per new input shape: 25 ms a call on an H200, where the drafter's shapes change every step
(BENCHMARKS.md, "GPU", Session 30).

Linears: with `packed`, weights are oneDNN pre-packed (`pack`) and the RMSNorm weight preceding
them is folded in (W * w is packed, the norm then applies no weight): 2-7x faster than the default
BLAS for 4..2048 rows on the CI CPU. Otherwise plain F.linear on the HF-layout weights.
RMSNorm: fp32 uses mean(x^2) = ||x||^2 / H (4 kernels); other dtypes follow HF's order exactly
(normalise in fp32, cast back, then multiply by the weight).
RoPE is HF's rotate-half form: x*cos + rotate_half(x)*sin = x*cos + roll(x, d/2)*sin_signed where
sin_signed = (-sin_1, sin_2) is precomputed.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import List, Optional, Union  # noqa: UP035 - TorchScript needs typing generics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_PACK_HINT = 64  # rows the packed layout is tuned for; it stays valid for any row count


def pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_HINT)


def onednn_works(dtype: torch.dtype) -> bool:
    """Whether this torch build runs oneDNN packed linears for `dtype` and agrees with F.linear."""
    if not (hasattr(torch.ops, "mkldnn") and torch.backends.mkldnn.is_available()):
        return False
    try:
        with torch.inference_mode():
            w = torch.randn(8, 16).to(dtype)
            x = torch.randn(4, 16).to(dtype)
            out = torch.ops.mkldnn._linear_pointwise(x, pack(w), None, "none", [], "")
    except (RuntimeError, AttributeError):  # capability probe: builds without these ops use F.linear
        return False
    return bool(torch.allclose(out.float(), F.linear(x, w).float(), atol=1e-2))


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], packed: bool) -> torch.Tensor:  # noqa: UP045
    if packed:
        no_scalars: List[Optional[Union[int, float, complex]]] = []  # noqa: UP006, UP007, UP045
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", no_scalars, "")
    return F.linear(x, w, b)


def rms(x: torch.Tensor, w: Optional[torch.Tensor], eps: torch.Tensor, exact_hf: bool) -> torch.Tensor:  # noqa: UP045
    if exact_hf:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return y if w is None else w * y
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    y = x * torch.rsqrt(torch.addcmul(eps, n, n, value=1.0 / x.shape[-1]))
    return y if w is None else y * w


def pre_attention(
    x: torch.Tensor, ln1: Optional[torch.Tensor], qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor],  # noqa: UP045
    qk_norm: Optional[torch.Tensor], packed: bool, eps: torch.Tensor, exact_hf: bool,  # noqa: UP045
    cos: torch.Tensor, sin: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
    nh: int, kvh: int, d: int,
) -> torch.Tensor:
    t = x.shape[0]
    qkv = linear(rms(x, ln1, eps, exact_hf), qkv_w, qkv_b, packed)
    qk_size = (nh + kvh) * d
    qk = qkv[:, :qk_size].view(t, nh + kvh, d)  # q and k heads are adjacent: normalise and rotate together
    if qk_norm is not None:
        qk = rms(qk, None, eps, exact_hf) * qk_norm
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
    k_flat.index_copy_(0, slots, qk[:, nh:])
    v_flat.index_copy_(0, slots, qkv[:, qk_size:].view(t, kvh, d))
    return qk[:, :nh]


def post_attention(
    x: torch.Tensor, o: torch.Tensor, o_w: torch.Tensor, ln2: Optional[torch.Tensor],  # noqa: UP045
    gate_up_w: torch.Tensor, down_w: torch.Tensor, packed: bool, eps: torch.Tensor, exact_hf: bool, inter: int,
) -> torch.Tensor:
    x = x + linear(o, o_w, None, packed)
    gu = linear(rms(x, ln2, eps, exact_hf), gate_up_w, None, packed)
    return x + linear(F.silu(gu[:, :inter]) * gu[:, inter:], down_w, None, packed)


def grouped_sdpa(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: Optional[float],  # noqa: UP045
) -> torch.Tensor:
    """SDPA of nh query heads over kvh K/V heads (GQA, MQA, MHA) without copying K/V: [B, nh, L, d] over
    [B, kvh, S, d] -> [B, nh, L, d].

    The g = nh / kvh query heads that share a K/V head become g x L query rows of that head: head
    h = j * g + m's row i is row m * L + i of K/V head j, the pairing `enable_gqa` makes. `mask` comes
    folded to match (`fold_mask`): [B, 1, g * L, S], or [B, 1, 1, S] / None, which broadcast. SDPA's own
    `enable_gqa` expands K and V to nh heads first, a copy of every key and value per call: on the CI
    CPU the folded call is 1.1-2x faster on the tiny model's decode and verify shapes (BENCHMARKS.md,
    "Session 17"). The same dot products and softmax per query row; for L > 1 bitwise the expanded
    call's output (one query row at a time, L = 1, takes another SDPA kernel: within 1e-6).
    """
    b, nh, q_len, d = qg.shape
    kvh = k.shape[1]
    if nh == kvh:
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    o = F.scaled_dot_product_attention(qg.reshape(b, kvh, nh // kvh * q_len, d), k, v, attn_mask=mask, scale=scale)
    # reshape, not view: CUDA's memory-efficient SDPA returns [b, kvh, g * L, d] as a transposed [b, g * L, kvh, d]
    # buffer, which cannot be viewed as [b, nh, L, d] (a copy there; a view of the contiguous CPU output)
    return o.reshape(b, nh, q_len, d)


def fold_mask(mask: Optional[torch.Tensor], groups: int) -> Optional[torch.Tensor]:  # noqa: UP045
    """A [B, 1, L, S] mask for `grouped_sdpa`'s folded queries (`groups` = nh / kvh query heads per K/V
    head): [B, 1, groups * L, S]. A mask of one query row, or none, broadcasts as it is."""
    if mask is None or groups == 1 or mask.shape[2] == 1:
        return mask
    return mask.repeat(1, 1, groups, 1)


def group_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, q_index: Optional[torch.Tensor],  # noqa: UP045
    block_index: torch.Tensor, lk: int, mask: Optional[torch.Tensor], max_q: int, scale: float,  # noqa: UP045
    k_buf: torch.Tensor, v_buf: torch.Tensor,
) -> torch.Tensor:
    """Attention of one group of sequences over the paged cache -> [G * max_q, nh * d] (padded rows included).

    q: [T, nh, d] flat new tokens; q_index [G, max_q] picks each sequence's (padded) queries, None when
    row g is flat token g; kc/vc [num_blocks, block_size, kvh, d]; block_index [G * nb] each sequence's
    blocks; keys are the first lk positions of those blocks; mask [G, 1, max_q, lk] folded for the
    query heads per K/V head (`fold_mask`; None: all visible).
    """
    nh, d, kvh = q.shape[1], q.shape[2], kc.shape[2]
    if q_index is not None:
        q = q.index_select(0, q_index.view(-1))
    g = q.shape[0] // max_q
    qg = q.view(g, max_q, nh, d).transpose(1, 2)
    # gather whole blocks (contiguous copies), then keep the first lk key positions: [G, kvh, lk, d]
    kg = torch.index_select(kc, 0, block_index, out=k_buf).view(g, -1, kvh, d)[:, :lk].transpose(1, 2)
    vg = torch.index_select(vc, 0, block_index, out=v_buf).view(g, -1, kvh, d)[:, :lk].transpose(1, 2)
    og = grouped_sdpa(qg, kg, vg, mask, scale)
    return og.transpose(1, 2).reshape(g * max_q, nh * d)


def dense_attention(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor, kd: torch.Tensor,
    vd: torch.Tensor, rows: Optional[torch.Tensor], lk: int, mask: Optional[torch.Tensor], scale: float,  # noqa: UP045
    row_of_slot: Optional[torch.Tensor] = None, slot_of_row: Optional[torch.Tensor] = None,  # noqa: UP045
    bounds: Optional[List[int]] = None, lks: Optional[List[int]] = None,  # noqa: UP006, UP045
) -> torch.Tensor:
    """Decode rows over dense per-row K/V (`decode_mirror`) -> [B, nh * d]: `group_attention` without the gather.

    q: [B, nh, d] one new token per row, whose K/V the cache holds at `slots` (k_flat/v_flat
    [num_slots, kvh, d]); rows [B * kvh], when given, is where they go in kd/vd [B, kvh, cap, d]
    (appended here, in the script: a decode step's mirror work costs no interpreter time per layer).
    Keys are the first lk positions; mask [B, 1, 1, lk] (None: all visible; one query row needs no
    folding for `grouped_sdpa`). The same SDPA call as `group_attention` on the same values: bitwise
    the same output (rows in other slots: see `decode_mirror` on several threads). row_of_slot /
    slot_of_row, when given: mirror slot s holds batch row row_of_slot[s] (`rows` already address each
    row's slot, and `mask` is in slot order): queries go in in slot order and outputs come back in batch
    order. bounds / lks, when given: slots bounds[i] .. bounds[i+1]-1 attend apart over their first lks[i]
    keys (the mask cut to match), so short rows do not pay for the longest one.
    """
    b, nh, d = q.shape[0], q.shape[1], q.shape[2]
    if rows is not None:
        kd.view(-1, d).index_copy_(0, rows, k_flat.index_select(0, slots).view(-1, d))
        vd.view(-1, d).index_copy_(0, rows, v_flat.index_select(0, slots).view(-1, d))
    if row_of_slot is not None:
        q = q.index_select(0, row_of_slot)
    qg = q.view(b, 1, nh, d).transpose(1, 2)
    if bounds is None or lks is None:
        og = grouped_sdpa(qg, kd[:, :, :lk], vd[:, :, :lk], mask, scale)
    else:
        runs: List[torch.Tensor] = []  # noqa: UP006
        for i in range(len(lks)):
            a, z, n = bounds[i], bounds[i + 1], lks[i]
            m = None if mask is None else mask[a:z, :, :, :n]
            runs.append(grouped_sdpa(qg[a:z], kd[a:z, :, :n], vd[a:z, :, :n], m, scale))
        og = torch.cat(runs)
    o = og.transpose(1, 2).reshape(b, nh * d)
    return o if slot_of_row is None else o.index_select(0, slot_of_row)


# SDPA backends for GPU calls: not cuDNN's, which builds an execution plan for every new input shape (measured on an
# H200, session 30: 25 ms per call of the drafter, whose context grows every step; 86% of a speculative run)
_GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class cpu_scripted:  # noqa: N801 - used as a decorator-like wrapper of functions
    """`fn` scripted for CPU tensors, the same Python function for any other device, chosen per call by the
    device of the first argument (a tensor in every function wrapped here).

    On CPU the scripted call keeps a layer's kernels out of the interpreter. On other devices the Python function
    runs: TorchScript's profiling executor specialises (and on CUDA fuses and compiles) per input shape, and the
    engine's shapes change every step; there CUDA graphs and the Triton kernels take the launch overhead away.
    With `sdpa`, a GPU call runs with cuDNN's attention excluded (`_GPU_SDPA`). If scripting is unavailable,
    both are the Python function."""

    def __init__(self, fn, sdpa: bool = False) -> None:  # noqa: ANN001
        self.python, self.sdpa = fn, sdpa
        try:
            with warnings.catch_warnings():  # TorchScript is deprecated in favour of torch.compile, which needs a
                warnings.simplefilter("ignore", DeprecationWarning)  # C++ toolchain and recompiles per shape on CPU
                self.scripted = torch.jit.script(fn)
        except (RuntimeError, OSError, AttributeError):  # no TorchScript (or no source): the same maths in Python
            self.scripted = fn
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def for_tensor(self, x: torch.Tensor):  # noqa: ANN201
        """What a call with first argument `x` runs, chosen once: a model calling per layer skips the dispatch. Off
        the CPU that is the bare Python function: the caller holds `gpu_sdpa(x)` around its calls (one entry per
        forward instead of one per layer: `sdpa_kernel` costs ~10 µs)."""
        return self.scripted if x.is_cpu else self.python

    def __call__(self, x: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        if x.is_cpu:
            return self.scripted(x, *args, **kwargs)
        if not self.sdpa:
            return self.python(x, *args, **kwargs)
        with gpu_sdpa(x):
            return self.python(x, *args, **kwargs)


def gpu_sdpa(x: torch.Tensor):  # noqa: ANN201
    """The SDPA backends for work on `x`'s device, as a context: off the CPU cuDNN's attention is excluded
    (`_GPU_SDPA`); on the CPU nothing changes."""
    return contextlib.nullcontext() if x.is_cpu else sdpa_kernel(_GPU_SDPA)


pre_attention_fn = cpu_scripted(pre_attention)
post_attention_fn = cpu_scripted(post_attention)
group_attention_fn = cpu_scripted(group_attention, sdpa=True)
dense_attention_fn = cpu_scripted(dense_attention, sdpa=True)
