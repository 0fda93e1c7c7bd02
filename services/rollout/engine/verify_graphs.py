"""VerifyGraphs: speculative verify passes replayed from CUDA graphs, per arm and batch-size bucket.

A verify step of B draft trees of at most Q = arm.draft_tokens nodes each runs on static buffers
padded to a batch bucket b >= B (the decode graphs' buckets, DecodeGraphs) and to Q nodes per tree:

    ids, positions, write slots  [b * Q]          row r * Q + j is node j of tree r
    block_tables                 [b, max_blocks]  int32, every sequence's table at full width
    context_lens                 [b] int32        cached tokens + Q (the kernel's last Q positions are the nodes)
    tree_mask                    [b, Q, Q] bool   node i sees node j (ancestor or self); an input, not baked in:
                                                  the trees' topology changes every step
    -> Transformer.forward (paged tree kernel) -> hidden [b * Q, H] -> the real nodes' rows

Which graphs exist is the plan (`plan_verify_graphs`): an arm gets graphs only for the buckets of the
batch sizes at which it can be chosen, i.e. sizes at or below the SD threshold that the bandit's bucket
boundaries route to a bucket holding the arm (and where the verify-token budget lets it run); a
static arm covers every size up to the threshold. Arms with the same Q share their graphs (the shape
depends on Q only). Plain decode steps, above the threshold or not, stay with DecodeGraphs.

Padding never touches a real sequence's KV: a tree's padding nodes (a tree smaller than Q, e.g. an
n-gram tree or a cut chain) and the padding rows write their K/V to the scratch block, as DecodeGraphs'
padding rows do; real nodes do not see padding nodes (their mask columns are off), and padding rows
read only scratch-block slots (full-scratch tables). The real nodes' rows are returned in the eager
path's order (`ModelRunner.extend` over the trees' real nodes), so the acceptance code is unchanged.

The drafter's own forward passes (EAGLE levels, n-gram lookup) stay eager: the tree expansion picks
its top-k beams per level with data-dependent shapes, and the drafter is small next to the target's
verify pass, which is what these graphs take off the CPU launch path.

Modes: "cuda" captures `torch.cuda.CUDAGraph`s (needs CUDA and kernels = "triton"); "emulate" runs
the same padded static-buffer step eagerly, without graphs: what the CPU tests use (under
TRITON_INTERPRET=1) to check padding, scratch writes, masks and tables against the eager verify path.

Status: the "emulate" mode is tested on CPU; the "cuda" mode passed tests/test_engine_cuda.py on an H200
(session 30: greedy-lossless, a graph replayed for every verify step). GPU presets leave decode_graphs = "off"
(which also turns these off) until it is measured on a real model (BENCHMARKS.md, "GPU").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tlt.model.attention import AttentionGroup, AttentionMetadata, KernelTables
from tlt.model.transformer import Transformer
from tlt.services.rollout.engine.decode_graphs import GraphMode
from tlt.services.rollout.spec.tree import Arm


def plan_verify_graphs(arms_at: Callable[[int], Iterable[Arm]], threshold: int,
                       buckets: tuple[int, ...]) -> dict[Arm, tuple[int, ...]]:
    """arm -> the batch buckets it needs graphs for: for every batch size 1..threshold (SD never runs
    above it), the bucket that size pads to, for each arm `arms_at(size)` may choose there. The "plain"
    arm verifies nothing (its steps are plain decodes) and gets none."""
    plan: dict[Arm, set[int]] = {}
    for size in range(1, threshold + 1):
        bucket = next((b for b in buckets if b >= size), None)
        if bucket is None:  # larger than any bucket (the engine never runs such a batch)
            break
        for arm in arms_at(size):
            if not arm.is_plain:
                plan.setdefault(arm, set()).add(bucket)
    return {arm: tuple(sorted(bs)) for arm, bs in sorted(plan.items())}


@dataclass
class _Static:
    """One node count Q's input buffers, sized for its largest bucket n."""

    ids: torch.Tensor  # [n * Q] int64
    positions: torch.Tensor  # [n * Q] int64
    slots: torch.Tensor  # [n * Q] int64
    tables: torch.Tensor  # [n, max_blocks] int32
    lens: torch.Tensor  # [n] int32
    mask: torch.Tensor  # [n, Q, Q] bool


