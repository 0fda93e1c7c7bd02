"""Acceptance functions and target filters against values computed by hand."""

from __future__ import annotations

import math

import torch

from tlt.services.rollout.spec.accept import (
    chain_accept_rejection,
    cut_sampled_chain,
    draw,
    emitted_logprobs,
    node_targets,
    sample_probs,
    tree_accept,
)
from tlt.services.rollout.spec.filters import filter_logits, filtered_probs
from tlt.services.rollout.spec.rng import counter_uniforms, key_tensor

P = torch.tensor([0.5, 0.25, 0.15, 0.1])



def test_filters_by_hand():
    lg = P.log()
    assert filter_logits(lg, 1.0, top_p=0.6).isfinite().tolist() == [True, True, False, False]
    assert filter_logits(lg, 1.0, top_p=0.5).isfinite().tolist() == [True, False, False, False]
    assert filter_logits(lg, 1.0, top_k=3).isfinite().tolist() == [True, True, True, False]
    # a top_k past the vocabulary keeps every token, beside a row that cuts (the sampler's one call per batch)
    assert filter_logits(lg.expand(2, 4), 1.0, torch.tensor([50, 2])).isfinite().sum(-1).tolist() == [4, 2]
    assert filter_logits(lg, 1.0, min_p=0.4).isfinite().tolist() == [True, True, False, False]  # >= 0.2
    q = filtered_probs(lg, 2.0)
    assert torch.allclose(q, P.sqrt() / P.sqrt().sum())
    # top_p after temperature: at T=2 the masses are .35,.25,.19,.16 -> top_p .6 keeps the first two
    q = filtered_probs(lg, 2.0, top_p=0.6)
    assert torch.allclose(q, torch.tensor([0.5**0.5, 0.25**0.5, 0, 0]) / (0.5**0.5 + 0.5))
    # per-row parameters
    rows = filter_logits(lg.expand(2, 4), torch.tensor([1.0, 1.0]), torch.tensor([1, 0]), 1.0, 0.0)
    assert rows.isfinite().sum(-1).tolist() == [1, 4]


def test_top_p_of_one_removes_nothing_whatever_the_other_rows_ask():
    """top_p = 1 disables the filter for its row even in a batch where another row asks top_p < 1. The
    float32 cumsum of a peaked distribution reaches 1.0 before its tail: without the per-row guard
    `before >= 1.0` dropped the tail of the top_p = 1 row (218 of 1,000 tokens here), so the same request
    sampled from a different distribution depending on its batch (plain and speculative steps alike)."""
    lg = torch.zeros(2, 1000)
    lg[:, :2] = 20.0
    rows = filter_logits(lg, 1.0, 0, torch.tensor([1.0, 0.5]))
    assert rows[0].isfinite().all(), f"{int((~rows[0].isfinite()).sum())} tokens removed at top_p = 1"
    assert torch.equal(rows[0].softmax(-1), filter_logits(lg[:1], 1.0, 0, 1.0)[0].softmax(-1))
    assert rows[1].isfinite().sum().item() == 2  # the other row keeps its two head tokens only


