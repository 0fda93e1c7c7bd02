"""ModelRunner: a scheduled batch -> model inputs -> hidden states and logits of the emitting rows.

    ScheduledBatch (seqs, new-token counts)
      -> input_ids [T], positions [T], AttentionMetadata (block tables, context lengths, write slots)
      -> Transformer.forward -> hidden [T, H] -> rows that end a sequence's known tokens
      -> compute_logits on those rows only

The runner owns the model and its KV cache. `extend` (any q_len per sequence,
optional tree masks) and `copy_slots` are public for speculative decoding.
With a model built with kernels="triton" the metadata also carries what the
Triton kernels read (int32 block tables, context lengths, padded tree masks),
built here once per step and shared by every layer. With decode graphs
(`EngineConfig.decode_graphs`), pure decode steps go through `DecodeGraphs`
(static buffers padded to a batch-size bucket, replayed from CUDA graphs), and a speculative
decoder attached later adds its per-arm verify graphs (`enable_verify_graphs`, `VerifyGraphs`) in
the same mode, writing their padding to the same scratch block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.model.attention import AttentionMetadata
from tlt.model.transformer import Transformer
from tlt.services.rollout.engine.block_manager import TailCopy
from tlt.services.rollout.engine.decode_graphs import DecodeGraphs, GraphMode
from tlt.services.rollout.engine.scheduler import ScheduledBatch
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.engine.verify_graphs import VerifyGraphs
from tlt.services.rollout.spec.tree import Arm


@dataclass
class RunOutput:
    emit_seqs: list[Sequence]  # sequences whose chunk reached their last token: they emit one token
    hidden: torch.Tensor  # [len(emit_seqs), H] last-layer hidden (post final norm) that produces that token
    logits: torch.Tensor  # [len(emit_seqs), V]


class ModelRunner:
    def __init__(self, model: Transformer, block_size: int, num_blocks: int, graphs: GraphMode = "off",
                 graph_buckets: tuple[int, ...] = (), max_blocks_per_seq: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.for_kernels = model.kernels == "triton"
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None  # added by a speculative decoder (enable_verify_graphs)
        self.graph_mode, self.max_blocks_per_seq, self.num_blocks = graphs, max_blocks_per_seq, num_blocks
        # with decode graphs the cache has one block more than the block manager hands out: the padding
        # rows' scratch block (block id num_blocks)
        model.allocate_kv_cache(num_blocks + (graphs != "off"), block_size)
        if graphs != "off":
            self.graphs = DecodeGraphs(model, block_size, max_blocks_per_seq, num_blocks, graph_buckets, graphs)
            self.graphs.capture()

    def enable_verify_graphs(self, plan: dict[Arm, tuple[int, ...]]) -> VerifyGraphs | None:
        """Build (and in mode "cuda" capture) the verify graphs of `plan` (arm -> batch buckets), in the
        decode graphs' mode and scratch block; None when decode graphs are off or the plan is empty."""
        if self.graph_mode == "off" or not plan:
            self.verify_graphs = None
            return None
        self.verify_graphs = VerifyGraphs(self.model, self.block_size, self.max_blocks_per_seq, self.num_blocks,
                                          plan, self.graph_mode)
        self.verify_graphs.capture()
        return self.verify_graphs

    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunOutput:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        emit: list[Sequence] = []
        ctx: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new):
            c = seq.num_computed
            ctx.append(c)
            if n == 1:
                ids.append(seq.token_ids[c])
                pos.append(c)
                slots.append(seq.block_table[c // bs] * bs + c % bs)
            else:
                ids.extend(seq.token_ids[c : c + n])
                pos.extend(range(c, c + n))
                bt = seq.block_table
                slots.extend(bt[p // bs] * bs + p % bs for p in range(c, c + n))
            if c + n == seq.num_tokens:
                rows.append(len(ids) - 1)
                emit.append(seq)
        dev = self.device
        if self.graphs is not None and len(emit) == len(ids) and self.graphs.bucket_for(len(ids)) is not None:
            # a pure decode step (one new token per sequence, each emitting): the padded static-buffer path
            hidden = self.graphs.run(ids, pos, slots, [s.block_table for s in batch.seqs], ctx)
            return RunOutput(emit, hidden, self.model.compute_logits(hidden))
        meta = AttentionMetadata.build(
            batch.num_new, ctx, [s.block_table for s in batch.seqs], bs,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), device=dev, for_kernels=self.for_kernels,
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev), meta
        )
        if len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, dtype=torch.int64, device=dev)]
        return RunOutput(emit, hidden, self.model.compute_logits(hidden))

    @torch.inference_mode()
    def extend(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        q_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        tree_masks: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """General forward for speculative verify: new tokens at cache positions ctx..ctx+q-1 -> hidden [T, H]."""
        meta = AttentionMetadata.build(q_lens, context_lens, block_tables, self.block_size,
                                       tree_masks=tree_masks, device=self.device, for_kernels=self.for_kernels)
        return self.model.forward(input_ids, positions, meta)

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        self.model.copy_slots(src_slots, dst_slots)

    def copy_tails(self, copies: list[TailCopy]) -> None:
        """Copy partial prompt tails' K/V between blocks (`BlockManager.allocate`), one call for the step."""
        bs = self.block_size
        src = [c.src * bs + i for c in copies for i in range(c.count)]
        dst = [c.dst * bs + i for c in copies for i in range(c.count)]
        self.model.copy_slots(torch.tensor(src, dtype=torch.int64, device=self.device),
                              torch.tensor(dst, dtype=torch.int64, device=self.device))