class VerifyGraphs:
    def __init__(self, model: Transformer, block_size: int, max_blocks: int, scratch_block: int,
                 plan: dict[Arm, tuple[int, ...]], mode: GraphMode) -> None:
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"verify graph mode must be 'cuda' or 'emulate', got {mode!r}")
        if model.kernels != "triton":
            raise ValueError("verify graphs need the Triton tree-attention path (kernels = 'triton')")
        if mode == "cuda" and model.device.type != "cuda":
            raise ValueError(f"verify graphs 'cuda' need a CUDA device, the model is on {model.device}")
        self.model, self.mode, self.plan = model, mode, dict(plan)
        self.block_size, self.max_blocks, self.scratch = block_size, max_blocks, scratch_block
        shapes: dict[int, set[int]] = {}
        for arm, buckets in self.plan.items():
            shapes.setdefault(arm.draft_tokens, set()).update(buckets)
        self.shapes = {q: tuple(sorted(bs)) for q, bs in sorted(shapes.items())}  # Q -> buckets
        self.static = {q: self._buffers(q, bs[-1]) for q, bs in self.shapes.items()}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.per_shape: dict[tuple[int, int], int] = {}  # replays per (Q, bucket)

    def _buffers(self, q: int, n: int) -> _Static:
        dev = self.model.device
        rows = [torch.zeros(n * q, dtype=torch.int64, device=dev) for _ in range(3)]  # ids, positions, slots
        st = _Static(*rows, torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev),
                     torch.zeros(n, dtype=torch.int32, device=dev), torch.zeros(n, q, q, dtype=torch.bool, device=dev))
        self._pad_rows(st, q, 0, n)
        return st

    def _pad_rows(self, st: _Static, q: int, start: int, end: int) -> None:
        """Rows start..end-1: token 0 at position 0 written to the scratch block, reading only scratch slots
        (the kernel context is Q, all of it "new" and masked off: the rows' attention is 0)."""
        st.ids[start * q : end * q] = 0
        st.positions[start * q : end * q] = 0
        st.slots[start * q : end * q] = self.scratch * self.block_size
        st.tables[start:end] = self.scratch
        st.lens[start:end] = q
        st.mask[start:end] = False

    def _forward(self, q: int, b: int) -> torch.Tensor:
        """The verify forward of the first b static trees of Q nodes (what a graph records) -> [b * Q, H]."""
        st = self.static[q]
        tables = KernelTables(st.tables[:b], st.lens[:b], st.mask[:b])
        group = AttentionGroup(None, None, None, None, 0, None, q, tables)
        meta = AttentionMetadata([q] * b, [], [], st.slots[: b * q], self.block_size, None, [group])
        return self.model.forward(st.ids[: b * q], st.positions[: b * q], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per (Q, bucket), most tokens first, in one shared memory pool (mode "cuda")."""
        if self.mode != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for q, b in sorted(((q, b) for q, bs in self.shapes.items() for b in bs), key=lambda s: -s[0] * s[1]):
            side = torch.cuda.Stream(device=self.model.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: Triton compiles, cuBLAS picks its kernels
                for _ in range(2):
                    self._forward(q, b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[(q, b)] = self._forward(q, b)
            self.graphs[(q, b)] = graph
        torch.cuda.synchronize()

    def bucket_for(self, arm: Arm, batch: int) -> int | None:
        """The arm's smallest planned bucket holding `batch` trees, None if it has no graph for it."""
        return next((b for b in self.plan.get(arm, ()) if b >= batch), None)

    def fits(self, arm: Arm, context_lens: list[int]) -> bool:
        """A graph of the arm's shape takes this batch: a planned bucket, and every tree's Q positions
        inside the full-width block table."""
        limit = self.max_blocks * self.block_size
        return self.bucket_for(arm, len(context_lens)) is not None and max(context_lens) + arm.draft_tokens <= limit

    @torch.inference_mode()
    def run(self, arm: Arm, tokens: torch.Tensor, depth: torch.Tensor, tree_mask: torch.Tensor, counts: list[int],
            context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One verify step: trees tokens/depth [B, N] (N <= Q), tree_mask [B, N, N], real nodes counts[i],
        roots at cache positions context_lens -> hidden [sum(counts), H] of the real nodes, tree by tree
        (the rows `ModelRunner.extend` returns for the same trees)."""
        n, q, bs = len(counts), arm.draft_tokens, self.block_size
        b = self.bucket_for(arm, n)
        if b is None or not self.fits(arm, context_lens):
            raise ValueError(f"no verify graph of arm {arm} for {n} trees at contexts up to {max(context_lens)}")
        width = tokens.shape[1]
        ctx = torch.tensor(context_lens, dtype=torch.int64)
        real = torch.arange(q)[None, :] < torch.tensor(counts)[:, None]  # [B, Q]
        ids = torch.zeros(n, q, dtype=torch.int64)
        ids[:, :width] = tokens.cpu()
        pos = ctx[:, None].repeat(1, q)  # padding nodes: the root's position (any in range would do)
        pos[:, :width] += depth.cpu()
        rows = [t[: self.max_blocks] + [self.scratch] * (self.max_blocks - min(len(t), self.max_blocks))
                for t in block_tables]
        tables = torch.tensor(rows, dtype=torch.int32)
        cache_pos = (ctx[:, None] + torch.arange(q)[None, :]).clamp(max=self.max_blocks * bs - 1)
        blocks = tables.long().gather(1, cache_pos // bs)
        slots = torch.where(real, blocks * bs + cache_pos % bs, self.scratch * bs)  # padding nodes: scratch
        mask = torch.zeros(n, q, q, dtype=torch.bool)
        mask[:, :width, :width] = tree_mask.cpu().to(torch.bool)
        mask &= real[:, :, None] & real[:, None, :]  # nobody sees a padding node; padding nodes see the prefix only
        st = self.static[q]
        st.ids[: n * q].copy_(torch.where(real, ids, 0).view(-1), non_blocking=True)
        st.positions[: n * q].copy_(torch.where(real, pos, ctx[:, None]).view(-1), non_blocking=True)
        st.slots[: n * q].copy_(slots.view(-1), non_blocking=True)
        st.tables[:n].copy_(tables, non_blocking=True)
        st.lens[:n].copy_((ctx + q).to(torch.int32), non_blocking=True)
        st.mask[:n].copy_(mask, non_blocking=True)
        self._pad_rows(st, q, n, b)  # the bucket's padding rows (a larger batch may have used them last time)
        self.per_shape[(q, b)] = self.per_shape.get((q, b), 0) + 1
        if self.mode == "cuda":
            self.graphs[(q, b)].replay()
            hidden = self.outputs[(q, b)]
        else:
            hidden = self._forward(q, b)
        keep = (torch.arange(n)[:, None] * q + torch.arange(q)[None, :])[real]  # the real nodes' rows, in order
        return hidden.index_select(0, keep.to(hidden.device))  # a copy: the next replay overwrites the output