def test_a_tiny_positive_temperature_is_the_greedy_limit_not_nan():
    """temperature 1e-40 passes SamplingParams.validate (finite, > 0). logits / 1e-40 overflowed float32 to
    +-inf and softmax gave NaN: torch.multinomial raised in the plain sampler (failing the engine step of
    every request in the batch) and the tree walk drew the last token of the vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 10, generator=g)
    for t in (1e-40, 1e-46, 1e-30):
        q = filtered_probs(logits, t, top_p=0.9, min_p=0.1)
        assert torch.equal(q, torch.nn.functional.one_hot(logits.argmax(-1), 10).float()), t
        nt = node_targets(logits, torch.tensor([t, 1.0]), generator=torch.Generator().manual_seed(1))
        assert nt.tokens[0].tolist() == logits[0].argmax(-1).tolist()
        assert not nt.logprobs.isnan().any()
    tie = torch.tensor([1.0, 3.0, 3.0, -2.0])
    assert filtered_probs(tie, 1e-40).tolist() == [0.0, 0.5, 0.5, 0.0]  # the limit of T -> 0 splits exact ties


def test_sample_probs_inverse_cdf():
    assert sample_probs(P, torch.tensor(0.6)).item() == 1  # cdf .5 .75 .9 1
    assert sample_probs(P, torch.tensor(0.0)).item() == 0
    assert sample_probs(P, torch.tensor(0.95)).item() == 3
    z = torch.tensor([0.0, 0.5, 0.0, 0.5])
    assert sample_probs(z, torch.tensor(0.0)).item() == 1  # never a zero-probability token
    assert sample_probs(z, torch.tensor(0.5)).item() == 3
    assert sample_probs(z, torch.tensor(0.9999999999)).item() == 3


def test_tree_accept_by_hand():
    # tree: 0(root) -> 1 (tok 4), 2 (tok 7); 1 -> 3 (tok 5), 4 (tok 2)
    tokens = torch.tensor([[9, 4, 7, 5, 2]] * 3)
    parents = torch.tensor([[-1, 0, 0, 1, 1]] * 3)
    targets = torch.tensor([
        [7, 1, 3, 9, 9],  # root says 7 -> node 2, a leaf: emit its target 3
        [4, 2, 0, 0, 6],  # root 4 -> node 1, node 1 says 2 -> node 4 (leaf) says 6
        [0, 4, 7, 5, 2],  # root says 0: no child, emit 0
    ])
    res = tree_accept(tokens, parents, targets)
    assert res.accept_len.tolist() == [1, 2, 0]
    assert res.num_emitted.tolist() == [2, 3, 1]
    assert res.tokens.tolist() == [[7, 3, -1], [4, 2, 6], [0, -1, -1]]
    assert res.path.tolist() == [[0, 2, -1], [0, 1, 4], [0, -1, -1]]
    assert [res.emitted(b) for b in range(3)] == [[7, 3], [4, 2, 6], [0]]
    logq = torch.log_softmax(torch.arange(5 * 10, dtype=torch.float).view(1, 5, 10).expand(3, 5, 10) % 7, -1)
    lp = emitted_logprobs(res, logq)
    assert math.isclose(float(lp[1, 2]), float(logq[1, 4, 6])) and math.isclose(float(lp[0, 1]), float(logq[0, 2, 3]))
    assert float(lp[2, 1]) == 0.0


def test_chain_rejection_by_hand():
    p = torch.tensor([[[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]])  # p_0, p_1
    q = torch.tensor([[[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.0, 0.0, 1.0]]])  # q_0, q_1, q_2
    drafts = torch.tensor([[0, 0]])  # draft 0: q/p = .4 ; draft 1: q/p = 1.8 (always accepted)
    # u0 = .3 < .4 accept; draft 1 always accepted; bonus from q_2 -> token 2
    res = chain_accept_rejection(drafts, p, q, u=torch.tensor([[0.3, 0.99, 0.5]]))
    assert res.accept_len.tolist() == [2] and res.tokens.tolist() == [[0, 0, 2]]
    # u0 = .5 > .4 reject; residual max(q0 - p0, 0) = [0, 0, .5] -> token 2 whatever the uniform
    for u_last in (0.0, 0.5, 0.999):
        res = chain_accept_rejection(drafts, p, q, u=torch.tensor([[0.5, 0.0, u_last]]))
        assert res.accept_len.tolist() == [0] and res.tokens.tolist() == [[2]] and res.path.tolist() == [[0]]
    # draft 1 = token 1: q/p = .6; u1 = .7 rejects; residual max(q1 - p1, 0) = [.267, 0, 0] -> token 0
    res = chain_accept_rejection(torch.tensor([[0, 1]]), p, q, u=torch.tensor([[0.1, 0.7, 0.9]]))
    assert res.accept_len.tolist() == [1] and res.tokens.tolist() == [[0, 0]]


def test_cut_sampled_chain_by_hand():
    """The confidence cut of sampled chains: counts, and the distribution r each kept draft was offered from."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]]).expand(2, 2, 3)  # p_1, p_2 for both rows
    drafts = torch.tensor([[0, 1], [2, 0]])
    counts, r = cut_sampled_chain(drafts, p, 0.2)
    # row 0: A_1 = {v: p_1(v) >= .2} = {0, 1} holds x_1 = 0; c_1 = .6, A_2 = {v: .6 p_2(v) >= .2} = {0} lacks x_2 = 1
    # row 1: x_1 = 2 (p .1) is not in A_1: nothing offered
    assert counts.tolist() == [1, 0]
    assert torch.allclose(r[0, 0], torch.tensor([2 / 3, 1 / 3, 0.0]))
    assert torch.allclose(r[0, 1], torch.tensor([1.0, 0.0, 0.0]))  # A_2 of row 0 (past its cut: never read)
    q = torch.tensor([[[0.9, 0.05, 0.05], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]]).expand(2, 3, 3)
    cut = drafts.masked_fill(torch.arange(2)[None] >= counts[:, None], -1)
    # row 0: q/r = .9 / (2/3) > 1 accepts x_1; at its cut nothing is offered, so the last token is drawn from
    # q_1 = [.5, .5, 0] (u .1 -> token 0), not from a residual max(q_1 - r_2, 0) = [0, .5, 0] (always token 1);
    # row 1: a plain draw from q_0 (u .95 -> token 2)
    res = chain_accept_rejection(cut, r, q, u=torch.tensor([[0.99, 0.0, 0.1], [0.0, 0.0, 0.95]]), counts=counts)
    assert res.accept_len.tolist() == [1, 0]
    assert res.tokens.tolist() == [[0, 0], [2, -1]] and res.path.tolist() == [[0, 1], [0, -1]]
    # every row cut before its first draft: a chain of no drafts, each row's token drawn from q_0
    res = chain_accept_rejection(torch.empty(2, 0, dtype=torch.long), r[:, :0], q[:, :1],
                                 u=torch.tensor([[0.1], [0.95]]), counts=torch.zeros(2, dtype=torch.long))
    assert res.accept_len.tolist() == [0, 0] and res.tokens.tolist() == [[0], [2]]


