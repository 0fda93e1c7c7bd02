"""Attention over the paged KV cache: per-step metadata and the grouped attention every layer runs.

    AttentionMetadata.build(q_lens, context_lens, block_tables, ...)   once per engine step
      -> groups: decode rows (one new token each) and extend rows (prefill chunks, verify trees) apart,
         so a long prefill does not pad every decode row; each group is one padded SDPA call (gather
         indices, block index, mask) or, built for_kernels, one Triton launch (KernelTables)
    attend_groups(q, k_cache, v_cache, metadata, scale)                 per layer -> [T, nh * d]

Layout and conventions are those of `tlt.model.transformer` (its docstring): sequence b's new tokens sit
at cache positions context_lens[b] .. context_lens[b] + q_lens[b] - 1 of its block table; an optional
per-sequence [q, q] tree mask replaces the causal mask among new tokens (speculative verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.model.layer_ops import fold_mask, group_attention_fn


# An SDPA group pads every sequence to the group's longest context and its most new tokens, and masks the
# padding: SDPA computes it all the same. A verify step of a long-tail rollout pads ~26% (session 34: 32
# prompts of 18-74 tokens x 8 samples; contexts diverge further as sequences accept different numbers of
# drafts), so on the CPU such steps are split by length (the one-token rows of a mixed step and the others, each
# into at most MAX_PARTS groups). Costs in (query row x key position) units, measured
# on the CI CPU at the tiny model's shape, one thread (BENCHMARKS.md, "Session 34"): SDPA ~16 ns a unit at
# batch 32-128, the gather of a key position ~2.5 units, a group's fixed cost per layer ~25 us, ~2,000 units.
MAX_PARTS = 4
GROUP_UNITS = 2000
GATHER_UNITS = 2.5
_CUTS = 16  # candidate boundaries: sequences sorted by length, split only at multiples of ceil(n / _CUTS)


def split_by_length(ix: list[int], keys: list[int], q_lens: list[int], max_parts: int) -> list[list[int]]:
    """Sequences `ix` as at most `max_parts` groups of similar length, or `[ix]` when splitting does not pay.

    keys[i]: the key positions sequence i attends (context + new tokens), q_lens[i] its new tokens. A group
    costs GROUP_UNITS + G x max key x (max new tokens + GATHER_UNITS); the split minimises the sum over
    boundaries in the sorted order (`contiguous_split`). Each group keeps its sequences in batch order.
    """
    if len(ix) < 2 or max_parts < 2:
        return [ix]
    order = sorted(ix, key=keys.__getitem__)
    bounds = contiguous_split([keys[i] for i in order], [q_lens[i] for i in order], max_parts, GROUP_UNITS,
                              GATHER_UNITS)
    if len(bounds) == 2:
        return [ix]
    return [sorted(order[a:b]) for a, b in zip(bounds, bounds[1:])]


def contiguous_split(keys: list[int], q_lens: list[int], max_parts: int, group_units: float,
                     gather_units: float) -> list[int]:
    """Boundaries 0 = b_0 < ... < b_k = n of at most `max_parts` runs of consecutive rows that minimise
    sum over runs of group_units + rows x max key x (max new tokens + gather_units).

    An exact DP over candidate cuts at multiples of ceil(n / _CUTS): O(n + _CUTS^2 x max_parts) per step.
    Rows sorted by key make the runs groups of similar length (`split_by_length`); the decode mirror's
    slots are kept nearly so (`decode_mirror`).
    """
    n = len(keys)
    if n < 2 or max_parts < 2:
        return [0, n]
    size = -(-n // _CUTS)
    cuts = list(range(0, n, size)) + [n]
    m = len(cuts)
    chunk_k = [max(keys[cuts[c] : cuts[c + 1]]) for c in range(m - 1)]
    chunk_q = [max(q_lens[cuts[c] : cuts[c + 1]]) for c in range(m - 1)]
    cost = [[0.0] * m for _ in range(m)]  # cost[a][b]: rows cuts[a] .. cuts[b] - 1 as one run
    for a in range(m - 1):
        mk = mq = 0
        for b in range(a + 1, m):
            mk, mq = max(mk, chunk_k[b - 1]), max(mq, chunk_q[b - 1])
            cost[a][b] = group_units + (cuts[b] - cuts[a]) * mk * (mq + gather_units)

    inf = float("inf")
    best = [[inf] * m for _ in range(max_parts + 1)]  # best[k][e]: cuts[0] .. cuts[e] in k runs
    back = [[0] * m for _ in range(max_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, max_parts + 1):
        for e in range(1, m):
            for a in range(k - 1, e):
                c = best[k - 1][a] + cost[a][e]
                if c < best[k][e]:
                    best[k][e], back[k][e] = c, a
    k = min(range(1, max_parts + 1), key=lambda j: best[j][m - 1])
    bounds, e = [n], m - 1
    for j in range(k, 0, -1):
        e = back[j][e]
        bounds.append(cuts[e])
    return bounds[::-1]


@dataclass
class KernelTables:
    """What the Triton paged-attention kernels read for one group (`tlt.kernels.paged_attention`).

    Queries are padded to max_q per sequence (left-aligned, like the SDPA groups): sequence g's n_g
    new tokens sit at cache positions ctx_g .. ctx_g + n_g - 1, and the kernel is told the context
    ctx_g + max_q, so its "last max_q positions" are those tokens plus padding columns that the
    tree mask hides (padding positions past a sequence's blocks read block 0, masked out).
    """

    block_tables: torch.Tensor  # [G, nb] int32, padded with block 0
    context_lens: torch.Tensor  # [G] int32: cached tokens + max_q
    tree_mask: torch.Tensor | None  # [G, max_q, max_q] bool (row i sees new token j); None: decode rows


@dataclass
class AttentionGroup:
    """Sequences attended together: one padded SDPA call, or one Triton kernel launch when `kernel` is set."""

    q_index: torch.Tensor | None  # [G, max_q] flat token index per (seq, query), None when rows are 0..G-1
    out_index: torch.Tensor | None  # [n_valid] flat token index of the valid padded rows, None when identity
    valid: torch.Tensor | None  # [G*max_q] bool, which padded rows are real tokens
    block_index: torch.Tensor | None  # [G * nb] block ids of each sequence (padded with block 0); keys = blocks[:, :lk]
    lk: int  # keys attended per sequence (the longest context in the group; shorter ones are masked)
    mask: torch.Tensor | None  # [G, 1, max_q, Lk] bool, True = attend; None = every key visible
    max_q: int
    kernel: KernelTables | None = None  # set for decode / tree groups built for the Triton kernels (SDPA fields unused)
    # SDPA groups: the K and V gather buffers of this step, allocated by the first layer and reused by the
    # others (a fresh buffer per layer page-faults: ~5x the copy itself for a batch-64 decode on CPU)
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None
    # SDPA groups: `mask` folded for the query heads per K/V head (`layer_ops.fold_mask`), made by the first
    # layer and reused by the others; `folded` says it was made (a None mask folds to None)
    folded_mask: torch.Tensor | None = None
    folded: bool = False

    def sdpa_mask(self, groups: int) -> torch.Tensor | None:
        """`mask` as `layer_ops.grouped_sdpa` takes it with `groups` query heads per K/V head (once per step)."""
        if not self.folded:
            self.folded_mask, self.folded = fold_mask(self.mask, groups), True
        return self.folded_mask


@dataclass
class AttentionMetadata:
    """A flattened batch: per sequence its new-token count, cached length, blocks and write slots."""

    q_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    tree_masks: list[torch.Tensor | None] | None = None  # per sequence [q, q] bool (row i may see new token j)
    groups: list[AttentionGroup] | None = None

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        slot_mapping: torch.Tensor | None = None,
        tree_masks: list[torch.Tensor | None] | None = None,
        device: torch.device | str = "cpu",
        for_kernels: bool = False,
        max_parts: int | None = None,
    ) -> AttentionMetadata:
        """Derive the gather indices and masks once per step (shared by every layer).

        for_kernels: the model runs the Triton kernels (`Transformer.kernels == "triton"`): decode
        and tree groups get `KernelTables` instead of SDPA masks; prefill groups stay SDPA.
        max_parts: SDPA groups other than a pure decode step's are split by length into at most this
        many (`split_by_length`); None: MAX_PARTS on the CPU, 1 elsewhere (unmeasured off the CPU, where
        each group is more kernel launches). The Triton kernels take ragged lengths as they are.
        """
        if slot_mapping is None:
            slots = []
            for q, c, bt in zip(q_lens, context_lens, block_tables):
                slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(c, c + q))
            slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        meta = cls(q_lens, context_lens, block_tables, slot_mapping, block_size, tree_masks)
        if tree_masks is None and all(q == 1 for q in q_lens):
            meta.groups = [meta._decode_group(device, for_kernels)]
            return meta
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        has_tree = [tree_masks is not None and tree_masks[i] is not None for i in range(len(q_lens))]
        single = [i for i, q in enumerate(q_lens) if q == 1 and not has_tree[i]]
        multi = [i for i, q in enumerate(q_lens) if not (q == 1 and not has_tree[i])]
        parts = [ix for ix in (single, multi) if ix]
        if max_parts is None:
            max_parts = MAX_PARTS if torch.device(device).type == "cpu" else 1
        if max_parts > 1 and not for_kernels:
            keys = [c + q for c, q in zip(context_lens, q_lens)]
            parts = [part for ix in parts for part in split_by_length(ix, keys, q_lens, max_parts)]
        meta.groups = [meta._group(ix, starts, device, for_kernels) for ix in parts]
        return meta

    def _block_table(self, ix, lk: int, dtype: torch.dtype) -> torch.Tensor:
        """[G, nb] block ids of sequences `ix` covering `lk` positions, padded with block 0."""
        nb = (lk + self.block_size - 1) // self.block_size
        rows = [self.block_tables[i][:nb] for i in ix]
        return torch.tensor([r + [0] * (nb - len(r)) for r in rows], dtype=dtype)

    def _decode_group(self, device, for_kernels: bool) -> AttentionGroup:
        """Every sequence has one new token and no tree: row b is flat token b, key j visible iff j <= ctx_b."""
        lk = max(self.context_lens) + 1
        everyone = range(len(self.block_tables))
        if for_kernels:
            bt32 = self._block_table(everyone, lk, torch.int32)
            lens = torch.tensor([c + 1 for c in self.context_lens], dtype=torch.int32)
            return AttentionGroup(None, None, None, None, lk, None, 1, KernelTables(bt32.to(device), lens.to(device), None))
        bt = self._block_table(everyone, lk, torch.int64)
        if min(self.context_lens) == lk - 1:
            mask = None  # every row sees exactly its lk keys (one sequence, or equal contexts as in a GRPO group)
        else:
            ctx = torch.tensor(self.context_lens, dtype=torch.int64)
            mask = (torch.arange(lk)[None, :] <= ctx[:, None])[:, None, None, :].to(device)
        return AttentionGroup(None, None, None, bt.view(-1).to(device), lk, mask, 1)

    def _group(self, ix: list[int], starts: list[int], device, for_kernels: bool) -> AttentionGroup:
        g = len(ix)
        q = torch.tensor([self.q_lens[i] for i in ix], dtype=torch.int64)
        ctx = torch.tensor([self.context_lens[i] for i in ix], dtype=torch.int64)
        max_q = int(q.max())
        trees = [self.tree_masks[i] if self.tree_masks is not None else None for i in ix]
        has_tree = any(tm is not None for tm in trees)
        s = torch.tensor([starts[i] for i in ix], dtype=torch.int64)
        flat = s[:, None] + torch.arange(max_q)[None, :]
        valid = (torch.arange(max_q)[None, :] < q[:, None]).reshape(-1)
        # every sequence, each with max_q new tokens (pure decode, or a verify step over equal trees):
        # padded row r is flat token r, nothing to gather or scatter
        # (`ix` in batch order: true of every group `build` makes; checked, as the fast path depends on it)
        identity = g == len(self.q_lens) and all(i == r for r, i in enumerate(ix)) and bool((q == max_q).all())
        flat = flat.clamp(max=starts[-1] - 1)  # padded rows read some real token; their output is dropped
        q_index = None if identity else flat.to(device)
        out_index = None if identity else flat.reshape(-1)[valid].to(device)
        if for_kernels and (max_q == 1 or has_tree):  # decode rows or a verify step; prefill chunks stay SDPA
            lk = int(ctx.max()) + max_q
            bt32 = self._block_table(ix, lk, torch.int32)
            tree = None
            if has_tree:  # real nodes top-left, padding rows/columns hidden; a plain chunk is causal
                tree = torch.zeros(g, max_q, max_q, dtype=torch.bool)
                for r, tm in enumerate(trees):
                    n = int(q[r])
                    tree[r, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril_() if tm is None else tm.to(torch.bool).cpu()
                tree = tree.to(device)
            tables = KernelTables(bt32.to(device), (ctx + max_q).to(torch.int32).to(device), tree)
            return AttentionGroup(q_index, out_index, valid.to(device), None, lk, None, max_q, tables)
        lk = int((q + ctx).max())
        bt = self._block_table(ix, lk, torch.int64)
        j = torch.arange(lk)[None, None, :]
        qi = torch.arange(max_q)[None, :, None]
        c3, q3 = ctx[:, None, None], q[:, None, None]
        # cached keys always visible; new key k = j - ctx visible to query i when k <= i (causal)
        mask = (j < c3) | ((j - c3 <= qi) & (j < c3 + q3))
        for r, (i, tm) in enumerate(zip(ix, trees)):
            if tm is not None:
                c, n = self.context_lens[i], self.q_lens[i]
                mask[r, :n, c : c + n] = tm.to(torch.bool).cpu()
        return AttentionGroup(
            q_index=q_index,
            out_index=out_index,
            valid=valid.to(device),
            block_index=bt.view(-1).to(device),
            lk=lk,
            mask=mask[:, None].to(device),
            max_q=max_q,
        )


def attend_groups(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, attn: AttentionMetadata, scale: float,
                  kernel_attend=None) -> torch.Tensor:
    """Attention of every new token -> [T, nh * d]. q: [T, nh, d]; kc/vc: one layer's caches [num_blocks, block_size, kvh, d].

    Groups with `KernelTables` go to `kernel_attend` (`kernel_ops.attend`), the others to SDPA. Off the CPU, call it
    inside `layer_ops.gpu_sdpa(q)` (as `Transformer.forward` does) to keep cuDNN's per-shape attention plans out.
    """
    t, nh, d = q.shape
    groups = attn.groups
    assert groups is not None, "AttentionMetadata.build() derives the groups"
    out = q.new_empty(t, nh * d) if len(groups) > 1 or groups[0].out_index is not None else None
    for g in groups:
        if g.kernel is not None:
            assert kernel_attend is not None, "metadata built for_kernels=True needs a model with kernels='triton'"
            og = kernel_attend(q, kc, vc, g, scale)
        else:
            if g.scratch is None:
                shape = (g.block_index.shape[0], *kc.shape[1:])
                g.scratch = (kc.new_empty(shape), vc.new_empty(shape))
            og = group_attention_fn.for_tensor(q)(q, kc, vc, g.q_index, g.block_index, g.lk,
                                                  g.sdpa_mask(nh // kc.shape[2]), g.max_q, scale, *g.scratch)
        if out is None:
            return og
        out.index_copy_(0, g.out_index, og if g.max_q == 1 else og[g.valid])
    return out
