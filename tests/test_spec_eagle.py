"""EAGLE tree drafting (drafting.EagleSource) against an independent reference: every drafted node's
cumulative score must equal the log-probabilities obtained by running the drafter from scratch over
the verified pairs plus the node's own path (so the drafter KV rows, the ancestor-only prefix masks,
the parent features and the positions are all right), and the drafter rows roll back afterwards."""

from __future__ import annotations

import torch

from tlt.model.drafter import Drafter, DrafterConfig
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.spec.drafting import EagleSource
from tlt.services.rollout.spec.tree import Arm
from tlt.services.rollout.types import SamplingParams

H, V = 32, 40


def _drafter() -> Drafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=V)
    d = Drafter(cfg, torch.randn(V, H), torch.randn(V, H))
    for p in d.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    return d.eval()


def _seq(rid: str, prompt: list[int], out: list[int]) -> Sequence:
    s = Sequence(rid, 0, tuple(prompt), SamplingParams(temperature=0.0), 100, 0, frozenset())
    s.token_ids.extend(out)
    return s


@torch.no_grad()
def _reference_scores(d: Drafter, toks: list[int], feats: torch.Tensor, first: int, tree, b: int) -> list[float]:
    """Score of every node of tree b by re-running the drafter over pairs + the node's path."""
    kids_parent = tree.parents[b].tolist()
    tokens = tree.tokens[b].tolist()
    scores = []
    for node in range(tree.num_nodes):
        path = []
        while node > 0:
            path.append(node)
            node = kids_parent[node]
        path.reverse()
        ids, fs = list(toks), [f for f in feats]
        total = 0.0
        for depth in range(len(path) + 1):
            out = d(torch.tensor([ids]), torch.stack(fs)[None], torch.arange(first, first + len(ids))[None])
            h = out[0, -1]
            if depth == len(path):
                break
            tok = tokens[path[depth]]
            total += float(d.compute_logits(h).log_softmax(-1)[tok])
            ids.append(tok)
            fs.append(h)
        scores.append(total)
    return scores


def test_tree_scores_match_a_from_scratch_reference():
    d = _drafter()
    src = EagleSource(d, capacity=4)
    g = torch.Generator().manual_seed(1)
    seqs, pairs = [], []
    for i, (plen, olen) in enumerate([(5, 6), (3, 9)]):
        prompt = torch.randint(0, V, (plen,), generator=g).tolist()
        out = torch.randint(0, V, (olen,), generator=g).tolist()
        s = _seq(f"r{i}", prompt, out)
        feats = torch.randn(olen, H, generator=g)
        # pairs (output token k, feature that produced it) at the output token positions
        src.observe([s], [out], [list(feats)], [plen])
        seqs.append(s)
        pairs.append((out, feats, plen))
    for arm in (Arm(3, 2, 6), Arm(2, 3, 9), Arm(4, 2, 9), Arm(1, 4, 5), Arm(4, 1, 5), Arm(6, 1, 4)):
        tree, counts = src.draft(seqs, arm)
        assert counts.tolist() == [arm.draft_tokens] * 2
        for b, (toks, feats, first) in enumerate(pairs):
            ref = _reference_scores(d, toks, feats, first, tree, b)
            assert torch.allclose(tree.score[b], torch.tensor(ref), atol=1e-4), (arm, b)
        # only the verified pairs stay in the drafter rows
        assert [int(src.cache.lengths[src.rows[("r0", 0)]]), int(src.cache.lengths[src.rows[("r1", 0)]])] == [6, 9]
    assert src.cold_starts == 0


def test_a_gap_in_the_pairs_restarts_cold():
    d = _drafter()
    src = EagleSource(d)
    s = _seq("r", [1, 2, 3], [4, 5])
    src.observe([s], [[4]], [[torch.randn(H)]], [3])  # only the pair at position 3; position 4 missing
    tree, counts = src.draft([s], Arm(2, 2, 4))
    assert counts.tolist() == [1] and tree.tokens.tolist() == [[5]]  # root only: one plain verify
    assert src.cold_starts == 1


