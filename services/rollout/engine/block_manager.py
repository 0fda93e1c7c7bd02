"""BlockManager: paged KV blocks with reference counts and prefix sharing.

Each sequence holds a block table (block ids, `block_size` tokens each). A
full block whose tokens lie inside the sequence's known prefix (all tokens but
the last) is registered under a key that digests its whole prefix (the
previous block's key and its own tokens, BLAKE2b, 128 bits: `chain_key`);
a later sequence with the same prefix reuses it (ref count + 1) instead of
computing it again. That is how the n samples of one GRPO prompt prefill the
prompt once. The block holding the last prompt token is never shared, so a
sequence only ever writes into blocks it owns alone (no copy-on-write needed).

That block's known tokens (the partial tail: up to block_size - 1 of them) are
copied rather than recomputed: the first sequence with a prefix registers its
tail block under the tail's key (`tail_key`); a later sequence with the same
known prefix, once that tail is computed, gets a fresh block, a `TailCopy` of
those slots (applied by the engine before the step's forward: the K/V of the
same tokens after the same prefix) and computes only its last token. GRPO's
n samples of a short prompt then prefill it once instead of n times
(BENCHMARKS.md, "Session 28"). A sibling whose tail is not computed yet (in
this very step, or by a later chunk of a chunked prefill) waits for it
(`allocate` returns DEFER; the scheduler admits the sequences behind it
meanwhile).

The key must be collision-resistant: a hit compares only the block's own
tokens, so two prefixes with one key would share K/V computed under another
context (Python's `hash` is 64 bits, unkeyed and craftable, which is how
vLLM's prefix cache was attacked, CVE-2025-25183).

A shared block must already hold K/V when the sharer reads it: either it is
`computed`, or it is being written in the same step by a sequence scheduled
earlier (`pending`, the model writes every new token's K/V before any
attention in each layer). A match that is neither (the owner is mid-way
through a chunked prefill) tells the scheduler to wait a step.

Freed blocks keep their hash (a later identical prefix can still hit them)
until they are handed out again; uncomputed blocks lose it when freed.
`reset_prefix_cache` forgets every hash and every registered tail (a policy
weight swap makes all cached K/V stale for new requests; sequences holding
blocks keep using them).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tlt.services.rollout.engine.sequence import Sequence


ROOT_KEY = b""  # the parent key of a sequence's first block


def chain_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The prefix-cache key of a block: a 128-bit BLAKE2b digest of its parent's key and its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def tail_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of a partial tail block's known tokens after the prefix keyed `parent` (ROOT_KEY or a chain_key):
    apart from full blocks' keys, and the parent's length in it, so no parent and tokens read as another's."""
    return chain_key(b"tail" + bytes([len(parent)]) + parent, tokens)


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids", "computed", "tail", "tail_owner", "tail_end")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # chain_key of its prefix while shareable
        self.token_ids: tuple[int, ...] = ()
        self.computed = False
        self.tail: bytes | None = None  # tail_key while registered as a partial tail others may copy
        self.tail_owner: Sequence | None = None  # the sequence computing it: copyable once it computed tail_end tokens
        self.tail_end = 0


@dataclass(frozen=True)
class TailCopy:
    """Copy slots 0 .. count - 1 of block `src` into block `dst`, every layer's K and V (before the step's forward)."""

    src: int
    dst: int
    count: int


