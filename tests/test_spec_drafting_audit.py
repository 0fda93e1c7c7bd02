"""Gaps a mutation audit of spec/drafting.py, spec/ngram.py and spec/arm.py found (helper F): the EAGLE source's pair
bookkeeping across several observes and drafts, a cold restart and a weight reset emptying the drafter rows, a
backlog of exactly FEED_BATCH_MAX pairs, wide trees against a from-scratch run, released keys, the graphs' scratch
row, the sampled chains' uniforms, and the n-gram index's bounds. Each test names the mutant (Dn / Nn) it pins;
drafts are checked against the drafter module run from scratch over the pairs (`test_spec_eagle._reference_scores`).
"""

from __future__ import annotations

import pytest
import torch

from test_spec_eagle import H, V, _drafter, _reference_scores, _seq

from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.spec.accept import sample_probs
from tlt.services.rollout.spec.drafting import EagleSource
from tlt.services.rollout.spec.ngram import NgramIndex
from tlt.services.rollout.spec.rng import DRAFT, counter_uniforms, key_tensor
from tlt.services.rollout.spec.tree import Arm
from tlt.services.rollout.types import SamplingParams

ARM = Arm(2, 2, 4)


def _length(src: EagleSource, key: tuple[str, int]) -> int:
    return int(src.cache.lengths[src.rows[key]])


def _observed(src: EagleSource, g: torch.Generator, name: str, prompt: list[int], olen: int):  # noqa: ANN202
    """A sequence of `olen` random output tokens after `prompt`, their pairs (random features) observed by `src`:
    (the sequence, its output tokens, their features)."""
    out = torch.randint(0, V, (olen,), generator=g).tolist()
    s = _seq(name, prompt, out)
    feats = torch.randn(olen, H, generator=g)
    src.observe([s], [out], [list(feats)], [len(prompt)])
    return s, out, feats


def _check(d, src: EagleSource, s: Sequence, toks: list[int], feats, first: int,  # noqa: ANN001
           arm: Arm = ARM) -> None:
    """Draft s alone: warm, every node's score that of a from-scratch run over exactly these pairs."""
    tree, counts = src.draft([s], arm)
    assert counts.tolist() == [arm.draft_tokens]
    ref = _reference_scores(d, toks, torch.stack(list(feats)), first, tree, 0)
    assert torch.allclose(tree.score[0], torch.tensor(ref), atol=1e-4)
    assert _length(src, (s.request_id, s.sample_index)) == len(toks)


