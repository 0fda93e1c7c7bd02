"""DecodeMirror: a dense copy of the decode batch's K/V, so a plain decode step does not gather the paged cache.

The PyTorch attention path (`layer_ops.group_attention`) copies every sequence's K/V blocks out of
the paged cache before SDPA: O(batch x context) bytes per layer per step, most of a CPU decode step
at batch 64 and a few hundred tokens of context. Consecutive decode steps mostly attend the same
sequences in the same order, one token longer each, so the mirror keeps those rows densely,

    k, v per layer: [B, kvh, cap, d]   slot s = positions 0 .. ctx of the batch row it holds

and a decode step appends only its new token per row (after the paged cache got it: that cache stays
the source of truth, written every step) and runs SDPA on the first lk positions with the gather
path's mask (the same values per (row, head): bitwise the same output, up to the runs below).
Head-major, each head's keys are one contiguous run: SDPA is ~20% faster on it than on the cache's
token-major layout.

    plan(meta)    per decode step: append when the mirror holds this batch (after compacting away
                  finished rows), else rebuild (one gather); the first decode step after another write
                  gathers instead (below)
    commit(step)  after the forward completed: the mirror now holds this step's rows
    invalidate()  any other write to the cache (prefill, verify, copy_slots); a failed forward leaves
                  nothing held either (`plan` let go of it), and the next decode step rebuilds

A rebuild pays for itself only over the steps that append after it. The first decode step after another
write to the cache (a prefill, a speculative verify pass) gathers, as the gather path does, and the next
consecutive decode step rebuilds. With speculation on, a plain step between two verify passes (the
bandit's "plain" arm) is alone: rebuilding for it copied every row's K/V a second time, into a mirror the
next verify pass invalidated (session 33: 8% of a learned whole-rollout run's CPU time on the tiny
model). Without speculation this costs one gather per prefill, after which decoding appends as before.

Whether the mirror holds a batch is decided from the data it mirrors, not from sequence identity:
every row's context exactly one longer, and every row's block table starting with the blocks already
mirrored; with every other cache write invalidating, those slots still hold what was copied.

When sequences finish, the batch keeps the others in order. A rebuild then copied every row again
(session 34: 26 rebuilds in a 256-sequence long-tail rollout; compacting instead took 3.5% off its
CPU time); instead the rows held in slots past the new batch size move into the finished rows' slots,
one row's K/V per layer each, and batch row b may then live in another slot (`MirrorStep.slots`): queries are
put in slot order and outputs back (`layer_ops.dense_attention`), the same SDPA per row. With one
thread that is bitwise the gather path's output; with several, CPU SDPA rounds some rows differently
by their position in the batch (measured 1e-8 - 6e-8 at some shapes, as any change of a batch's
composition already does), so a row in another slot may differ by that much. Anything else (a
reordering, a capacity outgrown) rebuilds; a join or a preemption comes through a prefill, another
write, so the first decode step after it gathers and the next rebuilds.
A weight update or a prefix-cache reset rewrites no cached K/V: the mirror stays valid through them.

On the CPU a rebuild puts the rows in slots sorted by context when runs pay, and each step attends runs
of slots apart, each over its own longest context (`attention.contiguous_split`, at most `max_parts`
runs, a run's fixed cost SLOT_RUN_UNITS): one SDPA call padded every row to the longest, ~26% of the
keys a long-tail step attended (session 34; the SDPA of the mirror is ~half of a plain rollout's CPU
time). The runs are chosen at a rebuild and after a compaction; a plain append keeps them, each one key
longer (every run's cost grows by its row count, so the cheapest split is unchanged). Compaction moves
the longest rows into the finished rows' slots, so the order frays until the next rebuild; the split
works on whatever order the slots are in. Other key counts per SDPA call round differently: within
~1e-7 of one call, no longer bitwise (`max_parts = 1` restores one call over every slot: bitwise the
gather path on one thread, rows in whatever slots compaction left them).

Small batches (under MIN_BYTES of K+V per layer: `min_bytes`) gather: the copy is cheaper there.
Memory: the mirror never holds more positions than the paged cache itself (B x cap <= num_blocks x
block_size, so at most as much memory again); a batch that does not fit uses the gather path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.model.attention import MAX_PARTS, AttentionMetadata, contiguous_split

GROW = 64  # capacity is rounded up to this many positions, so a growing context rebuilds every GROW steps
# Below this many bytes of gathered K+V per layer the gather path is as fast or faster: its copy streams
# the cache into a buffer that stays in the core's L2, and SDPA reads it hot, while SDPA reading the
# mirror from L3/DRAM stalls more than the streaming copy costs. Measured on the CI CPU (AMD EPYC, 1 MiB
# L2 per core), tiny model, one thread: batch 8 x 288 positions (1.8 MiB) is ~10% slower with the
# mirror, batch 64 x 96 (4.7 MiB) even, batch 64 x 288 (14 MiB) ~30% less CPU time.
MIN_BYTES = 4 << 20
# A run of slots' fixed cost in (row x key position) units of a decode step's SDPA: ~10 us a call against
# 26-65 ns a unit (batch 64-256 x 64-256 keys, the tiny model's shape, one thread; BENCHMARKS.md, "Session 34")
SLOT_RUN_UNITS = 400


@dataclass
class MirrorStep:
    """What one decode step does to the mirror (built once per step, shared by every layer)."""

    batch: int
    cap: int
    rebuild_index: torch.Tensor | None  # [B * cap / block_size] blocks to gather into the mirror; None: append
    append_rows: torch.Tensor | None  # [B * kvh] flat position of each (row, head)'s new token; None: rebuild
    context_lens: list[int]
    tables: list[list[int]]  # each row's blocks covering positions 0 .. ctx_b (copies)
    # after a finish (`plan`'s compaction) batch row b may sit in another mirror slot than b:
    slots: list[int] | None = None  # the slot of each batch row; None: row b is slot b
    row_of_slot: torch.Tensor | None = None  # [B] the batch row each slot holds (queries in slot order)
    slot_of_row: torch.Tensor | None = None  # [B] its inverse (outputs back in batch order)
    slot_mask: torch.Tensor | None = None  # the decode group's mask in slot order (None: every key visible)
    # runs of slots attended apart, each over its own longest context (`plan`): slots bounds[i] .. bounds[i+1]-1
    # over keys 0 .. lks[i]-1; None: one SDPA call over every slot
    bounds: list[int] | None = None
    lks: list[int] | None = None


class DecodeMirror:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kvh: int, d: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.block_size, self.kvh, self.d = num_layers, block_size, kvh, d
        self.dtype, self.device = dtype, device
        self.max_positions = num_blocks * block_size
        self.min_bytes = MIN_BYTES  # a batch's K+V per layer below which `plan` leaves it to the gather path
        # runs of slots attended apart (`contiguous_split`); 1: one SDPA call over every slot (bitwise the gather
        # path on one thread). The mirror's own knob: `attention.MAX_PARTS` is read once, here
        self.max_parts = MAX_PARTS if torch.device(device).type == "cpu" else 1
        self._position_bytes = 2 * kvh * d * dtype.itemsize
        self._k: list[torch.Tensor] = []  # per layer, flat, at least B * kvh * cap * d elements
        self._v: list[torch.Tensor] = []
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer k, v [B, kvh, cap, d] of the last plan
        self.held: MirrorStep | None = None  # the step whose rows the mirror holds (None: the next decode rebuilds)
        # the last forward was not a plain decode step (a prefill, a verify pass): the next decode step gathers
        self.after_other_write = True
        self.rebuild_after_other_writes = False  # True: rebuild at once (the mirror's first form; tests compare)

    def invalidate(self) -> None:
        self.held = None
        self.after_other_write = True

    def plan(self, meta: AttentionMetadata) -> MirrorStep | None:
        """This decode step's mirror work, or None (the caller gathers) when the batch is small or does not fit."""
        held, self.held = self.held, None  # held again only once this step's forward commits
        after_other, self.after_other_write = self.after_other_write, False
        ctx, bs, kvh = meta.context_lens, self.block_size, self.kvh
        b, lk = len(ctx), max(ctx) + 1
        if b * lk * self._position_bytes < self.min_bytes:
            return None
        if after_other and not self.rebuild_after_other_writes:
            return None  # alone, or the first of a run: the next consecutive decode step rebuilds
        tables = [bt[: (c + bs) // bs] for bt, c in zip(meta.block_tables, ctx)]
        if held is not None and lk <= held.cap:
            if held.batch == b and all(c == p + 1 for c, p in zip(ctx, held.context_lens)) and all(
                t[: len(h)] == h for t, h in zip(tables, held.tables)
            ):
                step = self._append(held, held.slots, meta, tables)
                # every key one longer: the same runs are the cheapest (each run's cost grows by its rows)
                step.bounds, step.lks = held.bounds, None if held.lks is None else [n + 1 for n in held.lks]
                return step
            kept = _kept_rows(held, ctx, tables) if b < held.batch else None
            if kept is not None:  # sequences finished, the others in order: fill the holes, append
                step = self._append(held, self._compact(held, kept), meta, tables)
                return self._runs(step)
        grow = -(-GROW // bs) * bs
        cap = min(-(-lk // grow) * grow, self.max_positions // b // bs * bs)
        if cap < lk:
            return None
        nb = cap // bs
        # slots sorted by context when runs of them would be attended apart (then of similar lengths), else in
        # batch order (no permutation to apply at every step)
        order, bounds = list(range(b)), None
        if self.max_parts > 1:
            by_len = sorted(order, key=ctx.__getitem__)
            bounds = self._split([ctx[r] + 1 for r in by_len])
            if bounds is not None:
                order = by_len
        index = torch.tensor([tables[r] + [0] * (nb - len(tables[r])) for r in order], dtype=torch.int64,
                             device=self.device)
        self._layout(b, cap)
        slots = [0] * b
        for s, r in enumerate(order):
            slots[r] = s
        step = self._place(MirrorStep(b, cap, index.view(-1), None, list(ctx), tables), slots, meta)
        if bounds is not None:
            step.bounds, step.lks = bounds, [ctx[order[z - 1]] + 1 for z in bounds[1:]]  # sorted: a run's last
        return step

    def _append(self, held: MirrorStep, slots: list[int] | None, meta: AttentionMetadata,
                tables: list[list[int]]) -> MirrorStep:
        """An appending step for the batch of `meta`, whose row b the mirror holds in slot slots[b]."""
        ctx, kvh, cap, b = meta.context_lens, self.kvh, held.cap, len(meta.context_lens)
        where = slots if slots is not None else range(b)
        rows = torch.tensor([(s * kvh + h) * cap + c for s, c in zip(where, ctx) for h in range(kvh)],
                            dtype=torch.int64, device=self.device)
        return self._place(MirrorStep(b, cap, None, rows, list(ctx), tables), slots, meta, held)

    def _split(self, keys: list[int]) -> list[int] | None:
        """Run bounds over slots holding `keys` key positions each (`contiguous_split`); None: one run pays best."""
        bounds = contiguous_split(keys, [1] * len(keys), self.max_parts, SLOT_RUN_UNITS, 0.0)
        return bounds if len(bounds) > 2 else None

    def _runs(self, step: MirrorStep) -> MirrorStep:
        """`step` with its runs of slots, chosen afresh for the keys its slots hold."""
        if self.max_parts > 1:
            keys = [0] * step.batch
            for r, s in enumerate(step.slots or range(step.batch)):
                keys[s] = step.context_lens[r] + 1
            step.bounds = self._split(keys)
            step.lks = None if step.bounds is None else [max(keys[a:z]) for a, z in zip(step.bounds, step.bounds[1:])]
        return step

    def _place(self, step: MirrorStep, slots: list[int] | None, meta: AttentionMetadata,
               held: MirrorStep | None = None) -> MirrorStep:
        """`step` with its rows in `slots` (None or the identity: row b in slot b); its runs are the caller's."""
        b = step.batch
        if slots is not None and held is not None and slots is held.slots:  # the held permutation, unchanged
            step.slots, step.slot_of_row, step.row_of_slot = slots, held.slot_of_row, held.row_of_slot
        elif slots is not None and any(s != r for r, s in enumerate(slots)):
            step.slots = slots
            step.slot_of_row = torch.tensor(slots, dtype=torch.int64, device=self.device)
            step.row_of_slot = torch.empty_like(step.slot_of_row)
            step.row_of_slot[step.slot_of_row] = torch.arange(b, device=self.device)
        if step.slots is not None:  # the mask grows a key every step: put in slot order every step
            mask = meta.groups[0].mask if meta.groups else None
            step.slot_mask = None if mask is None else mask.index_select(0, step.row_of_slot)
        return step

    def _compact(self, held: MirrorStep, kept: list[int]) -> list[int] | None:
        """Move the kept rows held in slots >= len(kept) into the finished rows' slots below it (one row's K/V
        per layer each: a finish costs O(finished rows), not a rebuild's gather and copy of every row) ->
        the new batch's slots (None: row b is slot b)."""
        b = len(kept)
        old = held.slots if held.slots is not None else range(held.batch)
        slots = [old[j] for j in kept]
        taken = set(slots)
        holes = [s for s in range(b) if s not in taken]
        movers = [r for r, s in enumerate(slots) if s >= b]
        if movers:
            src = torch.tensor([slots[r] for r in movers], dtype=torch.int64, device=self.device)
            dst = torch.tensor(holes, dtype=torch.int64, device=self.device)
            for k, v in self.views:
                k.index_copy_(0, dst, k.index_select(0, src))
                v.index_copy_(0, dst, v.index_select(0, src))
            for r, s in zip(movers, holes):
                slots[r] = s
        self.views = [(k[:b], v[:b]) for k, v in self.views]
        return None if all(s == r for r, s in enumerate(slots)) else slots

    def commit(self, step: MirrorStep) -> None:
        self.held = step

    def rebuild(self, li: int, step: MirrorStep, kc: torch.Tensor, vc: torch.Tensor, scratch: torch.Tensor) -> None:
        """Fill layer li's mirror from the cache (this step's new tokens already written): one gather per cache.

        scratch: [B * cap / block_size, block_size, kvh, d], the token-major gather reused by every layer.
        """
        for cache, mirror in zip((kc, vc), self.views[li]):
            g = torch.index_select(cache, 0, step.rebuild_index, out=scratch)
            mirror.copy_(g.view(step.batch, step.cap, self.kvh, self.d).transpose(1, 2))

    def _layout(self, b: int, cap: int) -> None:
        """Views [b, kvh, cap, d] per layer, over buffers grown (never shrunk) to fit them."""
        size = b * self.kvh * cap * self.d
        if not self._k or self._k[0].numel() < size:
            self._k = self._v = self.views = []  # free the old buffers before allocating the larger ones
            e = dict(dtype=self.dtype, device=self.device)
            self._k = [torch.empty(size, **e) for _ in range(self.num_layers)]
            self._v = [torch.empty(size, **e) for _ in range(self.num_layers)]
        shape = (b, self.kvh, cap, self.d)
        self.views = [(k[:size].view(shape), v[:size].view(shape)) for k, v in zip(self._k, self._v)]


def _kept_rows(held: MirrorStep, ctx: list[int], tables: list[list[int]]) -> list[int] | None:
    """For each row of a batch that dropped some of `held`'s rows and kept the others in order (sequences finished),
    the held row it continues (context one longer, its blocks a continuation); None when the batch is anything else."""
    kept, j = [], 0
    for c, t in zip(ctx, tables):
        while j < held.batch and not (held.context_lens[j] == c - 1 and t[: len(held.tables[j])] == held.tables[j]):
            j += 1
        if j == held.batch:
            return None
        kept.append(j)
        j += 1
    return kept