class BlockManager:
    DEFER = -1  # allocate(): a matching prefix block or partial tail is still being computed by another sequence

    def __init__(self, num_blocks: int, block_size: int, prefix_sharing: bool = True) -> None:
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: dict[bytes, Block] = {}
        self.by_tail: dict[bytes, Block] = {}  # tail_key -> a running sequence's partial tail block
        self.shared_hits = 0  # blocks reused instead of recomputed (for stats and tests)
        self.tail_copies = 0  # partial tails copied instead of recomputed (for stats and tests)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free(self) -> Block:
        bid, _ = self.free.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None and self.by_hash.get(b.hash) is b:
            del self.by_hash[b.hash]
        b.hash, b.token_ids, b.computed, b.ref_count = None, (), False, 1
        return b

    def _drop_tail(self, b: Block) -> None:
        if b.tail is not None and self.by_tail.get(b.tail) is b:
            del self.by_tail[b.tail]
        b.tail, b.tail_owner = None, None

    def allocate(self, seq: Sequence, pending: set[int], copies: list[TailCopy] | None = None) -> int:
        """Give `seq` blocks for all its tokens, reusing shared prefix blocks.

        Returns the number of leading tokens already in the cache (set as
        seq.num_computed), DEFER when it must wait for a sibling's chunk or
        tail, or raises nothing and returns -2 when there are not enough free
        blocks. With `copies` (a list the caller applies before the step's
        forward), a computed partial tail of the same prefix is copied into
        seq's own tail block (a TailCopy appended) and counted as cached.
        """
        assert not seq.block_table
        bs, toks = self.block_size, seq.token_ids
        total = self.blocks_needed(len(toks))
        shareable = (len(toks) - 1) // bs if self.prefix_sharing else 0
        hits: list[Block] = []
        hashes: list[bytes] = []
        h = ROOT_KEY
        for i in range(shareable):
            chunk = tuple(toks[i * bs : (i + 1) * bs])
            h = chain_key(h, chunk)
            hashes.append(h)
            if len(hits) == i:
                b = self.by_hash.get(h)
                if b is not None and b.token_ids == chunk:
                    if not (b.computed or b.id in pending):
                        return self.DEFER
                    hits.append(b)
        tail_n = len(toks) - 1 - shareable * bs  # known tokens in the block of the last token (copied, not shared)
        tail, src = None, None
        if self.prefix_sharing and copies is not None and tail_n > 0:
            tail = tail_key(h, tuple(toks[shareable * bs : len(toks) - 1]))
            # copied only after a shared prefix; a registered tail's owner holds it (free_seq drops it as it leaves)
            src = self.by_tail.get(tail) if len(hits) == shareable else None
            if src is not None and src.tail_owner.num_computed < src.tail_end:
                return self.DEFER  # computed this step or by a later chunk: copy it next step
        fresh_needed = total - len(hits)
        revived = sum(1 for b in hits if b.ref_count == 0)
        if fresh_needed > len(self.free) - revived:
            return -2
        for b in hits:
            if b.ref_count == 0:
                del self.free[b.id]
            b.ref_count += 1
            seq.block_table.append(b.id)
        self.shared_hits += len(hits)
        for i in range(len(hits), total):
            b = self._take_free()
            if i < shareable:
                b.hash, b.token_ids = hashes[i], tuple(toks[i * bs : (i + 1) * bs])
                self.by_hash[b.hash] = b
            seq.block_table.append(b.id)
        seq.num_computed = len(hits) * bs
        if src is not None:  # the same known tokens after the same prefix: copy their K/V, compute the last token
            copies.append(TailCopy(src.id, seq.block_table[shareable], tail_n))
            self.tail_copies += 1
            seq.num_computed += tail_n
        elif tail is not None:  # the first with this tail: others may copy it once computed
            b = self.blocks[seq.block_table[shareable]]
            b.tail, b.tail_owner, b.tail_end = tail, seq, len(toks) - 1
            self.by_tail[tail] = b
        return seq.num_computed

    def can_append(self, seq: Sequence) -> bool:
        """True if the sequence's next token fits in its blocks or one free block."""
        return seq.num_tokens <= len(seq.block_table) * self.block_size or len(self.free) > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for all of seq's tokens (one new block at a block boundary)."""
        while seq.num_tokens > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free().id)

    def mark_computed(self, seq: Sequence) -> None:
        """Blocks fully covered by seq.num_computed now hold valid K/V."""
        for bid in seq.block_table[: seq.num_computed // self.block_size]:
            self.blocks[bid].computed = True

    def reset_prefix_cache(self) -> None:
        """Make no existing block shareable again (after a weight swap its K/V belongs to the old weights)."""
        for b in self.blocks:
            b.hash, b.token_ids = None, ()
            b.tail, b.tail_owner = None, None
        self.by_hash.clear()
        self.by_tail.clear()

    def free_seq(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.tail_owner is seq:
                self._drop_tail(b)  # its owner leaves: it may be written by whoever gets the block next
            if b.ref_count == 0:
                if not b.computed and b.hash is not None:
                    if self.by_hash.get(b.hash) is b:
                        del self.by_hash[b.hash]
                    b.hash = None
                self.free[bid] = None
        seq.block_table = []
        seq.num_computed = 0
