"""BlockManager and Scheduler bookkeeping: prefix sharing, waiting for a sibling's chunk,
reuse of freed cached blocks, preemption order. Pure Python objects; nothing is faked.
"""

from __future__ import annotations

from tlt.services.rollout.engine.block_manager import BlockManager
from tlt.services.rollout.engine.scheduler import ScheduledBatch, Scheduler
from tlt.services.rollout.engine.sequence import Sequence, SeqStatus
from tlt.services.rollout.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def seq(tokens, sid="r", i=0):
    return Sequence(sid, i, tuple(tokens), GREEDY, max_tokens=8, seed=0, eos_ids=frozenset())


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
    a = seq(range(10))
    bm.allocate(a, set())
    a.num_computed = 10
    bm.mark_computed(a)
    bm.free_seq(a)
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