def test_node_targets_greedy_rows_and_per_sequence_uniforms():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 10, generator=g)
    nt = node_targets(logits, torch.tensor([0.0, 1.0, 0.0]))
    assert nt.tokens[0].tolist() == logits[0].argmax(-1).tolist()
    assert nt.tokens[2].tolist() == logits[2].argmax(-1).tolist()
    assert torch.allclose(nt.logprobs[0], logits[0].log_softmax(-1))
    # row b's draws are a function of its own counter uniforms only: the same key gives the same tokens in any
    # batch, and each node's token is plain sampling's `draw` with the same uniform
    keys, pos = key_tensor([11, 12, 13]), torch.arange(4).expand(3, 4) + 7
    a = node_targets(logits, 1.0, u=counter_uniforms(keys, pos)).tokens
    alone = node_targets(logits[1:2], 1.0, u=counter_uniforms(keys[1:2], pos[1:2])).tokens
    assert a[1].tolist() == alone[0].tolist()
    assert a.tolist() == draw(filter_logits(logits, 1.0), counter_uniforms(keys, pos)).tolist()
    # filtered-out tokens are never drawn
    many = node_targets(logits[:1].expand(2000, 4, 10), 0.7, top_k=2, generator=g).tokens
    top2 = logits[0].topk(2, -1).indices
    assert ((many[..., None] == top2[None]).any(-1)).all()


def test_walk_agrees_with_the_kernel_reference_on_random_trees():
    from tlt.kernels.tree_accept import tree_accept_ref

    from tlt.services.rollout.spec.tree import Arm, build_tree

    g = torch.Generator().manual_seed(1)
    v = 6
    table = torch.randn(v, v, generator=g).log_softmax(-1)
    for arm in ("4_2_8", "3_3_12", "5_1_6"):
        tree = build_tree(torch.randint(0, v, (64,), generator=g), lambda s, beam, tok: table[tok], Arm.parse(arm))
        targets = torch.randint(0, v, tree.tokens.shape, generator=g)
        ours = tree_accept(tree.tokens, tree.parents, targets)
        ref = tree_accept_ref(tree.tokens, tree.parents, targets)
        assert ours.accept_len.tolist() == ref.accept_len.tolist()
        assert ours.path.tolist() == ref.path[:, : ours.path.shape[1]].tolist()
        assert ours.tokens[torch.arange(64), ours.accept_len].tolist() == ref.bonus.tolist()
        assert (ours.accept_len > 0).any()


