"""SDPA groups split by length (`tlt.model.attention.split_by_length`) change no result.

A verify step pads every sequence to the group's longest context; on the CPU such steps are split into
groups of similar length. Checked here: the split itself on hand-built lengths; `attend_groups` on a
ragged verify step (mixed contexts, new-token counts and tree masks) split and unsplit, against a
float64 attention computed per sequence over its own keys; and the engine's greedy tokens with
speculation on, split and unsplit, equal to plain decoding. Random weights and caches; nothing faked.
"""

from __future__ import annotations

import pytest
import torch

from tlt.model import attention
from tlt.model.attention import AttentionMetadata, attend_groups, split_by_length
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)


def _check_partition(parts: list[list[int]], ix: list[int], max_parts: int) -> None:
    assert 1 <= len(parts) <= max_parts
    assert sorted(i for p in parts for i in p) == sorted(ix)
    assert all(p == sorted(p) and p for p in parts)  # each group keeps batch order


def test_equal_lengths_stay_one_group_in_batch_order() -> None:
    ix = list(range(64))
    assert split_by_length(ix, [200] * 64, [6] * 64, 4) == [ix]
    assert split_by_length(ix, [200 + i % 3 for i in range(64)], [6] * 64, 4) == [ix]  # 1% padding: not worth it


def test_two_clusters_split_exactly_into_them() -> None:
    # 32 short sequences (20 keys) interleaved with 32 long ones (400 keys)
    keys = [20 if i % 2 else 400 for i in range(64)]
    parts = split_by_length(list(range(64)), keys, [6] * 64, 4)
    _check_partition(parts, list(range(64)), 4)
    assert [sorted({keys[i] for i in p}) for p in parts] == [[20], [400]]


def test_uniform_lengths_use_every_part_and_a_small_batch_does_not_split() -> None:
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(40, 300, (256,), generator=g).tolist()
    parts = split_by_length(list(range(256)), keys, [6] * 256, 4)
    _check_partition(parts, list(range(256)), 4)
    assert len(parts) == 4
    tops = [max(keys[i] for i in p) for p in parts]
    assert tops == sorted(tops) and tops[-1] == max(keys)
    assert all(max(keys[i] for i in a) <= min(keys[i] for i in b) for a, b in zip(parts, parts[1:]))
    assert split_by_length([3, 5], [0, 0, 0, 10, 0, 300], [1] * 6, 4) == [[3, 5]]  # two tiny rows: a group's fixed cost wins
    assert split_by_length(list(range(9)), keys[:9], [6] * 9, 1) == [list(range(9))]


def test_a_subset_is_split_by_its_own_indices() -> None:
    ix = [1, 4, 6, 7, 9, 12, 15, 20] * 1
    keys = [0] * 21
    for n, i in enumerate(ix):
        keys[i] = 30 if n < 4 else 900
    q = [8] * 21
    parts = split_by_length(ix, keys, q, 3)
    _check_partition(parts, ix, 3)
    assert parts == [[1, 4, 6, 7], [9, 12, 15, 20]]


