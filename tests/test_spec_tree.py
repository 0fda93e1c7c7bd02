"""Draft-tree construction, arms and tree attention masks against hand-built cases."""

from __future__ import annotations

import math

import pytest
import torch

from tlt.services.rollout.spec.tree import Arm, ancestor_mask, build_tree, chain_tree


def test_arm_parse_and_validate():
    arm = Arm.parse("8_4_48")
    assert (arm.steps, arm.topk, arm.draft_tokens) == (8, 4, 48)
    assert arm.name == "8_4_48" and str(arm) == "8_4_48"
    assert arm.max_nodes == 1 + 4 + 7 * 16
    assert Arm.parse("3_1_4").max_nodes == 4
    for bad in ["8_4", "8-4-48", "a_b_c", "8_4_48_1", ""]:
        with pytest.raises(ValueError, match="steps_topk_drafttokens"):
            Arm.parse(bad)
    with pytest.raises(ValueError, match="exceeds"):
        Arm.parse("3_1_5")  # a chain of 3 verifies at most 4 nodes
    with pytest.raises(ValueError, match=">= 2"):
        Arm.parse("3_1_1")
    with pytest.raises(ValueError, match=">= 1"):
        Arm.parse("0_4_8")
    plain = Arm.parse("plain")  # no drafts: the bandit's arm for not speculating
    assert plain.is_plain and plain.name == "plain" and Arm.parse(plain.name) == plain
    assert not arm.is_plain and plain.draft_tokens == 1
    assert Arm.parse("0_0_1") == plain  # the same arm by its numbers


def _hand_expand(step, beam, beam_tokens):
    """Draft distributions over V=5, chosen so no scores tie (see test_build_tree_hand_case)."""
    calls.append((step, beam.tolist(), beam_tokens.tolist()))
    table = {
        9: [0.5, 0.3, 0.1, 0.05, 0.05],  # root
        0: [0.05, 0.15, 0.5, 0.2, 0.1],
        1: [0.7, 0.2, 0.05, 0.03, 0.02],
        2: [0.1, 0.1, 0.1, 0.1, 0.6],
    }
    return torch.tensor([[table[int(t)] for t in row] for row in beam_tokens]).log()


calls: list = []


def test_build_tree_hand_case():
    # step 0: root(9) -> cand 1 = tok0 (.5), cand 2 = tok1 (.3); beam [1, 2]
    # step 1: cand 1 -> 3 = tok2 (.25), 4 = tok3 (.10); cand 2 -> 5 = tok0 (.21), 6 = tok1 (.06)
    # best 3 non-root: 1 (.5), 2 (.3), 3 (.25); best 4 adds 5 (.21)
    calls.clear()
    tree = build_tree(torch.tensor([9]), _hand_expand, Arm(2, 2, 4))
    assert calls == [(0, [[0]], [[9]]), (1, [[1, 2]], [[0, 1]])]
    assert tree.tokens.tolist() == [[9, 0, 1, 2]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
    assert tree.depth.tolist() == [[0, 1, 1, 2]]
    assert torch.allclose(tree.score.exp(), torch.tensor([[1.0, 0.5, 0.3, 0.25]]))
    tree5 = build_tree(torch.tensor([9]), _hand_expand, Arm(2, 2, 5))
    assert tree5.tokens.tolist() == [[9, 0, 1, 2, 0]]
    assert tree5.parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert tree5.children(0) == [[1, 2], [3], [4], [], []]
    # a third step expands the two best of step 1's candidates: 3 (.25) and 5 (.21)
    calls.clear()
    build_tree(torch.tensor([9]), _hand_expand, Arm(3, 2, 5))
    assert calls[2] == (2, [[3, 5]], [[2, 0]])


def test_tree_mask_and_positions():
    tree = build_tree(torch.tensor([9]), _hand_expand, Arm(2, 2, 5))
    mask = tree.attention_mask()[0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ]
    assert tree.positions(torch.tensor([10])).tolist() == [[10, 11, 11, 12, 12]]


def test_chain_when_topk_is_one():
    calls.clear()
    tree = build_tree(torch.tensor([9]), _hand_expand, Arm(3, 1, 4))
    # greedy chain: 9 -> 0 (.5) -> 2 (.5) -> 4 (.6)
    assert tree.tokens.tolist() == [[9, 0, 2, 4]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2]]
    assert math.isclose(float(tree.score[0, -1].exp()), 0.5 * 0.5 * 0.6, rel_tol=1e-5)
    ch = chain_tree(torch.tensor([9]), torch.tensor([[0, 2, 4]]))
    assert ch.tokens.tolist() == tree.tokens.tolist() and ch.parents.tolist() == tree.parents.tolist()
    assert ancestor_mask(ch.parents)[0].int().tolist() == torch.tril(torch.ones(4, 4)).int().tolist()