def _walk(tokens: list[int], parents: list[int], targets: list[int]) -> tuple[list[int], list[int]]:
    """The tree walk of the module docstring, one python step at a time: (emitted tokens, path)."""
    node, out, path = 0, [], [0]
    while True:
        kids = [i for i, p in enumerate(parents) if p == node and tokens[i] == targets[node]]
        out.append(targets[node])
        if not kids:
            return out, path
        node = kids[0]
        path.append(node)


def test_chains_take_the_vectorised_path_and_agree_with_the_walk():
    g = torch.Generator().manual_seed(5)
    for n in (2, 5, 9):
        b = 64
        tokens = torch.randint(0, 3, (b, n), generator=g)  # a small vocabulary: long accepted runs happen
        targets = torch.randint(0, 3, (b, n), generator=g)
        parents = (torch.arange(n) - 1).expand(b, n)
        res = tree_accept(tokens, parents, targets)
        for r in range(b):
            want, path = _walk(tokens[r].tolist(), parents[r].tolist(), targets[r].tolist())
            assert res.emitted(r) == want
            assert res.path[r, : len(path)].tolist() == path and (res.path[r, len(path):] == -1).all()
        assert int(res.accept_len.max()) == n - 1 or n > 5  # fully accepted chains occur (the bonus-at-leaf case)
        assert n == 2 or int(res.accept_len.max()) > 1  # runs longer than one, where a prefix rule could go wrong


def test_greedy_node_targets_skip_the_filters_but_give_the_same_answer():
    logits = torch.randn(3, 4, 11)
    fast = node_targets(logits, 0.0, top_k=2, top_p=0.5)
    mixed = node_targets(logits, torch.tensor([0.0, 0.0, 1.0]), generator=torch.Generator().manual_seed(0))
    assert fast.tokens.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(fast.logprobs, logits.log_softmax(-1))
    assert fast.tokens[:2].tolist() == mixed.tokens[:2].tolist()
    assert torch.allclose(fast.logprobs[:2], mixed.logprobs[:2])


def test_sample_probs_past_the_end_falls_back_to_the_last_token_with_mass_not_the_last_token():
    # u * total at the very end of the cdf (u = 1.0, the rounding case the fallback exists for) with trailing
    # zero-probability tokens: the draw must be token 1, the last one with mass, never 2 or 3 (probability 0)
    z = torch.tensor([0.5, 0.5, 0.0, 0.0])
    assert sample_probs(z, torch.tensor(1.0)).item() == 1
    rows = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0]])
    assert sample_probs(rows, torch.tensor([1.0, 1.0])).tolist() == [1, 3]


def test_greedy_rows_keep_the_raw_softmax_beside_filtered_sampled_rows():
    # NodeTargets.logprobs: greedy rows get the raw softmax whatever filters the batch carries (what the all-greedy
    # fast path and plain decoding report); only the sampled row's distribution is filtered (top_k = 2 here)
    logits = torch.tensor([[[3.0, 1.0, 0.0, -1.0]], [[0.0, 2.0, 1.0, -3.0]]])
    nt = node_targets(logits, torch.tensor([0.0, 1.0]), top_k=2, u=torch.tensor([[0.5], [0.5]]))
    raw0 = logits[0].log_softmax(-1)
    assert torch.allclose(nt.logprobs[0], raw0) and torch.isfinite(nt.logprobs[0]).all()
    # sampled row: top-2 of [0, 2, 1, -3] keeps tokens 1 and 2: log q = [-inf, 2 - log(e^2 + e), 1 - log(e^2 + e), -inf]
    lse = math.log(math.exp(2.0) + math.exp(1.0))
    assert nt.logprobs[1, 0, 0].item() == float("-inf") and nt.logprobs[1, 0, 3].item() == float("-inf")
    assert math.isclose(nt.logprobs[1, 0, 1].item(), 2.0 - lse, rel_tol=1e-6)
    assert math.isclose(nt.logprobs[1, 0, 2].item(), 1.0 - lse, rel_tol=1e-6)
    assert nt.tokens.tolist() == [[0], [1]]  # argmax; u = .5 < q(1) = .731 -> token 1


