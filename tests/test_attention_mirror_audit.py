"""Mutation audit of `tlt.model.attention` and `tlt.model.decode_mirror`: tests for the gaps it found.

Each test below was written for one mutant (a small deliberate change to the product code) that the
existing suite let through; with that mutant applied the test fails, on the real code it passes. The
audit IDs (AM-n) name the mutants in the audit's report. What they pin:

    AM-1  contiguous_split costs a run by its longest key, not its shortest (hand-computed split)
    AM-2  metadata built for the Triton kernels is not split by length (the kernels take ragged lengths)
    AM-3  a decode step whose contexts differ by exactly one still masks the shorter row's next position
    AM-4  a plain chunk in a kernel tree group gets a causal tree mask, not an all-visible one
    AM-5  an SDPA group attends exactly its longest context + new tokens, no padding keys past them
    AM-6  the mirror's capacity under the cache's own size is a whole number of blocks
    AM-7  a batch whose keys exactly fill a capacity rebuilds into it instead of gathering
    AM-8  after a compaction the runs of slots are chosen afresh, each over the longest row it holds
    AM-9  two rows never continue the same held row (rows sharing the held row's blocks)
    AM-10 `min_bytes` is compared with the batch's K+V per layer, lk positions of every row

Nothing is faked: real metadata, real attention over random paged caches (compared with a float64
attention computed here per sequence over its own keys, or with hand-derived values), and for the
mirror two native models with the same random weights, one with the mirror and one gathering
(`test_decode_mirror.Harness`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from test_attention_split import _reference  # float64 attention per sequence over its own keys
from test_decode_mirror import Harness, one_thread  # noqa: F401 - one thread (autouse): bitwise comparisons
from tlt.model import decode_mirror
from tlt.model.attention import AttentionMetadata, attend_groups, contiguous_split
from tlt.model.decode_mirror import DecodeMirror


def _paged(ctx, q_lens, block_size, seed, num_blocks=64, kvh=2, nh=4, d=8):
    """Random tables (distinct blocks, shuffled), caches and queries; every unused cache slot holds large values,
    so a key position a row must not see changes its output by far more than rounding."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in zip(ctx, q_lens)]
    kc = torch.randn(num_blocks, block_size, kvh, d, generator=g) * 4
    vc = torch.randn(num_blocks, block_size, kvh, d, generator=g) * 30
    q = torch.randn(sum(q_lens), nh, d, generator=g)
    return tables, kc, vc, q


# ----------------------------------------------------------------------------- attention.py


def test_a_run_is_costed_by_its_longest_key_so_a_mixed_chunk_goes_with_the_long_rows():  # AM-1
    # 32 sorted rows: 15 of 10 keys, then 17 of 500. Candidate cuts every 2 rows (ceil(32 / 16)), so rows 14
    # (10 keys) and 15 (500 keys) are one chunk. Costs (group 2000, one new token + gather 2.5 = 3.5 per key):
    #   one run                      2000 + 32 * 500 * 3.5                          = 58000
    #   [0, 14) [14, 32)             4000 + 14 * 10 * 3.5 + 18 * 500 * 3.5          = 35990  <- the least
    #   [0, 16) [16, 32)             4000 + 16 * 500 * 3.5 + 16 * 500 * 3.5         = 60000
    #   [0, 14) [14, 16) [16, 32)    6000 + 490 + 2 * 500 * 3.5 + 16 * 500 * 3.5    = 37990
    keys = [10] * 15 + [500] * 17
    assert contiguous_split(keys, [1] * 32, 4, 2000, 2.5) == [0, 14, 32]


