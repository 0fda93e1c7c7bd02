"""Scheduler: continuous batching under a sequence cap, a token budget and the KV budget.

Every step it builds one batch, in this order:
1. running sequences, oldest first: each gets `num_tokens - num_computed`
   new tokens (1 when decoding, the next chunk when its prefill was chunked),
   within the step's token budget. A decode that needs a new KV block when
   none is free **preempts the newest running sequence** (frees its blocks,
   puts it back at the head of the queue; it is recomputed later from its
   prompt + output, keeping its RNG key), never fails.
2. waiting sequences, first come first served, while the sequence cap, the
   token budget and free blocks allow: blocks are allocated for all their
   tokens (sharing full prefix blocks and copying a computed partial tail,
   see BlockManager) and the first chunk is scheduled. A sequence that must
   wait for a sibling's K/V (DEFER) keeps its place in the queue, and a seat
   under the cap, while the ones behind it are admitted; one that finds no
   free blocks stops the admissions (first come, first served).

A token is sampled for a sequence when its scheduled chunk reaches its end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tlt.services.rollout.engine.block_manager import BlockManager, TailCopy
from tlt.services.rollout.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens computed this step, per sequence
    copies: list[TailCopy] = field(default_factory=list)  # K/V to copy before the forward (BlockManager.allocate)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes its one last token. A prompt chunk cut to one token by the step's budget
        is one new token too, but not a decode (its earlier tokens are not cached yet)."""
        return all(n == 1 and s.num_computed == s.num_tokens - 1 for n, s in zip(self.num_new, self.seqs))


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_release: Callable[[Sequence], None] | None = None  # told when a sequence leaves the cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_tokens
        pending: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            want = seq.num_tokens - seq.num_computed
            if want == 1 and not self._make_room(seq):
                continue  # seq itself was preempted; self.running shrank
            if seq.status is not SeqStatus.RUNNING:
                i += 1
                continue
            n = min(want, budget)
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n
            i += 1
        # waiting for a sibling's K/V this step: they keep their place in the queue, and their seats (else the
        # first samples of later prompts would fill the batch and split every request's samples across waves)
        deferred: list[Sequence] = []
        try:
            self._admit(batch, budget, pending, deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int, pending: set[int], deferred: list[Sequence]) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(deferred) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.bm.allocate(seq, pending, batch.copies)
            if cached == BlockManager.DEFER:
                deferred.append(self.waiting.popleft())  # a shared prefix block or tail is still being computed
                continue
            if cached < 0:
                break  # not enough blocks
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            done_blocks = (seq.num_computed + n) // self.bm.block_size
            pending.update(seq.block_table[:done_blocks])
            batch.seqs.append(seq)
            batch.num_new.append(n)
            budget -= n

    def update(self, batch: ScheduledBatch) -> None:
        """After the forward: the scheduled tokens now have K/V; blocks they completed become shareable."""
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
            if n > 1 or seq.num_computed < seq.num_tokens:  # a prefill chunk (even of one token)
                self.bm.mark_computed(seq)

    def _make_room(self, seq: Sequence) -> bool:
        """Ensure seq's next token has a slot, preempting the newest others; False if seq itself was preempted."""
        while not self.bm.can_append(seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.bm.append_slot(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        if self.on_release is not None:
            self.on_release(seq)
        seq.status = SeqStatus.FINISHED