@pytest.mark.parametrize("arm", ["8_4_48", "5_3_16", "4_2_8", "3_4_20", "6_1_7"])
def test_random_trees_are_connected_ordered_and_distinct(arm):
    arm = Arm.parse(arm)
    g = torch.Generator().manual_seed(0)
    v, b = 12, 16
    table = (torch.randn(v, v, generator=g) * 3).log_softmax(-1)
    table[3] = torch.nn.functional.one_hot(torch.tensor(4), v).float().log()  # log-prob 0 and -inf: ties

    tree = build_tree(torch.randint(0, v, (b,), generator=g), lambda s, beam, tok: table[tok], arm)
    assert tree.tokens.shape == (b, arm.draft_tokens)
    for r in range(b):
        par = tree.parents[r].tolist()
        dep = tree.depth[r].tolist()
        assert par[0] == -1 and dep[0] == 0
        for i in range(1, len(par)):
            assert 0 <= par[i] < i, "parents precede children"
            assert dep[i] == dep[par[i]] + 1 and dep[i] <= arm.steps
            assert tree.score[r, i] <= tree.score[r, par[i]] + 1e-6
        for kids in tree.children(r):
            toks = [int(tree.tokens[r, k]) for k in kids]
            assert len(toks) == len(set(toks)), "sibling drafts must be distinct"


def test_ancestor_mask_against_a_python_reference_on_random_padded_trees():
    from tlt.services.rollout.spec.ngram import pad_trees

    arm = Arm.parse("5_3_12")
    g = torch.Generator().manual_seed(2)
    table = (torch.randn(9, 9, generator=g) * 2).log_softmax(-1)
    trees = [build_tree(torch.randint(0, 9, (1,), generator=g), lambda s, beam, tok: table[tok],
                        Arm(arm.steps, arm.topk, n)) for n in (12, 4, 2, 7)]
    batch, _ = pad_trees(trees + [chain_tree(torch.tensor([1]), torch.tensor([[2, 3]]))])
    mask = ancestor_mask(batch.parents)
    for r, par in enumerate(batch.parents.tolist()):
        for i in range(len(par)):
            seen, node = {i}, i
            while par[node] >= 0:
                node = par[node]
                seen.add(node)
            assert [j for j in range(len(par)) if mask[r, i, j]] == sorted(seen), (r, i)


def test_score_ties_go_to_the_earlier_candidate():
    """A drafter whose probabilities tie (bf16 logits do, often): the beam and the kept set take the earliest
    candidates, as the module docstring promises. Uniform over 8 tokens, arm 3_4_10: level 1 = candidates 1-4
    (all of the root's top 4), the beam of level 2 = its first 4 candidates (5-8, node 1's children), and the 9
    kept drafts = the 4 at depth 1 (score -ln 8) then the 5 earliest at depth 2 (-2 ln 8): 5-8 (parent 1) and
    9 (parent 2)."""
    seen: list = []

    def uniform(step, beam, toks):
        seen.append(beam.tolist())
        return torch.full((beam.shape[0], beam.shape[1], 8), -math.log(8.0))

    tree = build_tree(torch.tensor([5, 6]), uniform, Arm.parse("3_4_10"))
    assert seen == [[[0], [0]], [[1, 2, 3, 4]] * 2, [[5, 6, 7, 8]] * 2]
    assert tree.parents.tolist() == [[-1, 0, 0, 0, 0, 1, 1, 1, 1, 2]] * 2
    assert tree.depth.tolist() == [[0, 1, 1, 1, 1, 2, 2, 2, 2, 2]] * 2
    # 4_4_12: the 11 kept drafts are the 4 at depth 1 and depth-2 candidates 5-11 (parents 1, 1, 1, 1, 2, 2, 2)
    tree = build_tree(torch.tensor([5]), uniform, Arm.parse("4_4_12"))
    assert tree.parents.tolist() == [[-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e-3])
def test_a_drafter_whose_scores_go_non_finite_or_positive_still_drafts_a_connected_tree(bad):
    """A drafter pushed with weights that pass every check (finite, the right shapes) can still overflow in its
    activations several levels down: NaN log-probs sorted above every real score kept children whose parents were
    dropped, and the AssertionError killed the step and, in a server, the replica on every restart (the audit's
    drafter x10 on arm 8_4_16). Such scores are the worst candidates (NaN) or no better than certain (> 0), and the
    tree stays connected: verification decides what is accepted, so the output stays the target's."""
    def expand(step, beam, toks):
        lp = torch.full((1, beam.shape[1], 16), -10.0)
        lp[..., 5], lp[..., 6] = -0.1, -3.0
        if step == 1:
            lp[0, 1, 7] = bad
        if step == 2:
            lp[0, :, :] = float("nan") if bad != bad else lp[0, :, :]
        return lp

    for arm in ("3_2_6", "4_4_12", "8_4_16"):
        tree = build_tree(torch.tensor([1]), expand, Arm.parse(arm))
        par = tree.parents[0].tolist()
        assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, len(par))), (arm, par)
        assert all(tree.score[0, i] <= tree.score[0, par[i]] for i in range(1, len(par))), (arm, tree.score)