def test_metadata_for_the_kernels_keeps_one_group_per_kind_however_ragged():  # AM-2
    # 12 decode rows and 6 verify rows over contexts 3 .. 300: SDPA splits each kind by length, the kernels
    # take ragged lengths as they are (one launch per kind)
    ctx = [3 + 27 * i for i in range(12)] + [5 + 50 * i for i in range(6)]
    q_lens = [1] * 12 + [3] * 6
    tables = [list(range(-(-(c + n) // 8))) for c, n in zip(ctx, q_lens)]
    trees = [None] * 12 + [torch.ones(3, 3, dtype=torch.bool).tril()] * 6
    sdpa = AttentionMetadata.build(q_lens, ctx, tables, 8, tree_masks=trees, max_parts=4)
    assert len(sdpa.groups) > 2  # the lengths are worth splitting
    kern = AttentionMetadata.build(q_lens, ctx, tables, 8, tree_masks=trees, max_parts=4, for_kernels=True)
    assert len(kern.groups) == 2 and all(g.kernel is not None for g in kern.groups)
    assert [g.kernel.block_tables.shape[0] for g in kern.groups] == [12, 6]


def test_a_decode_row_one_shorter_than_the_longest_does_not_see_the_position_after_its_token():  # AM-3
    ctx = [6, 7, 7]  # row 0's table covers positions 0 .. 7; position 7 is not its token (large values there)
    tables, kc, vc, q = _paged(ctx, [1, 1, 1], 4, seed=3)
    meta = AttentionMetadata.build([1, 1, 1], ctx, tables, 4)
    with torch.inference_mode():
        got = attend_groups(q, kc, vc, meta, 8**-0.5)
    want = _reference(ctx, [1, 1, 1], [None] * 3, tables, kc, vc, q, 4)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    (group,) = meta.groups
    assert group.lk == 8
    assert group.mask[:, 0, 0].tolist() == [[True] * 7 + [False], [True] * 8, [True] * 8]
    # equal contexts: no mask needed, every row sees its lk keys
    assert AttentionMetadata.build([1, 1], [7, 7], tables[1:], 4).groups[0].mask is None


def test_a_plain_chunk_beside_trees_in_a_kernel_group_is_causal():  # AM-4
    from tlt.model.kernel_ops import attend

    ctx, q_lens = [5, 9, 2], [3, 4, 2]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    trees = [tree, None, torch.ones(2, 2, dtype=torch.bool).tril()]
    tables, kc, vc, q = _paged(ctx, q_lens, 4, seed=5)
    kern = AttentionMetadata.build(q_lens, ctx, tables, 4, tree_masks=trees, for_kernels=True)
    (group,) = kern.groups
    t, f = True, False
    assert group.kernel.tree_mask[1].tolist() == [[t, f, f, f], [t, t, f, f], [t, t, t, f], [t, t, t, t]]
    assert group.kernel.tree_mask[0].tolist() == [[t, f, f, f], [t, t, f, f], [t, f, t, f], [f, f, f, f]]
    with torch.inference_mode():
        got = attend_groups(q, kc, vc, kern, 8**-0.5, functools.partial(attend, impl="torch"))
    torch.testing.assert_close(got.double(), _reference(ctx, q_lens, trees, tables, kc, vc, q, 4), rtol=1e-5,
                               atol=1e-5)


def test_an_sdpa_group_attends_its_longest_context_plus_new_tokens_and_no_more():  # AM-5
    # the multi-token group holds rows 0 (3 + 5 keys) and 2 (10 + 2): 12 keys, 3 blocks of 4 each
    # (the longest context + the most new tokens would be 15: 4 blocks, 3 keys of padding per row)
    ctx, q_lens = [3, 20, 10], [5, 1, 2]
    meta = AttentionMetadata.build(q_lens, ctx, [[0, 1], [2, 3, 4, 5, 6, 7], [8, 9, 10]], 4, max_parts=1)
    single, multi = meta.groups
    assert (single.lk, multi.lk) == (21, 12)
    assert multi.block_index.tolist() == [0, 1, 0, 8, 9, 10] and tuple(multi.mask.shape) == (2, 1, 5, 12)


# ----------------------------------------------------------------------------- decode_mirror.py


def _prefill(h: Harness, lengths: dict[str, int]) -> None:
    for n, length in lengths.items():
        h.add(n, length)
        h.step([n], [length])


def test_a_capacity_limited_by_the_cache_is_whole_blocks():  # AM-6
    # 62 blocks of 4: 248 positions, 49 per row for 5 rows, so whole blocks give 48 a row (never 49)
    h = Harness(num_blocks=62)
    names = ["long", *"abcd"]
    _prefill(h, {"long": 46, **dict.fromkeys("abcd", 4)})
    mirror = h.mirrored.mirror
    # keys 47 (gathers: first after a prefill), 48 (fits: rebuilt at capacity 48), 49 (fits no whole block: gathers)
    assert h.step(names) == "gather"
    assert h.step(names) == "rebuild" and mirror.held.cap == 48
    assert h.step(names) == "gather"


def test_keys_that_exactly_fill_the_capacity_rebuild_into_it():  # AM-7
    h = Harness(num_blocks=400)
    names = list("abcde")
    _prefill(h, dict.fromkeys(names, 62))
    mirror = h.mirrored.mirror
    assert h.step(names) == "gather"  # keys 63, the first step after the prefill
    assert h.step(names) == "rebuild" and mirror.held.cap == 64  # keys 64: capacity 64
    assert [h.step(names) for _ in range(2)] == ["rebuild", "append"] and mirror.held.cap == 128  # 65: outgrown


def test_after_a_compaction_each_run_of_slots_attends_its_longest_row(monkeypatch):  # AM-8
    """The shortest rows finish: the longest rows move into their slots at the front, so a run's last slot no
    longer holds its longest row. Runs are chosen afresh and each covers its longest row's keys."""
    monkeypatch.setattr(decode_mirror, "SLOT_RUN_UNITS", 20)
    h = Harness(num_blocks=1200)
    mirror = h.mirrored.mirror
    mirror.max_parts = 4
    names = [f"s{i}" for i in range(16)]
    lengths = [6 + (23 * i) % 120 for i in range(16)]
    _prefill(h, dict(zip(names, lengths)))
    assert [h.step(names, atol=1e-5) for _ in range(2)] == ["gather", "rebuild"]
    assert mirror.held.bounds is not None
    shortest = sorted(names, key=h.ctx.__getitem__)[:3]
    names = [n for n in names if n not in shortest]
    assert [h.step(names, atol=1e-5) for _ in range(3)] == ["append"] * 3
    held = mirror.held
    assert held.slots is not None and held.bounds is not None and len(held.bounds) > 2
    keys = [held.context_lens[r] + 1 for r in held.row_of_slot.tolist()]  # per slot
    assert held.lks == [max(keys[a:z]) for a, z in zip(held.bounds, held.bounds[1:])]
    assert any(max(keys[a:z]) != keys[z - 1] for a, z in zip(held.bounds, held.bounds[1:]))


def test_rows_sharing_a_held_rows_blocks_do_not_both_continue_it():  # AM-9
    """a and b share every block up to their newest token (the same tokens: the same K/V in the same slots), then
    write their next tokens in blocks of their own while c finishes. Each held row is continued by one row at
    most: b continues held row b, not a (whose slot would then take both rows' new tokens)."""
    h = Harness(num_blocks=400)
    _prefill(h, {"a": 9, "c": 30})
    h.tokens["b"] = h.tokens["a"][:12] + [(t + 1) % 97 for t in h.tokens["a"][12:]]  # the same up to position 11
    h.tables["b"], h.ctx["b"] = list(h.tables["a"]), 9  # a's 3 blocks: positions 0 .. 11
    assert len(h.tables["a"]) == 3
    assert [h.step(["a", "b", "c"]) for _ in range(3)] == ["gather", "rebuild", "append"]  # positions 9, 10, 11
    assert h.tables["a"] == h.tables["b"]
    assert [h.step(["a", "b"]) for _ in range(3)] == ["append"] * 3  # c finished; a and b in blocks of their own
    assert h.tables["a"][3] != h.tables["b"][3]


def test_min_bytes_is_the_batch_k_and_v_per_layer_over_lk_positions():  # AM-10
    # 2 rows, contexts 10 and 12: lk = 13 positions, each 2 (K and V) x 2 heads x 8 dims x 4 bytes = 128 bytes
    meta = AttentionMetadata.build([1, 1], [10, 12], [[0, 1, 2], [3, 4, 5, 6]], 4)
    for min_bytes, plans in ((2 * 13 * 128, True), (2 * 13 * 128 + 1, False)):
        mirror = DecodeMirror(1, 64, 4, 2, 8, torch.float32, torch.device("cpu"))
        mirror.min_bytes, mirror.after_other_write = min_bytes, False
        step = mirror.plan(meta)
        assert (step is not None) == plans
        if plans:
            assert step.rebuild_index is not None and step.cap == 64