def test_chain_drafting_keeps_what_tree_drafting_keeps():
    """topk = 1 takes EagleSource's chain path (no tree bookkeeping, only the levels that are kept):
    the same tokens, parents, depths and scores as the general EAGLE-2 tree path."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(3)
    seqs = []
    for i, (plen, olen) in enumerate([(4, 7), (6, 3), (2, 5)]):
        s = _seq(f"c{i}", torch.randint(0, V, (plen,), generator=g).tolist(), torch.randint(0, V, (olen,), generator=g).tolist())
        src.observe([s], [s.token_ids[plen:]], [list(torch.randn(olen, H, generator=g))], [plen])
        seqs.append(s)
    for arm in (Arm(5, 1, 6), Arm(8, 1, 4), Arm(1, 1, 2)):
        chain, _ = src.draft(seqs, arm)  # the chain path
        tree = src._tree(seqs, arm)  # the general path on the same (rolled back) drafter rows
        assert chain.tokens.tolist() == tree.tokens.tolist(), arm
        assert chain.parents.tolist() == tree.parents.tolist() and chain.depth.tolist() == tree.depth.tolist()
        assert torch.allclose(chain.score, tree.score, atol=1e-5)


def test_a_gap_after_warm_pairs_restarts_the_row_from_the_new_pairs():
    """A warm row whose next pending pairs do not follow its last fed one (pairs were lost) is rebuilt from
    those pairs alone: the drafts then equal a from-scratch run over them, and the row holds only them."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(5)
    s = _seq("r", [1, 2, 3], [4, 5, 6])
    src.observe([s], [[4, 5, 6]], [list(torch.randn(3, H, generator=g))], [3])
    src.draft([s], Arm(2, 2, 4))  # warm: pairs at positions 3..5 fed
    s.token_ids.extend([7, 8, 9])
    feats = torch.randn(2, H, generator=g)
    src.observe([s], [[8, 9]], [list(feats)], [7])  # the pair at position 6 never arrives
    tree, counts = src.draft([s], Arm(2, 2, 4))
    assert counts.tolist() == [4] and src.cold_starts == 0  # warm again: the new pairs reach the last token
    ref = _reference_scores(d, [8, 9], feats, 7, tree, 0)
    assert torch.allclose(tree.score[0], torch.tensor(ref), atol=1e-4)
    assert int(src.cache.lengths[src.rows[("r", 0)]]) == 2


def test_chain_confidence_cut_keeps_a_draft_whose_probability_is_exactly_the_floor():
    """chain_min_prob keeps the drafts whose cumulative probability is AT LEAST the floor."""
    import math

    d = _drafter()
    g = torch.Generator().manual_seed(3)
    prompt, out = torch.randint(0, V, (4,), generator=g).tolist(), torch.randint(0, V, (7,), generator=g).tolist()
    feats = list(torch.randn(7, H, generator=g))

    def draft(**kw):
        src = EagleSource(d, **kw)
        s = _seq("c", prompt, out)
        src.observe([s], [out], [feats], [4])
        return src.draft([s], Arm(4, 1, 5))

    full, counts = draft()
    assert counts.tolist() == [5]
    floor = float(full.score[0, 2])  # cumulative log-probability of the second draft
    cut, counts = draft(chain_min_prob=math.exp(floor))
    assert counts.tolist() == [3]  # root + the first two drafts
    assert cut.tokens[0, :3].tolist() == full.tokens[0, :3].tolist()


def test_max_pending_keeps_the_newest_pairs_and_the_row_starts_from_them():
    d = _drafter()
    src = EagleSource(d, max_pending=3)
    g = torch.Generator().manual_seed(6)
    s = _seq("r", [1, 2, 3], [4, 5, 6, 7, 8])
    feats = torch.randn(5, H, generator=g)
    src.observe([s], [[4, 5, 6, 7, 8]], [list(feats)], [3])  # pairs at positions 3..7; only 5..7 are kept
    tree, counts = src.draft([s], Arm(2, 2, 4))
    assert counts.tolist() == [4] and int(src.cache.lengths[src.rows[("r", 0)]]) == 3
    ref = _reference_scores(d, [6, 7, 8], feats[2:], 5, tree, 0)
    assert torch.allclose(tree.score[0], torch.tensor(ref), atol=1e-4)


