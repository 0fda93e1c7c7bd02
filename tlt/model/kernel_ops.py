"""The decoder layer's maths on the Triton kernels of `tlt.kernels` (the engine's `kernels = "triton"`).

The counterpart of `layer_ops` (TorchScript, the PyTorch path) for a model built with
`kernels="triton"`; `Transformer.forward` strings these together:

    x = embed(ids); h = rmsnorm(x, ln1_0)                                   rmsnorm kernel
    per layer:
      q = pre_attention(h, ...)    qkv projection (+bias) -> [Qwen3 q/k RMSNorm, PyTorch]
                                   -> RoPE kernel in place on the q/k views of qkv
                                   -> K/V written to their cache slots -> q [T, nh, d]
      o = attend(q, group, ...)    per AttentionGroup: paged decode kernel (one new token per
                                   sequence), paged tree kernel (speculative verify), or SDPA
                                   (prefill chunks: `layer_ops.group_attention`)
      h, x = fused_add_rmsnorm(o_proj(o), x, ln2)                           fused kernel
      h, x = fused_add_rmsnorm(mlp(h), x, ln1_next or final norm)           fused kernel

The residual stream is carried as in HF (x = x + delta rounded to the activation dtype, then the
norm of the rounded sum), so the fused kernel reproduces HF's rounding. Linears are plain
F.linear on the HF-layout weights (cuBLAS on GPU; never the CPU oneDNN packing).

Status: tests/test_engine_kernels.py runs the whole engine on CPU under TRITON_INTERPRET=1 against the
PyTorch path; tests/test_engine_cuda.py runs it compiled on a GPU (passed on an H200, session 30). GPU
timings of the kernels: BENCHMARKS.md, "GPU".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tlt.kernels.launch import Impl
from tlt.kernels.paged_attention import paged_decode_attention, paged_tree_attention
from tlt.kernels.rmsnorm import fused_add_rmsnorm_triton, rmsnorm_triton
from tlt.kernels.rotary import apply_rotary_triton
from tlt.model.layer_ops import rms

__all__ = ["attend", "fused_add_rmsnorm_triton", "pre_attention", "rmsnorm_triton"]


def pre_attention(
    h: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None, qk_norm: torch.Tensor | None,
    eps: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor, nh: int, kvh: int, d: int,
) -> torch.Tensor:
    """h: the normalised input [T, H] -> q [T, nh, d] (a view into the qkv projection); K/V cached.

    cos/sin: the model's [max_pos, d] tables (HF layout; the kernel reads the first half).
    """
    t = h.shape[0]
    qkv = F.linear(h, qkv_w, qkv_b)
    q_size, kv_size = nh * d, kvh * d
    if qk_norm is not None:  # Qwen3 per-head norms: PyTorch, HF's rounding (the row kernel takes one weight)
        qk = qkv[:, : q_size + kv_size].view(t, nh + kvh, d)
        qk.copy_(rms(qk, None, eps, True) * qk_norm)
    q = qkv[:, :q_size].view(t, nh, d)
    k = qkv[:, q_size : q_size + kv_size].view(t, kvh, d)
    apply_rotary_triton(q, k, positions, cos, sin, inplace=True)
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, qkv[:, q_size + kv_size :].view(t, kvh, d))
    return q


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, group, scale: float, impl: Impl = "triton") -> torch.Tensor:
    """One kernel group's attention -> [G * max_q, nh * d] (padded rows included, like SDPA groups).

    group: an AttentionGroup whose `kernel` tables were built by AttentionMetadata.build(for_kernels=True).
    impl: "triton" in the model; "torch" runs the kernels' PyTorch references on the same tables
    (tests check the tables against the SDPA path that way, without the interpreter).
    """
    t = group.kernel
    nh, d = q.shape[1], q.shape[2]
    if group.q_index is not None:
        q = q.index_select(0, group.q_index.view(-1))
    g = q.shape[0] // group.max_q
    if t.tree_mask is None:  # one new token per sequence, sees its whole context
        o = paged_decode_attention(q, kc, vc, t.block_tables, t.context_lens, scale, impl=impl)
    else:
        o = paged_tree_attention(q.view(g, group.max_q, nh, d), kc, vc, t.block_tables, t.context_lens,
                                 scale, t.tree_mask, impl=impl)
    return o.reshape(g * group.max_q, nh * d)