def test_chain_rejection_rejects_a_draft_the_target_rules_out_even_at_u_zero():
    # Counter uniforms are multiples of 2**-24 from 0 (rng.py): u = 0 happens. A draft with q(x) = 0 must still be
    # rejected (accept iff u * p(x) < q(x), strict), or the chain emits a token the target gives probability 0.
    p = torch.tensor([[[0.5, 0.5, 0.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    res = chain_accept_rejection(torch.tensor([[1]]), p, q, u=torch.tensor([[0.0, 0.0]]))
    # rejected; residual max(q0 - p0, 0) = [.5, 0, 0] -> token 0
    assert res.accept_len.tolist() == [0] and res.tokens.tolist() == [[0]] and res.path.tolist() == [[0]]
    # the same draft with q(x) > 0 and u = 0 is accepted (u * p < q), then the bonus comes from q_1 -> token 2
    q_ok = torch.tensor([[[0.9, 0.1, 0.0], [0.0, 0.0, 1.0]]])
    res = chain_accept_rejection(torch.tensor([[1]]), p, q_ok, u=torch.tensor([[0.0, 0.0]]))
    assert res.accept_len.tolist() == [1] and res.tokens.tolist() == [[1, 2]]


def test_min_p_keeps_tokens_exactly_at_the_threshold():
    # min_p removes tokens with p < min_p * p_max (strictly): at min_p = 1 (allowed: [0, 1]) the most likely token,
    # and any exact tie with it, stay; removing them too would leave no token (a NaN distribution)
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.0, 5.0, 1.0, 2.0]])
    q = filtered_probs(logits, 1.0, min_p=1.0)
    assert q.tolist() == [[0.0, 0.5, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0]]
    nt = node_targets(logits[:, None], 0.7, min_p=1.0, u=torch.tensor([[0.9], [0.3]]))
    assert nt.tokens.tolist() == [[2], [1]]


def test_min_p_cuts_the_tempered_distribution_as_vllm_and_transformers_do():
    # min_p compares probabilities AFTER temperature (vLLM's sampler and transformers' warpers apply it to the
    # tempered softmax), the order of the module docstring: logit gaps 1 and 2 from the best token are probability
    # ratios e^-2 and e^-4 at T = 0.5, both under min_p = 0.3, but e^-0.5 and e^-1 at T = 2, both over it. On the
    # untempered softmax (ratios e^-1, e^-2) both temperatures would keep the same two tokens.
    logits = torch.tensor([0.0, -1.0, -2.0])
    assert filter_logits(logits, 0.5, min_p=0.3).isfinite().tolist() == [True, False, False]
    assert filter_logits(logits, 2.0, min_p=0.3).isfinite().tolist() == [True, True, True]
    q = filtered_probs(logits, 2.0, min_p=0.3)
    assert torch.allclose(q, (logits / 2).softmax(-1))


def test_filters_cut_a_row_whose_logits_are_not_in_order():
    """The by-hand cases above are rows already sorted, so a top_p that summed the row's masses in vocabulary order
    (not the sorted order it walks) passed them. A model's logits are in no order: top_p, top_k and min_p keep the
    same tokens of a shuffled row as of the sorted one, checked against a plain-Python reference on random rows."""
    lg = P.log()[torch.tensor([3, 0, 2, 1])]  # masses .1 .5 .15 .25
    assert filter_logits(lg, 1.0, top_p=0.5).isfinite().tolist() == [False, True, False, False]
    assert filter_logits(lg, 1.0, top_p=0.6).isfinite().tolist() == [False, True, False, True]
    assert filter_logits(lg, 1.0, top_p=0.8).isfinite().tolist() == [False, True, True, True]
    assert filter_logits(lg, 1.0, top_k=2).isfinite().tolist() == [False, True, False, True]
    assert filter_logits(lg, 1.0, min_p=0.4).isfinite().tolist() == [False, True, False, True]
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        row = torch.randn(12, generator=g) * 2
        top_p = float(torch.rand((), generator=g))
        probs = row.softmax(-1).tolist()
        order = sorted(range(12), key=lambda i: -probs[i])
        keep, mass = set(), 0.0
        for i in order:  # the smallest prefix, in sorted order, whose mass reaches top_p
            keep.add(i)
            mass += probs[i]
            if mass >= top_p:
                break
        got = filter_logits(row, 1.0, top_p=top_p).isfinite()
        assert {i for i in range(12) if got[i]} == keep, (row.tolist(), top_p)