def test_pairs_observed_after_a_gap_replace_the_pending_ones():
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(7)
    s = _seq("r", [1, 2, 3], [4, 5, 6, 7, 8])
    src.observe([s], [[4]], [[torch.randn(H, generator=g)]], [3])
    feats = torch.randn(2, H, generator=g)
    src.observe([s], [[7, 8]], [list(feats)], [6])  # positions 4, 5 never observed: not contiguous
    tree, counts = src.draft([s], Arm(2, 2, 4))
    assert counts.tolist() == [4] and src.cold_starts == 0  # the new pairs reach the last token: warm
    ref = _reference_scores(d, [7, 8], feats, 6, tree, 0)
    assert torch.allclose(tree.score[0], torch.tensor(ref), atol=1e-4)
    assert int(src.cache.lengths[src.rows[("r", 0)]]) == 2


def test_a_released_row_is_reused_from_empty():
    """Released sequences give their drafter rows back (nine sequences one after another fit in the 8 rows), and
    a reused row starts empty: the new sequence's drafts equal a from-scratch run over its own pairs."""
    d = _drafter()
    src = EagleSource(d)
    g = torch.Generator().manual_seed(8)
    for i in range(9):
        s = _seq(f"r{i}", [1, 2, 3], [4 + i, 5, 6])
        feats = torch.randn(3, H, generator=g)
        src.observe([s], [s.token_ids[3:]], [list(feats)], [3])
        tree, counts = src.draft([s], Arm(2, 2, 4))
        assert counts.tolist() == [4] and int(src.cache.lengths[src.rows[(f"r{i}", 0)]]) == 3
        ref = _reference_scores(d, s.token_ids[3:], feats, 3, tree, 0)
        assert torch.allclose(tree.score[0], torch.tensor(ref), atol=1e-4), i
        src.release(s)
    assert src.cache.k.shape[0] == 8 and not src.rows


def test_a_sampled_chain_is_drafted_the_same_beside_a_cold_or_greedy_row():
    """sample (rejection-sampled chains) is per row: a warm sampling row gets its sampled chain and its p whatever
    its neighbours are. It used to apply only when every row sampled and was warm; one cold or greedy neighbour
    turned the whole batch to deterministic drafts (and the decoder to the tree walk), so a seeded request's
    tokens depended on the batch."""
    g = torch.Generator().manual_seed(7)
    sampling = SamplingParams(temperature=0.9, top_k=30, seed=11)

    def seq(rid, params, short=False):
        s = Sequence(rid, 0, (1, 2, 3), params, 100, 5, frozenset())
        s.token_ids.extend(torch.randint(0, V, (6,), generator=g).tolist())
        out = s.token_ids[3:-1] if short else s.token_ids[3:]  # short: no pair for the last token, the row is cold
        return s, (out, list(torch.randn(len(out), H, generator=g)), 3)

    warm, warm_pairs = seq("w", sampling)
    cold, cold_pairs = seq("c", sampling, short=True)
    greedy, greedy_pairs = seq("g", SamplingParams(temperature=0.0))
    arm = Arm(4, 1, 5)

    def draft(rows):
        src = EagleSource(_drafter())
        for s, (toks, feats, first) in rows:
            src.observe([s], [toks], [feats], [first])
        return src.draft([s for s, _ in rows], arm, sample=[s.params.temperature > 0 for s, _ in rows])

    alone, _ = draft([(warm, warm_pairs)])
    assert alone.sampled.tolist() == [True] and alone.draft_probs.shape == (1, 4, V)
    for others in ([(cold, cold_pairs)], [(greedy, greedy_pairs)], [(greedy, greedy_pairs), (cold, cold_pairs)]):
        mixed, counts = draft([(warm, warm_pairs), *others])
        assert mixed.sampled.tolist() == [True] + [False] * len(others)
        assert mixed.tokens[0].tolist() == alone.tokens[0].tolist() and counts[0] == 5
        assert torch.equal(mixed.draft_probs[0], alone.draft_probs[0])
        assert (mixed.draft_probs[1:] == 0).all()
