"""BlockManager and Scheduler bookkeeping: prefix sharing, waiting for a sibling's chunk,
reuse of freed cached blocks, preemption order. Pure Python objects; nothing is faked.
"""

from __future__ import annotations

from array import array

import pytest

from tlt.services.rollout.engine.block_manager import ROOT_KEY, BlockManager, TailCopy, chain_key
from tlt.services.rollout.engine.scheduler import ScheduledBatch, Scheduler
from tlt.services.rollout.engine.sequence import Sequence, SeqStatus
from tlt.services.rollout.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def seq(tokens, sid="r", i=0):
    return Sequence(sid, i, tuple(tokens), GREEDY, max_tokens=8, seed=0, eos_ids=frozenset())


def computed_then_freed(bm: BlockManager) -> Sequence:
    """A 10-token sequence whose blocks were all computed (its two full blocks cached) and then freed."""
    a = seq(range(10))
    bm.allocate(a, set())
    a.num_computed = 10
    bm.mark_computed(a)
    bm.free_seq(a)
    return a


def test_full_prefix_blocks_are_shared_and_last_block_is_private():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq(range(10)), seq(range(10), i=1)  # 10 tokens: blocks [0-3] [4-7] [8-9]
    assert bm.allocate(a, pending=set()) == 0
    a.num_computed = 10
    bm.mark_computed(a)
    assert bm.allocate(b, pending=set()) == 8  # two full blocks reused, last block recomputed
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_free == 10 - 4 and bm.shared_hits == 2
    bm.free_seq(a)
    assert bm.num_free == 10 - 3  # shared blocks still held by b
    bm.free_seq(b)
    assert bm.num_free == 10 and bm.usage() == 0.0


def test_block_ending_at_the_last_token_is_not_shared():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq(range(8)), seq(range(8), i=1)  # the second full block holds the last token
    bm.allocate(a, set())
    a.num_computed = 8
    bm.mark_computed(a)
    assert bm.allocate(b, set()) == 4


def test_sibling_waits_for_uncomputed_prefix_unless_computed_this_step():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq(range(10)), seq(range(10), i=1)
    bm.allocate(a, set())
    assert bm.allocate(b, pending=set()) == BlockManager.DEFER and not b.block_table
    assert bm.allocate(b, pending=set(a.block_table[:2])) == 8


def test_freed_computed_blocks_are_revived_and_uncomputed_ones_forgotten():
    bm = BlockManager(num_blocks=6, block_size=4)
    computed_then_freed(bm)
    b = seq(range(10), i=1)
    assert bm.allocate(b, set()) == 8  # hit on freed-but-cached blocks
    bm.free_seq(b)
    c = seq(range(100, 110))
    bm.allocate(c, set())  # never computed
    bm.free_seq(c)
    d = seq(range(100, 110), i=1)
    assert bm.allocate(d, set()) == 0


def test_not_enough_blocks_returns_minus_two():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate(seq(range(10)), set()) == -2


def test_scheduler_preempts_newest_and_requeues_it_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq([1, 2, 3], "a"), seq([4, 5, 6], "b")  # 2 blocks each -> cache full
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert batch.seqs == [a, b] and batch.num_new == [3, 3]
    for s in (a, b):
        s.num_computed = 3
        s.token_ids.append(7)  # a sampled token; a 4th token fits in the 2 blocks
    batch = sch.schedule()
    assert batch.num_new == [1, 1]
    for s in (a, b):
        s.num_computed += 1
        s.token_ids.append(8)  # 5th token needs a 3rd block: none free -> b (newest) is preempted
    batch = sch.schedule()
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING and sch.waiting[0] is b
    assert sch.num_preemptions == 1 and b.num_computed == 0 and not b.block_table



