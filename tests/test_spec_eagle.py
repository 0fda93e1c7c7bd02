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