def test_pairs_arriving_after_a_draft_and_one_observe_at_a_time_extend_the_row():
    """D-14 (the gap test `fed_pos != first - 1` read as `!= first`: contiguous pairs restarted the row) and D-38
    (observe's contiguity test off by one: a second observe before a draft replaced the first one's pairs). Pairs at
    positions 3..5 fed by a draft, then 6 and 7 observed one step at a time: the row holds all five, and the drafts
    are a from-scratch run over all five."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(21)
    s = _seq("r", [1, 2, 3], [4, 5, 6])
    feats = list(torch.randn(5, H, generator=g))
    src.observe([s], [[4, 5, 6]], [feats[:3]], [3])
    _check(d, src, s, [4, 5, 6], feats[:3], 3)
    for pos, tok in ((6, 7), (7, 8)):  # two plain steps, each observed, no draft between them
        s.token_ids.append(tok)
        src.observe([s], [[tok]], [[feats[pos - 3]]], [pos])
    _check(d, src, s, [4, 5, 6, 7, 8], feats, 3)
    assert src.cold_starts == 0


def test_a_cold_restart_empties_the_row_before_the_next_pairs():
    """D-10 (the cold path in `_feed` left the row's length): a warm row whose sequence then decoded two tokens that
    nobody observed restarts cold (root only); the root-only verify's pair is then the row's only content, not
    appended after the stale pairs."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(22)
    s = _seq("r", [1, 2, 3], [4, 5, 6])
    src.observe([s], [[4, 5, 6]], [list(torch.randn(3, H, generator=g))], [3])
    src.draft([s], ARM)  # warm: row length 3
    s.token_ids.extend([7, 8])  # decoded without speculation, never observed
    tree, counts = src.draft([s], ARM)
    assert counts.tolist() == [1] and tree.tokens.tolist() == [[8]] and src.cold_starts == 1
    f = torch.randn(1, H, generator=g)
    s.token_ids.append(9)  # the root-only verify emitted 9, produced by the feature at position 7
    src.observe([s], [[9]], [list(f)], [8])
    _check(d, src, s, [9], f, 8)
    assert src.cold_starts == 1


def test_a_backlog_of_exactly_feed_batch_max_pairs_is_fed_once():
    """D-16 (the long-backlog group taking `>= FEED_BATCH_MAX`: a run of exactly that many pairs was in both groups
    and fed twice). Backlogs of 16, 17 and 2 pairs drafted together: each row holds its own pairs once and drafts
    what a from-scratch run over them drafts."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(23)
    n_max = EagleSource.FEED_BATCH_MAX
    seqs, pairs = [], []
    for i, n in enumerate((n_max, n_max + 1, 2)):
        s, out, feats = _observed(src, g, f"b{i}", [1, 2], n)
        seqs.append(s)
        pairs.append((out, feats))
    tree, counts = src.draft(seqs, ARM)
    assert counts.tolist() == [4] * 3 and src.cold_starts == 0
    for b, (s, (out, feats)) in enumerate(zip(seqs, pairs)):
        assert _length(src, (s.request_id, 0)) == len(out)
        ref = _reference_scores(d, out, feats, 2, tree, b)
        assert torch.allclose(tree.score[b], torch.tensor(ref), atol=1e-4), b


@pytest.mark.parametrize("arm", [Arm(3, 2, 11), Arm(3, 3, 22)])
def test_every_candidate_of_a_full_tree_matches_a_from_scratch_run(arm):
    """D-34 (the prefix mask showing the first drafted slot, `rel <= 0`, to every node): with draft_tokens = the
    arm's max_nodes the tree keeps every candidate, the second beam branch's descendants included, which must not
    see the first branch's node. Rows of different lengths, every node's score against a from-scratch run."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(24)
    seqs, pairs = [], []
    for i, (plen, olen) in enumerate([(3, 5), (2, 8), (4, 2)]):
        s, out, feats = _observed(src, g, f"t{i}", torch.randint(0, V, (plen,), generator=g).tolist(), olen)
        seqs.append(s)
        pairs.append((out, feats, plen))
    tree, counts = src.draft(seqs, arm)
    assert counts.tolist() == [arm.max_nodes] * 3
    for b, (out, feats, plen) in enumerate(pairs):
        ref = _reference_scores(d, out, feats, plen, tree, b)
        assert torch.allclose(tree.score[b], torch.tensor(ref), atol=1e-4), b


def test_a_released_sequences_pending_pairs_go_with_it():
    """D-42 (`release` kept the sequence's pending pairs): pairs observed after a sequence's last draft are dropped
    when it is released, so a later sequence under the same key (a reused request id) starts cold instead of being
    fed the finished one's pairs."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(25)
    s = _seq("r", [1, 2, 3], [4, 5, 6])
    src.observe([s], [[4, 5, 6]], [list(torch.randn(3, H, generator=g))], [3])
    src.release(s)
    assert not src.pending and not src.rows
    again = _seq("r", [1, 2, 3], [7, 8, 9])  # the same (request id, sample) and length
    tree, counts = src.draft([again], ARM)
    assert counts.tolist() == [1] and tree.tokens.tolist() == [[9]] and src.cold_starts == 1


def test_a_reset_restarts_every_row_cold_and_empty():
    """D-43 (reset left the rows' lengths), D-45 (reset kept `fed_pos`), D-46 (reset kept the pending pairs): after
    new weights a fed row and a row with pairs still pending both draft root-only (cold); pairs observed after the
    reset are then the row's only content."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(26)
    a = _seq("a", [1, 2, 3], [4, 5, 6])
    b = _seq("b", [1, 2, 3], [7, 8])
    src.observe([a], [[4, 5, 6]], [list(torch.randn(3, H, generator=g))], [3])
    src.draft([a], ARM)  # a: fed, warm
    src.observe([b], [[7, 8]], [list(torch.randn(2, H, generator=g))], [3])  # b: pending, never fed
    src.reset()
    tree, counts = src.draft([a, b], ARM)
    assert counts.tolist() == [1, 1] and tree.tokens[:, 0].tolist() == [6, 8] and src.cold_starts == 2
    # a fresh warm row after the reset: only the pair observed since
    src2 = EagleSource(d)
    src2.observe([a], [[4, 5, 6]], [list(torch.randn(3, H, generator=g))], [3])
    src2.draft([a], ARM)
    src2.reset()
    f = torch.randn(1, H, generator=g)
    a.token_ids.append(10)
    src2.observe([a], [[10]], [list(f)], [6])
    _check(d, src2, a, [10], f, 6)


def test_the_graphs_scratch_row_is_no_sequences_row():
    """D-47 (with drafter graphs, row 0 - the scratch row every padding slot of a bucket drafts into - handed out to
    a sequence): chains drafted through emulated graphs padded to a bucket of 4 equal those drafted without graphs,
    and no sequence holds row 0."""
    d = _drafter()
    g = torch.Generator().manual_seed(27)
    seqs, obs = [], []
    for i, olen in enumerate((5, 3)):
        out = torch.randint(0, V, (olen,), generator=g).tolist()
        seqs.append(_seq(f"g{i}", [1, 2], out))
        obs.append((out, list(torch.randn(olen, H, generator=g))))
    trees = []
    for graphs in ("off", "emulate"):
        src = EagleSource(d, graphs=graphs, graph_buckets=(4,), rows=4)
        for s, (out, feats) in zip(seqs, obs):
            src.observe([s], [out], [feats], [2])
        trees.append([src.draft(seqs[:n], Arm(5, 1, 6))[0] for n in (1, 2)])
    for off, emu in zip(*trees):
        assert torch.equal(off.tokens, emu.tokens)
        assert torch.allclose(off.score, emu.score, atol=1e-4)
    assert 0 not in src.rows.values()  # src: the emulated graphs' source


def test_a_sampled_chains_drafts_use_the_uniform_of_their_own_position():
    """D-25 (the DRAFT uniforms taken from position num_tokens - 1 + i instead of num_tokens + i): draft i of a
    sampled chain is the inverse-CDF draw (`accept.sample_probs`) from its p with the DRAFT counter uniform of
    position num_tokens + i, and the first p is the drafter's tempered distribution at the root, run from scratch."""
    d = _drafter()
    g = torch.Generator().manual_seed(28)
    params = SamplingParams(temperature=0.8, seed=3)
    depth = 4
    for i in range(4):
        s = Sequence(f"s{i}", i, (1, 2, 3), params, 100, 3, frozenset())
        out = torch.randint(0, V, (5 + i,), generator=g).tolist()
        s.token_ids.extend(out)
        feats = torch.randn(len(out), H, generator=g)
        src = EagleSource(d)
        src.observe([s], [out], [list(feats)], [3])
        tree, counts = src.draft([s], Arm(depth, 1, depth + 1), sample=True)
        assert tree.sampled.tolist() == [True] and counts.tolist() == [depth + 1]
        with torch.no_grad():
            h = d(torch.tensor([out]), feats[None], torch.arange(3, 3 + len(out))[None])[0, -1]
            p0 = (d.compute_logits(h).float() / 0.8).softmax(-1)
        probs = tree.draft_probs[0]
        assert torch.allclose(probs[0], p0, atol=1e-5)
        u = counter_uniforms(key_tensor([s.rng_key]), torch.arange(s.num_tokens, s.num_tokens + depth)[None], DRAFT)[0]
        assert tree.tokens[0, 1:].tolist() == sample_probs(probs, u).tolist(), i


def test_the_sample_flag_leaves_tree_arms_deterministic():
    """D-21 (sampling taken for every warm row whatever the arm): `sample` applies to chain arms only; a tree arm
    drafts the same deterministic tree with or without it, with no sampled rows."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(29)
    s = Sequence("s", 0, (1, 2, 3), SamplingParams(temperature=0.9, seed=1), 100, 1, frozenset())
    out = torch.randint(0, V, (4,), generator=g).tolist()
    s.token_ids.extend(out)
    src.observe([s], [out], [list(torch.randn(4, H, generator=g))], [3])
    arm = Arm(3, 2, 6)
    plain, _ = src.draft([s], arm)
    tree, counts = src.draft([s], arm, sample=True)
    assert counts.tolist() == [6] and tree.sampled is None and tree.draft_probs is None
    assert tree.tokens.tolist() == plain.tokens.tolist() and torch.equal(tree.score, plain.score)


@pytest.mark.parametrize("min_n,max_n", [(0, 3), (3, 2), (-1, 1)])
def test_the_ngram_index_refuses_n_outside_one_to_max(min_n, max_n):
    """N-1 (`0 <= min_n` accepted): an n-gram index needs 1 <= min_n <= max_n (a 0-gram matches everywhere)."""
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(min_n, max_n)


def test_arm_parse_takes_plain_with_spaces_and_refuses_a_zero_depth_arm_by_its_name():
    """A-1 (`plain` matched before stripping: " plain " refused), A-4 (is_plain reading only steps and topk: "0_0_5"
    taken for plain), A-12 (the name "plain" for any arm of steps 0: "0_2_3"'s error named the plain arm)."""
    assert Arm.parse(" plain\n").is_plain and Arm.parse(" plain ").name == "plain"
    with pytest.raises(ValueError, match="0_0_5"):
        Arm.parse("0_0_5")
    assert not Arm(0, 0, 5).is_plain and Arm(0, 0, 5).name == "0_0_5"
    with pytest.raises(ValueError, match="arm 0_2_3: steps and topk"):
        Arm.parse("0_2_3")


def test_observe_never_extends_the_callers_lists():
    """D-56 (the pending entry holding the caller's own lists: the decoder passes each SpecEmission's token_ids, and
    the next contiguous observe extended them in place)."""
    src = EagleSource(_drafter())
    s = _seq("r", [1, 2, 3], [4, 5, 6])
    toks, feats = [4, 5], [torch.zeros(H), torch.ones(H)]
    src.observe([s], [toks], [feats], [3])
    src.observe([s], [[6]], [[torch.full((H,), 2.0)]], [5])  # contiguous: extends the pending pairs
    assert toks == [4, 5] and len(feats) == 2
    assert src.pending[("r", 0)][0] == [4, 5, 6] and src.pending[("r", 0)][2] == 3


def test_cut_chains_keep_their_own_counts_beside_a_cold_row():
    """D-57 (a warm row taken out of a mixed batch with all the batch's nodes instead of its own count): with the
    confidence cut, two warm greedy rows cut at different depths beside a cold row keep the counts (1 + the drafts
    whose cumulative score reaches the floor, read off the uncut chains) and drafts they have alone."""
    import math

    d = _drafter()
    g = torch.Generator().manual_seed(30)
    data = []
    for i, olen in enumerate((6, 4)):
        out = torch.randint(0, V, (olen,), generator=g).tolist()
        data.append((f"w{i}", out, list(torch.randn(olen, H, generator=g))))
    arm = Arm(5, 1, 6)

    def draft(names, **kw):
        src = EagleSource(d, **kw)
        seqs = []
        for name, out, feats in data:
            if name in names:
                s = _seq(name, [1, 2], out)
                src.observe([s], [out], [feats], [2])
                seqs.append(s)
        if "cold" in names:
            seqs.append(_seq("cold", [1, 2], [3, 4]))  # no pairs: root only
        return src.draft(seqs, arm)

    full, _ = draft(["w0", "w1"])
    floors = sorted({float(x) for x in full.score[:, 1:].flatten()})
    floor = next(f for f in floors if len({int((full.score[b, 1:] >= f).sum()) for b in range(2)}) == 2)
    want = [1 + int((full.score[b, 1:] >= floor).sum()) for b in range(2)]
    tree, counts = draft(["w0", "w1", "cold"], chain_min_prob=math.exp(floor) * (1 - 1e-6))
    assert counts.tolist() == want + [1]
    for b in range(2):
        alone, c = draft([f"w{b}"], chain_min_prob=math.exp(floor) * (1 - 1e-6))
        assert c.tolist() == [want[b]]
        got = tree.tokens[b, : want[b]].tolist()
        assert got == alone.tokens[0, : want[b]].tolist() == full.tokens[b, : want[b]].tolist()
