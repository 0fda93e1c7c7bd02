"""The model-free n-gram drafter on hand-built contexts: own-context and sibling matches, longest
suffix first, tries from several matches, padding for batched acceptance."""

from __future__ import annotations

import torch

from tlt.services.rollout.spec.accept import tree_accept
from tlt.services.rollout.spec.ngram import NgramIndex, pad_trees, trie_tree
from tlt.services.rollout.spec.tree import Arm


def test_own_context_repetition_gives_a_chain():
    idx = NgramIndex(1, 3)
    idx.extend(0, [5, 1, 2, 3, 4, 9, 1, 2])
    tree = idx.propose(0, Arm(3, 1, 4))
    # suffix (1, 2) occurred before, followed by 3 4 9
    assert tree.tokens.tolist() == [[2, 3, 4, 9]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2]]
    assert tree.depth.tolist() == [[0, 1, 2, 3]]


def test_longest_suffix_wins_and_siblings_are_used():
    idx = NgramIndex(1, 3)
    idx.extend(0, [7, 8, 1, 2, 6, 6])  # prompt + sibling 0's output: "1 2" -> 6
    idx.extend(1, [7, 8, 4, 1, 2])  # sibling 1: "4 1 2" never seen, "1 2" seen in sibling 0
    assert idx.continuations(1, 2, 1) == [[6, 6]]
    idx.extend(0, [4, 1, 2, 5])  # now "4 1 2" -> 5 exists in sibling 0: the longer match comes first
    assert idx.continuations(1, 2, 2) == [[5], [6, 6]]
    tree = idx.propose(1, Arm(2, 2, 8))
    assert tree.tokens.tolist() == [[2, 5, 6, 6]]
    assert tree.parents.tolist() == [[-1, 0, 0, 2]]
    assert tree.children(0) == [[1, 2], [], [3], []]


def test_no_match_gives_a_root_only_tree():
    idx = NgramIndex(2, 3)
    idx.extend(0, [1, 2, 3, 4])
    tree = idx.propose(0, Arm(4, 2, 8))
    assert tree.tokens.tolist() == [[4]] and tree.parents.tolist() == [[-1]]


def test_trie_merges_shared_prefixes_and_respects_the_node_budget():
    tree = trie_tree(9, [[1, 2, 3], [1, 2, 4], [5]], max_nodes=10)
    assert tree.tokens.tolist() == [[9, 1, 2, 3, 4, 5]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 2, 0]]
    small = trie_tree(9, [[1, 2, 3], [5, 6]], max_nodes=3)
    assert small.tokens.tolist() == [[9, 1, 2]]


def test_padded_trees_never_accept_padding():
    a = trie_tree(9, [[1, 2]], 8)
    b = trie_tree(4, [[3], [7]], 8)
    c = trie_tree(4, [], 8)
    tree, counts = pad_trees([a, b, c])
    assert counts.tolist() == [3, 3, 1]
    assert tree.tokens.tolist() == [[9, 1, 2], [4, 3, 7], [4, -1, -1]]
    assert tree.parents.tolist() == [[-1, 0, 1], [-1, 0, 0], [-1, 0, 0]]
    targets = torch.tensor([[1, 2, 8], [7, 0, 0], [0, 0, 0]])
    res = tree_accept(tree.tokens, tree.parents, targets)
    assert [res.emitted(i) for i in range(3)] == [[1, 2, 8], [7, 0], [0]]


def test_a_repetition_drafts_a_full_length_chain():
    # the most recent match of the suffix ends just before the end (tail of 1 token); an older match
    # with the same first token and a full tail must win
    idx = NgramIndex(1, 4)
    idx.extend(0, [7, 5, 5, 5, 5, 5, 5, 5])
    tree = idx.propose(0, Arm(3, 1, 4))
    assert tree.tokens.tolist() == [[5, 5, 5, 5]]


