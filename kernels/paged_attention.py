"""Paged attention for decode and for tree verification: Triton kernels, PyTorch reference, dispatch.

Layouts (the engine's KV cache):
    k_cache, v_cache  [num_blocks, block_size, Hkv, D]   (last dim contiguous)
    block_tables      [B, max_blocks] int32   logical block i of sequence b -> physical block
    context_lens      [B] int32               tokens in the cache for b, INCLUDING the query tokens
                                              (their K/V are written before attention runs)

- `paged_decode_attention(q [B, Hq, D], ...) -> [B, Hq, D]`: one new token per
  sequence attending to all `context_lens[b]` cached tokens.
- `paged_tree_attention(q [B, Q, Hq, D], ..., tree_mask [B, Q, Q] bool)`: Q new
  tokens per sequence sit at the last Q cache positions; query i sees every
  earlier (prefix) token and new token j iff tree_mask[b, i, j] (ancestor or
  self in the draft tree; a lower-triangular mask gives a causal chain).
  `tree_mask=None` lets every query see the whole context (what decode uses).

GQA: query head h reads kv head h // (Hq // Hkv), as HF's repeat_kv.

Kernel: one program per (sequence, KV head, row tile, split). The rows of a
tile are the (query token, query head) pairs that read that KV head: the
Hq/Hkv heads of the GQA group times the Q new tokens (decode: Q = 1), so each
K/V block is loaded once for all of them and both products are `tl.dot`s
(rows padded to >= 16). The program walks its share of the sequence's blocks
through the block table with an online softmax (running max m, running sum l,
fp32 accumulator; fp32 inputs use IEEE dots, never TF32; fp16/bf16 follow
flash attention and round p to the cache dtype for the p @ V product). With
one split it writes the normalised output; with S > 1 splits ("flash
decoding", for the long-context small-batch tail where B * Hkv programs
cannot fill the GPU) each split writes its partial output and log-sum-exp and
a second kernel merges them: out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M).
A query that sees no token gets 0 (not NaN) on both paths.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from tlt.kernels.launch import Impl, LazyKernel, check, next_pow2, use_triton


def paged_tree_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, tree_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Reference: gather each sequence's K/V through its block table, masked softmax in fp32."""
    batch, num_q, hq, dim = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(batch):
        ctx = int(context_lens[b])
        if ctx == 0:
            continue
        blocks = block_tables[b, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, hkv, dim)[:ctx].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].reshape(-1, hkv, dim)[:ctx].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), k) * scale
        allowed = torch.ones(num_q, ctx, dtype=torch.bool, device=q.device)
        if tree_mask is not None:
            first_new = ctx - num_q
            allowed[:, max(first_new, 0):] = tree_mask[b][:, max(-first_new, 0):]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
        out[b] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Reference decode attention: q [B, Hq, D] -> [B, Hq, D]."""
    return paged_tree_attention_ref(q[:, None], k_cache, v_cache, block_tables, context_lens, scale, None)[:, 0]


def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, mask_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qq, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb, stride_mb, stride_mq,
    stride_ob, stride_oq, stride_oh,
    scale, NUM_Q, HQ, HKV, BLOCKS_PER_SPLIT, MAX_BLOCKS,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr, PAGES: tl.constexpr,
):
    # Rows of the tile are (query token, query head in the KV head's group) pairs: every row
    # shares the K/V blocks of one (sequence, KV head), which are loaded once per tile.
    pid_bk = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bk // HKV
    kvh = pid_bk % HKV

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < NUM_Q * GROUP
    qi = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = q_ptr + b * stride_qb + qi * stride_qq + h * stride_qh
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & dmask[None, :], other=0.0)

    ctx = tl.load(lens_ptr + b)
    first_new = ctx - NUM_Q
    # one iteration takes PAGES cache blocks (BLOCK_N = PAGES * BLOCK_SIZE keys); BLOCKS_PER_SPLIT counts iterations
    start = split * BLOCKS_PER_SPLIT
    end = tl.minimum(start + BLOCKS_PER_SPLIT, tl.cdiv(tl.cdiv(ctx, BLOCK_SIZE), PAGES))
    page = offs_n // (BLOCK_N // PAGES)  # PAGES > 1: which of the iteration's blocks key n is in, and its slot there
    slot = offs_n % (BLOCK_N // PAGES)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i in range(start, end):
        if PAGES == 1:  # one block per iteration (BLOCK_N >= BLOCK_SIZE, padded): the path measured on the H200
            phys = tl.load(bt_ptr + b * stride_btb + i).to(tl.int64)
            pos = i * BLOCK_SIZE + offs_n
            col_ok = (offs_n < BLOCK_SIZE) & (pos < ctx)
            kv_mask = col_ok[:, None] & dmask[None, :]
            k = tl.load(k_ptr + phys * stride_kb + offs_n[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + phys * stride_vb + offs_n[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
        else:  # PAGES blocks per iteration (BLOCK_SIZE a power of two): each key's block through the table
            logical = i * PAGES + page
            pos = logical * BLOCK_SIZE + slot
            col_ok = pos < ctx
            phys_n = tl.load(bt_ptr + b * stride_btb + logical, mask=col_ok & (logical < MAX_BLOCKS), other=0)
            phys_n = phys_n.to(tl.int64)
            kv_mask = col_ok[:, None] & dmask[None, :]
            k = tl.load(k_ptr + phys_n[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + phys_n[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        valid = row_ok[:, None] & col_ok[None, :]
        if HAS_MASK:
            j = pos - first_new
            is_new = col_ok & (j >= 0)
            allowed = tl.load(mask_ptr + b * stride_mb + qi[:, None] * stride_mq + j[None, :],
                              mask=row_ok[:, None] & is_new[None, :], other=0)
            valid = valid & ((j < 0)[None, :] | (allowed != 0))
        s = tl.where(valid, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: keep exp() finite
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_any = l_i > 0.0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + b * stride_ob + qi * stride_oq + h * stride_oh
        tl.store(dst[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = ((b * NUM_Q + qi) * HQ + h) * NUM_SPLITS + split  # partials are [B*Q, Hq, S, (D)] contiguous fp32
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=store_mask)
        lse = tl.where(has_any, m_i + tl.log(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oq, stride_oh,
    NUM_Q, HQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_bq = tl.program_id(0)
    h = tl.program_id(1)
    b = pid_bq // NUM_Q
    qi = pid_bq % NUM_Q
    row0 = (pid_bq * HQ + h) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row0 + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_ref)  # 0 for empty splits
    parts = tl.load(part_out_ptr + (row0 + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + qi * stride_oq + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=dmask)


paged_attention_kernel = LazyKernel(_paged_attention_kernel)
merge_splits_kernel = LazyKernel(_merge_splits_kernel)

# Split heuristic: aim for this many programs in flight, each walking at least MIN_BLOCKS_PER_SPLIT blocks.
TARGET_PROGRAMS = 512
MIN_BLOCKS_PER_SPLIT = 8
MAX_SPLITS = 64


def default_num_splits(programs: int, max_blocks: int) -> int:
    """Splits per (sequence, query, head): 1 when the grid already fills the GPU. Depends on shapes only
    (no device sync), so it is stable under CUDA graph capture."""
    wanted = math.ceil(TARGET_PROGRAMS / max(programs, 1))
    useful = math.ceil(max_blocks / MIN_BLOCKS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def paged_tree_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, tree_mask: torch.Tensor | None,
    out: torch.Tensor | None = None, num_splits: int | None = None, pages: int = 1, num_warps: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Paged attention for q [B, Q, Hq, D] with the Triton kernel (see module docstring).

    `pages` cache blocks per loop iteration (1, the default, is what the engine runs and the H200 measured; > 1
    needs a power-of-two block size and gathers each key's block through the table: fewer, larger iterations, a
    candidate for the tree kernel's long-context speed, BENCHMARKS.md "GPU"); `num_warps` and `block_m` (rows
    per tile, a power of two >= 16) override the choices below. `num_splits` splits the iterations."""
    check(q.dim() == 4, f"q must be [B, Q, Hq, D], got {tuple(q.shape)}")
    batch, num_q, hq, dim = q.shape
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "k_cache, v_cache must be equal [blocks, block_size, Hkv, D]")
    _, block_size, hkv, cache_dim = k_cache.shape
    check(cache_dim == dim, f"cache head dim {cache_dim} != q head dim {dim}")
    check(hkv >= 1 and hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}")
    check(q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    check(q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {q.dtype}")
    check(q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "q and caches need a contiguous last dim")
    check(block_tables.dim() == 2 and block_tables.shape[0] == batch and block_tables.dtype == torch.int32,
          f"block_tables must be int32 [B, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    check(block_tables.stride(1) == 1, "block_tables needs a contiguous last dim")
    check(context_lens.shape == (batch,) and context_lens.dtype == torch.int32 and context_lens.is_contiguous(),
          "context_lens must be contiguous int32 [B]")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    check(len(devices) == 1, f"all inputs must be on one device, got {devices}")
    if tree_mask is not None:
        check(tree_mask.shape == (batch, num_q, num_q) and tree_mask.dtype == torch.bool,
              f"tree_mask must be bool [B, Q, Q] = {(batch, num_q, num_q)}, got {tree_mask.dtype} {tuple(tree_mask.shape)}")
        check(tree_mask.stride(2) == 1 and tree_mask.device == q.device, "tree_mask needs a contiguous last dim on q's device")
        mask_arg = tree_mask.view(torch.uint8)
        stride_mb, stride_mq = mask_arg.stride(0), mask_arg.stride(1)
    else:
        mask_arg, stride_mb, stride_mq = context_lens, 0, 0  # never read
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, "out must match q")
    max_blocks = block_tables.shape[1]
    check(num_warps is None or num_warps in (1, 2, 4, 8, 16), f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    check(isinstance(pages, int) and pages >= 1
          and (pages == 1 or (pages == next_pow2(pages) and block_size == next_pow2(block_size))),
          f"pages must be 1, or a power of two with a power-of-two block size; got pages {pages}, block size {block_size}")
    check(pages == 1 or pages * block_size >= 16,
          f"pages x block size must be >= 16 keys (tl.dot), got {pages} x {block_size}")
    group = hq // hkv
    rows = num_q * group  # (query token, head of the group) rows per (sequence, KV head)
    if block_m is None:
        block_m = max(16, min(64, next_pow2(rows)))  # tl.dot needs every tile dim >= 16
    check(block_m >= 16 and block_m == next_pow2(block_m), f"block_m must be a power of two >= 16, got {block_m}")
    row_tiles = math.ceil(rows / block_m)
    iterations = math.ceil(max_blocks / pages)  # loop iterations over the widest table
    splits = default_num_splits(batch * hkv * row_tiles, iterations) if num_splits is None else num_splits
    check(splits >= 1, f"num_splits must be >= 1, got {splits}")
    per_split = max(1, math.ceil(iterations / splits))
    if splits > 1:
        part_out = torch.empty((batch * num_q, hq, splits, dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch * num_q, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # never read
    if batch * num_q * hq == 0:
        return out
    paged_attention_kernel[(batch * hkv, row_tiles, splits)](
        q, k_cache, v_cache, block_tables, context_lens, mask_arg, out, part_out, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), stride_mb, stride_mq,
        out.stride(0), out.stride(1), out.stride(2),
        float(scale), num_q, hq, hkv, per_split, max_blocks,
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_N=max(16, next_pow2(block_size)) if pages == 1 else pages * block_size,
        BLOCK_M=block_m, HEAD_DIM=dim, BLOCK_D=max(16, next_pow2(dim)), HAS_MASK=tree_mask is not None,
        NUM_SPLITS=splits, IEEE=q.dtype == torch.float32, PAGES=pages,
        # keep the [M, D] accumulator out of spills
        num_warps=num_warps or (8 if block_m * next_pow2(dim) >= 64 * 128 else 4),
    )
    if splits > 1:
        merge_splits_kernel[(batch * num_q, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1), out.stride(2), num_q, hq,
            HEAD_DIM=dim, BLOCK_D=next_pow2(dim), NUM_SPLITS=splits, BLOCK_S=next_pow2(splits),
        )
    return out


def paged_decode_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention q [B, Hq, D] -> [B, Hq, D] with the Triton kernel."""
    check(q.dim() == 3, f"q must be [B, Hq, D], got {tuple(q.shape)}")
    out4 = None if out is None else out[:, None]
    return paged_tree_attention_triton(
        q[:, None], k_cache, v_cache, block_tables, context_lens, scale, None, out=out4, num_splits=num_splits
    )[:, 0]


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, impl: Impl = "auto",
) -> torch.Tensor:
    """Decode attention: the Triton kernel on CUDA, the reference elsewhere (see `tlt.kernels.launch`)."""
    if use_triton(q, impl):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, tree_mask: torch.Tensor | None, impl: Impl = "auto",
) -> torch.Tensor:
    """Tree/verify attention for Q new tokens per sequence (see module docstring)."""
    if use_triton(q, impl):
        return paged_tree_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, tree_mask)
    return paged_tree_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, tree_mask)
