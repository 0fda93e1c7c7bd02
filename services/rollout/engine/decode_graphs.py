"""DecodeGraphs: plain decode steps replayed from CUDA graphs captured per batch-size bucket.

A decode step of B sequences (one new token each) runs on static buffers padded to the smallest
bucket >= B (default buckets 1, 2, 4, 8, ... up to max_num_seqs):

    ids, positions, write slots  [bucket]             the new tokens (padding rows: token 0, position 0)
    block_tables                 [bucket, max_blocks] int32, every sequence's table at full width
    context_lens                 [bucket] int32       cached tokens + the new one (padding rows: 1)
    -> Transformer.forward on the Triton kernels -> hidden [bucket, H] -> rows 0..B-1

Shapes depend only on the bucket, never on the contexts: the paged decode kernel reads each row's
length from `context_lens` on the device and loops over its blocks, and its grid and split count
come from the table's fixed width. Padding rows write their K/V to a scratch block (the KV cache
holds one block more than the block manager hands out) and attend only to that slot, so they
never touch a real sequence. Graphs share one memory pool and are captured largest first.

Modes: "cuda" captures `torch.cuda.CUDAGraph`s (needs CUDA and kernels = "triton"; the PyTorch/SDPA
path has per-step shapes). "emulate" runs the same padded static-buffer step eagerly, without
graphs: what the CPU tests use (under TRITON_INTERPRET=1) to check the padding, the scratch block
and the fixed-width tables against the ordinary decode path. Speculative verify steps get their
own per-arm graphs in the same mode and scratch block when a speculative decoder is attached
(verify_graphs.py); prefill and the drafter's passes run eagerly as before.

Status: the "emulate" mode is tested on CPU; the "cuda" mode passed tests/test_engine_cuda.py on an H200
(session 30: the same tokens as the eager PyTorch path; on the tiny model a plain decode step 4.5x faster than
that path's). GPU presets leave decode_graphs = "off" until it is measured on a real model (BENCHMARKS.md, "GPU").
"""

from __future__ import annotations

from typing import Literal

import torch

from tlt.model.attention import AttentionGroup, AttentionMetadata, KernelTables
from tlt.model.transformer import Transformer

GraphMode = Literal["off", "cuda", "emulate"]


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_batch, then max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


class DecodeGraphs:
    def __init__(self, model: Transformer, block_size: int, max_blocks: int, scratch_block: int,
                 buckets: tuple[int, ...], mode: GraphMode) -> None:
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"decode graph mode must be 'cuda' or 'emulate', got {mode!r}")
        if model.kernels != "triton":
            raise ValueError("decode graphs need the Triton decode path (kernels = 'triton'): the PyTorch path's "
                             "attention shapes change every step")
        if mode == "cuda" and model.device.type != "cuda":
            raise ValueError(f"decode_graphs = 'cuda' needs a CUDA device, the model is on {model.device}")
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"graph buckets must be strictly increasing and >= 1, got {list(buckets)}")
        self.model, self.mode = model, mode
        self.block_size, self.max_blocks, self.scratch = block_size, max_blocks, scratch_block
        self.buckets = tuple(buckets)
        n, dev = buckets[-1], model.device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._pad_rows()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.per_bucket: dict[int, int] = {}  # replays per bucket

    def _pad_rows(self, start: int = 0, end: int | None = None) -> None:
        """Rows start..end-1: token 0 at position 0, written to and reading only the scratch slot."""
        for buf, value in ((self.ids, 0), (self.positions, 0), (self.slots, self.scratch * self.block_size),
                           (self.tables, self.scratch), (self.lens, 1)):
            buf[start:end] = value

    def _forward(self, b: int) -> torch.Tensor:
        """The decode forward of the first b static rows (what a graph records)."""
        tables = KernelTables(self.tables[:b], self.lens[:b], None)
        group = AttentionGroup(None, None, None, None, 0, None, 1, tables)
        meta = AttentionMetadata([1] * b, [], [], self.slots[:b], self.block_size, None, [group])
        return self.model.forward(self.ids[:b], self.positions[:b], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first, in one shared memory pool (mode "cuda")."""
        if self.mode != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            side = torch.cuda.Stream(device=self.model.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: Triton compiles, cuBLAS picks its kernels
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """One decode step of len(ids) sequences (context_lens = cached tokens before the new one) -> hidden [B, H]."""
        n = len(ids)
        b = self.bucket_for(n)
        if b is None:
            raise ValueError(f"batch {n} is larger than the largest graph bucket {self.buckets[-1]}")
        width = self.max_blocks
        rows = [t[:width] + [self.scratch] * (width - min(len(t), width)) for t in block_tables]
        self.ids[:n].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        self.slots[:n].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        self.tables[:n].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.lens[:n].copy_(torch.tensor([c + 1 for c in context_lens], dtype=torch.int32), non_blocking=True)
        self._pad_rows(n, b)  # the bucket's padding rows (a larger batch may have used them last time)
        self.per_bucket[b] = self.per_bucket.get(b, 0) + 1
        if self.mode == "cuda":
            self.graphs[b].replay()
            return self.outputs[b][:n].clone()  # the graph's output buffer is overwritten by the next replay
        return self._forward(b)[:n]