def test_ngram_source_shares_siblings_and_keeps_the_most_recent_groups():
    from tlt.services.rollout.engine.sequence import Sequence
    from tlt.services.rollout.spec.drafting import NgramSource
    from tlt.services.rollout.types import SamplingParams

    def seq(rid: str, k: int, out: list[int]) -> Sequence:
        s = Sequence(rid, k, (7, 8), SamplingParams(temperature=0.0), 100, 0, frozenset())
        s.token_ids.extend(out)
        return s

    src = NgramSource(1, 3, max_groups=2)
    src.catch_up([seq("a", 0, [1, 2, 6, 3])])
    tree, counts = src.draft([seq("a", 1, [1, 2])], Arm(2, 1, 3))
    assert tree.tokens.tolist() == [[2, 6, 3]] and counts.tolist() == [3]  # sibling 0's "1 2" -> 6 3
    src.catch_up([seq("b", 0, [1])])
    src.catch_up([seq("c", 0, [1])])
    assert list(src.groups) == ["b", "c"]  # at most max_groups indexes: the least recently used one goes
    src.catch_up([seq("b", 0, [1, 4])])
    src.catch_up([seq("d", 0, [1])])
    assert list(src.groups) == ["b", "d"]
    src.forget("b")
    assert list(src.groups) == ["d"]


def _reference_continuations(seqs: dict[int, list[int]], order: list[tuple[int, int]], sibling: int,
                             length: int, limit: int, min_n: int, max_n: int, scan: int) -> list[list[int]]:
    """The rule of `NgramIndex.continuations` written the slow way: every occurrence of every suffix is
    found by scanning all text, in the order the tokens arrived (`order`: (sibling, position))."""
    ctx = seqs[sibling]
    best: dict[int, list[int]] = {}
    for n in range(min(max_n, len(ctx)), min_n - 1, -1):
        suffix = ctx[-n:]
        hits = [(sid, end) for sid, end in order if end >= n - 1 and seqs[sid][end - n + 1 : end + 1] == suffix]
        own = [h for h in reversed(hits) if h[0] == sibling][:scan]
        others = [h for h in reversed(hits) if h[0] != sibling][:scan]
        level: dict[int, list[int]] = {}
        for sid, end in own + others:
            if sid == sibling and end == len(ctx) - 1:
                continue
            cont = seqs[sid][end + 1 : end + 1 + length]
            if not cont or cont[0] in best:
                continue
            if cont[0] not in level:
                if len(best) + len(level) < limit:
                    level[cont[0]] = cont
            elif len(cont) > len(level[cont[0]]):
                level[cont[0]] = cont
        best.update(level)
        if len(best) >= limit and all(len(c) == length for c in best.values()):
            break
    return list(best.values())


def test_continuations_match_a_full_scan_reference_on_random_groups():
    # small vocabularies and copied stretches give many repeated n-grams: the index's bounded lookups
    # (newest `scan` own hits, newest `scan` sibling hits, early exit once a level is settled) must pick
    # exactly what scanning every occurrence picks
    import random

    rng = random.Random(5)
    checked = 0
    for trial in range(40):
        vocab, siblings = rng.choice([3, 5, 12]), rng.randint(1, 6)
        min_n, max_n = rng.choice([(1, 3), (1, 4), (2, 3)])
        scan = rng.choice([2, 4, 64])
        idx = NgramIndex(min_n, max_n)
        seqs: dict[int, list[int]] = {}
        order: list[tuple[int, int]] = []
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        for s in range(siblings):
            idx.extend(s, prompt)
            seqs[s] = list(prompt)
            order += [(s, i) for i in range(len(prompt))]
        for _ in range(rng.randint(5, 60)):
            s = rng.randrange(siblings)
            toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            idx.extend(s, toks)
            for t in toks:
                seqs[s].append(t)
                order.append((s, len(seqs[s]) - 1))
            for sib in range(siblings):
                length, limit = rng.randint(1, 6), rng.randint(1, 4)
                want = _reference_continuations(seqs, order, sib, length, limit, min_n, max_n, scan)
                assert idx.continuations(sib, length, limit, scan) == want, (trial, sib)
                checked += 1
    assert checked > 1000


def test_a_batch_of_node_lists_pads_as_the_trees_do():
    from tlt.services.rollout.spec.ngram import pad_nodes, trie_nodes

    conts = [(9, [[1, 2]]), (4, [[3], [7]]), (4, [])]
    by_nodes, counts_n = pad_nodes([trie_nodes(r, c, 8) for r, c in conts])
    by_trees, counts_t = pad_trees([trie_tree(r, c, 8) for r, c in conts])
    assert counts_n.tolist() == counts_t.tolist() == [3, 3, 1]
    for field in ("tokens", "parents", "depth", "score"):
        a, b = getattr(by_nodes, field), getattr(by_trees, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