def _ragged_step(seed: int, n: int, block_size: int = 8):
    """A verify-like step over a random paged cache: contexts 5-150, 1-7 new tokens, some tree masks."""
    g = torch.Generator().manual_seed(seed)
    kvh, nh, d = 2, 4, 16
    ctx = torch.randint(5, 150, (n,), generator=g).tolist()
    q_lens = [int(x) for x in torch.randint(1, 8, (n,), generator=g)]
    trees: list[torch.Tensor | None] = []
    for i, q in enumerate(q_lens):
        if i % 3 == 0 and q > 1:  # a tree: every node sees the root and itself, half see their left neighbour
            tm = torch.eye(q, dtype=torch.bool)
            tm[:, 0] = True
            for r in range(2, q, 2):
                tm[r, r - 1] = True
            trees.append(tm)
        else:
            trees.append(None)
    free = torch.randperm(1200, generator=g).tolist()
    tables = []
    for c, q in zip(ctx, q_lens):
        nb = -(-(c + q) // block_size)
        tables.append([free.pop() for _ in range(nb)])
    kc = torch.randn(1200, block_size, kvh, d, generator=g)
    vc = torch.randn(1200, block_size, kvh, d, generator=g)
    q = torch.randn(sum(q_lens), nh, d, generator=g)
    return ctx, q_lens, trees, tables, kc, vc, q


def _reference(ctx, q_lens, trees, tables, kc, vc, q, block_size: int = 8) -> torch.Tensor:
    """float64 attention of each sequence's new tokens over its own keys (GQA: head h reads K/V head h // 2)."""
    out, start = [], 0
    nh, d, kvh = q.shape[1], q.shape[2], kc.shape[2]
    for c, n, tm, table in zip(ctx, q_lens, trees, tables):
        keys = torch.cat([kc[b] for b in table])[: c + n].double()  # [c + n, kvh, d]
        vals = torch.cat([vc[b] for b in table])[: c + n].double()
        visible = torch.ones(n, c + n, dtype=torch.bool)
        visible[:, c:] = tm if tm is not None else torch.ones(n, n, dtype=torch.bool).tril()
        qs = q[start : start + n].double()  # [n, nh, d]
        heads = []
        for h in range(nh):
            s = qs[:, h] @ keys[:, h // (nh // kvh)].T / d**0.5
            p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
            heads.append(p @ vals[:, h // (nh // kvh)])
        out.append(torch.stack(heads, 1).reshape(n, nh * d))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_attention_equals_the_unsplit_call_and_a_per_sequence_reference(seed) -> None:
    ctx, q_lens, trees, tables, kc, vc, q = _ragged_step(seed, 40)
    outs, groups = [], []
    for parts in (1, 4):
        meta = AttentionMetadata.build(q_lens, ctx, tables, 8, tree_masks=trees, max_parts=parts)
        groups.append(len(meta.groups))
        with torch.inference_mode():
            outs.append(attend_groups(q, kc, vc, meta, 16**-0.5))
    assert groups[0] == 2 and groups[1] > 2  # unsplit: the one-token rows and the rest; split: more
    torch.testing.assert_close(outs[1].double(), _reference(ctx, q_lens, trees, tables, kc, vc, q), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)


def test_split_groups_of_a_step_without_one_token_rows_gather_their_own_queries() -> None:
    # every sequence with 4 new tokens: unsplit, padded row r is flat token r (no query gather, no scatter);
    # each split group holds some of the sequences and must gather and scatter its own rows
    ctx, _, _, tables, kc, vc, _ = _ragged_step(5, 24)
    q_lens = [4] * 24
    tables = [t + [t[-1]] for t in tables]  # room for the 4 new tokens
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(9))
    meta = AttentionMetadata.build(q_lens, ctx, tables, 8, max_parts=4)
    assert len(meta.groups) > 1
    with torch.inference_mode():
        got = attend_groups(q, kc, vc, meta, 16**-0.5)
    torch.testing.assert_close(got.double(), _reference(ctx, q_lens, [None] * 24, tables, kc, vc, q), rtol=1e-5,
                               atol=1e-5)


def test_engine_greedy_with_speculation_is_the_same_split_or_not(tmp_path, monkeypatch) -> None:
    ckpt = random_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, max_position_embeddings=256, seed=3, weight_scale=0.03)
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = []
    for i in range(24):
        motif = torch.randint(3, 250, (3,), generator=g).tolist()
        requests.append(GenerationRequest(f"r{i}", tuple((motif * 40)[: 4 + 7 * i]), params))
    built = []
    real_build = AttentionMetadata.build.__func__

    def counting_build(cls, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        meta = real_build(cls, *a, **k)
        built.append(len(meta.groups))
        return meta

    monkeypatch.setattr(AttentionMetadata, "build", classmethod(counting_build))

    def run(spec: bool) -> dict[str, list[int]]:
        engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=24, block_size=8, max_num_batched_tokens=4096))
        if spec:
            engine.enable_spec(SpecConfig(mode="static", drafter="ngram", static_arm="5_1_6", threshold=64))
        return {o.request_id: o.token_ids for o in engine.generate(requests)}

    plain = run(False)
    built.clear()
    split = run(True)
    assert max(built) > 2  # verify steps were split by length
    monkeypatch.setattr(attention, "MAX_PARTS", 1)
    built.clear()
    unsplit = run(True)
    assert max(built) <= 2
    assert split == plain and unsplit == plain