def test_one_token_prefill_chunk_that_completes_a_block_makes_it_shareable():
    bm = BlockManager(num_blocks=10, block_size=4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = seq(range(7))  # one shareable block (tokens 0-3)
    bm.allocate(a, set())
    a.status = SeqStatus.RUNNING
    sch.running.append(a)
    a.num_computed = 3
    batch = ScheduledBatch([a], [1])  # a one-token chunk (budget squeezed by other sequences) ends block 0
    sch.update(batch)
    assert a.num_computed == 4 and bm.blocks[a.block_table[0]].computed
    assert bm.allocate(seq(range(7), i=1), set()) == 4  # a sibling shares it instead of waiting


def test_reset_prefix_cache_stops_sharing_held_and_freed_blocks():
    """After a weight swap no cached block may be hit again; held blocks keep their ref counts."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq(range(10)), seq(range(20, 30), "b")
    for s in (a, b):
        bm.allocate(s, set())
        s.num_computed = 10
        bm.mark_computed(s)
    bm.free_seq(b)  # b's computed blocks are free but still cached
    bm.reset_prefix_cache()
    assert bm.allocate(seq(range(10), i=1), set()) == 0  # a still holds its blocks: no hit
    assert bm.allocate(seq(range(20, 30), "b", 1), set()) == 0  # freed cached blocks: no hit either
    bm.free_seq(a)
    assert bm.num_free == 10 - 6 and bm.shared_hits == 0


def test_a_prefix_block_is_shared_only_under_its_own_whole_prefix(monkeypatch):
    """The prefix cache keyed each block by Python's `hash((parent key, tokens))`: deterministic and not
    collision-resistant (64 bits, no secret), and a hit compared only the block's own tokens. Two first blocks
    with colliding keys (craftable offline, as in vLLM's CVE-2025-25183) made a later prompt reuse K/V computed
    under another prompt's context: wrong output, or a view of another request's prompt. Here Python's `hash`
    is replaced by one that ignores the parent (every parent key "collides"); the block keys must not care."""
    import tlt.services.rollout.engine.block_manager as block_manager

    monkeypatch.setattr(block_manager, "hash", lambda t: hash(t[1]), raising=False)
    bm = BlockManager(num_blocks=12, block_size=4)
    x, x2, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    d, a, b = seq(x2 + [13, 14, 15, 16] + [0], "d"), seq(x + y + [0], "a"), seq(x2 + y + [0], "b")
    for s in (d, a):
        bm.allocate(s, set())
        s.num_computed = 9
        bm.mark_computed(s)
    assert bm.allocate(b, set()) == 4  # its first block is d's (same tokens from the start); not a's second
    assert b.block_table[0] == d.block_table[0] and b.block_table[1] not in a.block_table


def test_a_partly_computed_block_is_not_shared_until_its_chunk_completes_it():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(10))  # shareable blocks [0-3] [4-7]
    bm.allocate(a, set())
    a.num_computed = 6  # a chunked prefill stopped half-way through block 1
    bm.mark_computed(a)
    assert [bm.blocks[b].computed for b in a.block_table] == [True, False, False]
    assert bm.allocate(seq(range(10), i=1), set()) == BlockManager.DEFER  # block 1 still lacks K/V
    assert bm.allocate(seq(range(4), i=2), set()) == 0  # 4 tokens: block 0 holds the last one, never shared
    assert bm.allocate(seq(range(5), i=3), set()) == 4  # block 0 alone is complete: shared


def test_a_revived_block_leaves_the_free_list():
    bm = BlockManager(num_blocks=6, block_size=4)
    computed_then_freed(bm)
    assert bm.num_free == 6
    b = seq(range(10), i=1)
    assert bm.allocate(b, set()) == 8
    assert bm.num_free == 3 and bm.blocks[b.block_table[0]].ref_count == 1  # 2 revived + 1 fresh taken
    c = seq(range(50, 62), "c")  # 3 blocks: exactly the 3 free ones, none of b's
    assert bm.allocate(c, set()) == 0
    assert bm.num_free == 0 and not set(c.block_table) & set(b.block_table)


def test_revived_blocks_are_not_counted_as_free_twice():
    bm = BlockManager(num_blocks=3, block_size=4)
    computed_then_freed(bm)
    # 14 tokens: 4 blocks; [0-3] [4-7] are revived from the 3 free blocks, leaving 1 for the 2 fresh ones
    b = seq(list(range(10)) + [20, 21, 22, 23], i=1)
    assert bm.allocate(b, set()) == -2 and not b.block_table and bm.num_free == 3


def test_freed_blocks_are_reused_least_recently_freed_first_so_cached_prefixes_survive():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(range(10))
    bm.allocate(a, set())
    assert a.block_table == [0, 1, 2]
    a.num_computed = 10
    bm.mark_computed(a)
    bm.free_seq(a)  # free order now 3, 4, 5, then a's blocks tail first: 2, 1, 0
    c = seq(range(50, 62), "c")  # takes 3 blocks: the never-used 3, 4, 5
    bm.allocate(c, set())
    assert c.block_table == [3, 4, 5]
    d = seq(range(70, 73), "d")  # one block more: a's tail block (never shared), not its prefix's first block
    bm.allocate(d, set())
    assert d.block_table == [2]
    bm.free_seq(d)  # (room for the next one's tail)
    assert bm.allocate(seq(range(10), i=1), set()) == 8  # a's prefix is still cached
    assert bm.shared_hits == 2


def test_scheduler_admits_at_most_max_num_seqs_and_cuts_chunks_to_the_token_budget():
    bm = BlockManager(num_blocks=20, block_size=4)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8)
    a, b, c = seq(range(5), "a"), seq(range(10, 16), "b"), seq(range(20, 22), "c")
    for s in (a, b, c):
        sch.add(s)
    batch = sch.schedule()
    # a: its 5 tokens; b: the 3 left of the budget of 8; c: over the cap of 2 sequences
    assert batch.seqs == [a, b] and batch.num_new == [5, 3] and list(sch.waiting) == [c]
    sch.update(batch)
    assert b.num_computed == 3
    a.token_ids.append(99)  # a's prefill reached its end: a token was sampled
    batch = sch.schedule()  # a decodes, b's next chunk; c still waits: 2 running
    assert batch.seqs == [a, b] and batch.num_new == [1, 3] and list(sch.waiting) == [c]


def test_scheduler_running_chunks_stop_at_an_exhausted_budget():
    bm = BlockManager(num_blocks=20, block_size=4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
    a, b = seq(range(6), "a"), seq(range(10, 16), "b")
    for s in (a, b):
        bm.allocate(s, set())
        s.status = SeqStatus.RUNNING
        sch.running.append(s)
    batch = sch.schedule()
    assert batch.seqs == [a] and batch.num_new == [4]  # a's chunk cut to the budget; none left for b
    sch.update(batch)
    batch = sch.schedule()
    assert batch.seqs == [a, b] and batch.num_new == [2, 2]


def test_siblings_admitted_in_one_step_share_the_blocks_being_computed_in_it():
    bm = BlockManager(num_blocks=20, block_size=4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(range(9), i=0), seq(range(9), i=1)  # no partial tail: every known token is in a full block
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()  # a writes blocks [0-3] [4-7] this step, before b reads them
    assert batch.seqs == [a, b] and batch.num_new == [9, 1] and b.block_table[:2] == a.block_table[:2]
    sch = Scheduler(BlockManager(num_blocks=20, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(range(10), i=0), seq(range(10), i=1)  # token 8 in a partial tail: b copies it next step
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert batch.seqs == [a] and batch.num_new == [10] and list(sch.waiting) == [b]
    bm2 = BlockManager(num_blocks=20, block_size=4)
    sch2 = Scheduler(bm2, max_num_seqs=4, max_num_batched_tokens=6)
    a, b = seq(range(10), i=0), seq(range(10), i=1)
    sch2.add(a)
    sch2.add(b)
    batch = sch2.schedule()  # a's chunk of 6 completes block 0 only: b must wait for block 1
    assert batch.seqs == [a] and batch.num_new == [6] and list(sch2.waiting) == [b] and not b.block_table


def test_preempted_and_aborted_waiting_sequences_are_released():
    bm = BlockManager(num_blocks=4, block_size=2)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    released: list = []
    sch.on_release = released.append
    a, b, c = seq([1, 2, 3], "a"), seq([4, 5, 6], "b"), seq([7, 8, 9], "c")
    for s in (a, b, c):
        sch.add(s)
    sch.update(sch.schedule())  # a and b fill the cache; c waits
    assert list(sch.waiting) == [c]
    for s in (a, b):
        s.token_ids += [7, 8]  # two sampled tokens: 5 tokens need a 3rd block each
        s.num_computed = 4
    sch.schedule()  # a needs a block: b (newest) is preempted and released
    assert released == [b] and list(sch.waiting) == [b, c]
    sch.finish(c)  # aborted while waiting
    assert released == [b, c] and list(sch.waiting) == [b] and c.status is SeqStatus.FINISHED


def test_a_one_token_prefill_chunk_is_not_a_decode():
    a = seq(range(7))
    a.num_computed = 3  # tokens 3..6 not yet cached: a chunk of 1 is part of the prefill
    assert not ScheduledBatch([a], [1]).is_decode_only
    a.num_computed = 6
    assert ScheduledBatch([a], [1]).is_decode_only


def test_a_computed_partial_tail_is_copied_not_recomputed():
    """Block size 4, prompts of 10 tokens: blocks 0-1 are shared, the third holds tokens 8 and 9 (9, the last,
    is computed by each sequence). A sibling copies token 8's K/V from the first sequence's third block once
    that is computed, and waits a step while it is not; a prompt with another tail, a freed owner and a reset
    prefix cache copy nothing."""
    bm = BlockManager(num_blocks=40, block_size=4)
    a = seq(range(10))
    copies: list[TailCopy] = []
    assert bm.allocate(a, set(), copies) == 0 and not copies
    b = seq(range(10), i=1)
    assert bm.allocate(b, set(a.block_table[:2]), copies) == BlockManager.DEFER and not b.block_table
    a.num_computed = 10  # a's prefill ran
    bm.mark_computed(a)
    assert bm.allocate(b, set(), copies) == 9  # two shared blocks + the copied tail token: computes token 9 only
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert copies == [TailCopy(a.block_table[2], b.block_table[2], 1)] and bm.tail_copies == 1
    c = seq([*range(9), 77])  # another last token: the same known prefix, so the same copy
    assert bm.allocate(c, set(), copies) == 9 and copies[-1] == TailCopy(a.block_table[2], c.block_table[2], 1)
    d = seq([*range(8), 55, 9])  # another tail token: registers its own tail
    assert bm.allocate(d, set(), copies) == 8 and len(copies) == 2
    assert bm.allocate(seq([*range(8), 55, 9], i=1), set(), copies) == BlockManager.DEFER
    bm.free_seq(a)  # the owner leaves: its block may be rewritten, nobody copies from it
    assert bm.allocate(seq(range(10), i=2), set(), copies) == 8 and len(copies) == 2
    bm.reset_prefix_cache()
    e = seq(range(10), i=3)
    assert bm.allocate(e, set(), copies) == 0 and len(copies) == 2
    e.num_computed = 10
    bm.mark_computed(e)
    assert bm.allocate(seq(range(10), i=4), set(), None) == 8  # a caller that applies no copies gets none


def test_a_sibling_waiting_for_a_tail_keeps_its_place_and_the_queue_moves_on():
    bm = BlockManager(num_blocks=40, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, a1 = seq(range(10), "a"), seq(range(10), "a", 1)
    b, b1 = seq(range(20, 30), "b"), seq(range(20, 30), "b", 1)
    for s in (a, a1, b, b1):
        sch.add(s)
    batch = sch.schedule()
    assert batch.seqs == [a, b] and batch.num_new == [10, 10] and not batch.copies
    assert list(sch.waiting) == [a1, b1]
    for s in (a, b):
        s.token_ids.append(99)
    sch.update(batch)
    batch = sch.schedule()
    assert batch.seqs == [a, b, a1, b1] and batch.num_new == [1, 1, 1, 1]
    assert [(c.src, c.dst, c.count) for c in batch.copies] == [(a.block_table[2], a1.block_table[2], 1),
                                                                (b.block_table[2], b1.block_table[2], 1)]
    assert batch.is_decode_only  # a1, b1 compute their last prompt token over cached K/V (once copied): a decode row


def test_deferred_samples_keep_their_seats_under_the_cap():
    """Cap 4, three prompts x 2 samples: the first samples of P and Q are admitted and their siblings keep two
    seats while they wait for the prompts' last blocks, so R waits rather than splitting P's and Q's samples
    across waves of the batch."""
    bm = BlockManager(num_blocks=60, block_size=4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    (p0, p1), (q0, q1), (r0, r1) = ([seq(range(k, k + 10), name, i) for i in range(2)]
                                    for k, name in ((0, "p"), (20, "q"), (40, "r")))
    for s in (p0, p1, q0, q1, r0, r1):
        sch.add(s)
    batch = sch.schedule()
    assert batch.seqs == [p0, q0] and list(sch.waiting) == [p1, q1, r0, r1]
    for s in (p0, q0):
        s.token_ids.append(99)
    sch.update(batch)
    batch = sch.schedule()
    assert batch.seqs == [p0, q0, p1, q1] and len(batch.copies) == 2 and list(sch.waiting) == [r0, r1]


def test_an_allocation_error_loses_no_waiting_sequence(monkeypatch):
    """A sibling waiting for a's last block, then b, whose allocation raises: both stay queued, in order."""
    bm = BlockManager(num_blocks=40, block_size=4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, a1, b = seq(range(10), "a"), seq(range(10), "a", 1), seq(range(20, 30), "b")
    sch.add(a)
    sch.schedule()  # a runs; its prefill has not completed (no update): a1 must wait for its last block
    sch.add(a1)
    sch.add(b)
    allocate = bm.allocate

    def failing(s, pending, copies=None):  # noqa: ANN001, ANN202
        if s is b:
            raise RuntimeError("boom")
        return allocate(s, pending, copies)

    monkeypatch.setattr(bm, "allocate", failing)
    with pytest.raises(RuntimeError, match="boom"):
        sch.schedule()
    assert list(sch.waiting) == [a1, b] and not a1.block_table and not b.block_table


def test_a_block_one_slot_short_of_computed_is_not_shared():
    """A chunked prefill that stopped one token before a block's end leaves that block without its last slot's
    K/V: a sibling must wait for it, not read the missing slot (what a mark_computed counting one token ahead
    would allow). 10 tokens, block size 4: 7 computed -> block 1 (tokens 4-7) is not complete; 8 computed -> it is."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(10))
    bm.allocate(a, set())
    a.num_computed = 7
    bm.mark_computed(a)
    assert [bm.blocks[b].computed for b in a.block_table] == [True, False, False]
    assert bm.allocate(seq(range(10), i=1), set()) == BlockManager.DEFER
    a.num_computed = 8
    bm.mark_computed(a)
    assert bm.allocate(seq(range(10), i=2), set()) == 8


def test_a_tail_is_copied_as_soon_as_its_known_tokens_are_computed():
    """The owner's chunked prefill stopped right before its last token (9 of 10 tokens computed): the tail's
    known token 8 has its K/V, so a sibling copies it at once instead of waiting a step more for the owner's
    last token (which the sibling never reads)."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq(range(10)), seq(range(10), i=1)
    copies: list[TailCopy] = []
    bm.allocate(a, set(), copies)
    a.num_computed = 8
    bm.mark_computed(a)
    assert bm.allocate(b, set(), copies) == BlockManager.DEFER  # token 8 not computed yet
    a.num_computed = 9
    bm.mark_computed(a)
    assert bm.allocate(b, set(), copies) == 9 and copies == [TailCopy(a.block_table[2], b.block_table[2], 1)]


def test_a_tail_key_is_not_another_prefix_length_s_tail_key():
    """A tail's key must tell a one-block prefix + tail from a prompt whose first tokens spell that block's key
    (the parent's length is in the key): otherwise a prompt of crafted token ids finds a registered tail of
    another request and copies K/V computed under that request's prompt (three slots here, read as its own).
    a: block [0 1 2 3] (key P), tail (7,); b: no full block, tail (P as two int64 tokens, 7)."""
    bm = BlockManager(num_blocks=10, block_size=4)
    spelled = list(array("q", chain_key(ROOT_KEY, (0, 1, 2, 3))))
    a, b = seq([0, 1, 2, 3, 7, 0], "a"), seq([*spelled, 7, 0], "b")
    copies: list[TailCopy] = []
    bm.allocate(a, set(), copies)
    a.num_computed = 6
    bm.mark_computed(a)
    assert bm.allocate(b, set(), copies) == 0 and not copies and bm.tail_copies == 0


def test_a_decode_takes_the_last_free_block_without_preempting():
    """With exactly one free block, a decode that crosses a block boundary takes it and nobody is preempted (an
    off-by-one in can_append would preempt the newest sequence and recompute its prompt for nothing)."""
    bm = BlockManager(num_blocks=4, block_size=4)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(range(8), "a"), seq([9], "b")  # 2 blocks + 1 block: one left free
    sch.add(a)
    sch.add(b)
    sch.update(sch.schedule())
    assert bm.num_free == 1
    for s in (a, b):
        s.token_ids.append(7)  # a's 9th token needs a 3rd block; b's 2nd fits in its block
    batch = sch.schedule()
    assert batch.seqs == [a, b] and batch.num_new == [1, 1] and sch.num_preemptions == 0
    assert bm.num_free == 0 and len(a.block_table) == 3
