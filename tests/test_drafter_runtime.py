"""DrafterRuntime (the rollout engine's fused, scripted drafter path) against `Drafter.forward` (the
nn.Module the drafter service trains): the same h' for cached decoding with rows of different lengths,
multi-token appends, tree and prefix masks; new weights are picked up by `refresh()`. Also the cache
mask both share, against a mask written out by hand. Tiny random drafters built in code."""

from __future__ import annotations

import pytest
import torch

from tiny_drafter import H, V, random_drafter

from tlt.model.drafter import Drafter, DrafterCache
from tlt.model.drafter_runtime import DrafterRuntime, _draft_probs

_draft_probs_fn = torch.jit.script(_draft_probs)


def _both(d: Drafter, rows: int = 3):
    return (DrafterCache(d.cfg, rows=rows, capacity=4), DrafterCache(d.cfg, rows=rows, capacity=4))


@torch.inference_mode()
def test_runtime_equals_the_module_for_cached_appends_of_uneven_rows():
    d = random_drafter()
    rt = DrafterRuntime(d)
    c_mod, c_rt = _both(d)
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([2, 0])
    # prefill rows of different lengths (row 2 gets 5 pairs, row 0 gets 2), then decode and 3-token appends
    for r, n in ((2, 5), (0, 2)):
        ids, f = torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, H, generator=g)
        pos = torch.arange(1, n + 1)[None]
        a = d(ids, f, pos, cache=c_mod, cache_rows=torch.tensor([r]))
        b = rt(ids, f, pos, c_rt, torch.tensor([r]))
        assert torch.allclose(a, b, atol=1e-5)
    for t in (1, 3, 1):
        ids, f = torch.randint(0, V, (2, t), generator=g), torch.randn(2, t, H, generator=g)
        pos = c_mod.lengths[rows][:, None] + 1 + torch.arange(t)[None]
        a = d(ids, f, pos, cache=c_mod, cache_rows=rows)
        b = rt(ids, f, pos, c_rt, rows)
        assert torch.allclose(a, b, atol=1e-5), t
    assert c_mod.lengths.tolist() == c_rt.lengths.tolist() == [7, 0, 10]
    assert torch.allclose(c_mod.k[:, :, :10], c_rt.k[:, :, :10], atol=1e-5)


@torch.inference_mode()
def test_runtime_equals_the_module_with_tree_and_prefix_masks():
    d = random_drafter(1)
    rt = DrafterRuntime(d)
    c_mod, c_rt = _both(d, rows=2)
    g = torch.Generator().manual_seed(1)
    rows = torch.tensor([0, 1])
    ids, f = torch.randint(0, V, (2, 6), generator=g), torch.randn(2, 6, H, generator=g)
    pos = torch.arange(6).expand(2, 6)
    d(ids, f, pos, cache=c_mod, cache_rows=rows)
    rt(ids, f, pos, c_rt, rows)
    # 3 tree nodes: 0 -> 1, 0 -> 2 (siblings must not see each other); the prefix mask hides cached keys 2 and 4
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
    prefix = torch.ones(2, 3, 6, dtype=torch.bool)
    prefix[:, :, 2] = False
    prefix[1, :, 4] = False
    ids, f = torch.randint(0, V, (2, 3), generator=g), torch.randn(2, 3, H, generator=g)
    pos = torch.tensor([[6, 7, 7], [6, 7, 7]])
    a = d(ids, f, pos, cache=c_mod, cache_rows=rows, tree_mask=tree, prefix_mask=prefix)
    b = rt(ids, f, pos, c_rt, rows, tree_mask=tree, prefix_mask=prefix)
    assert torch.allclose(a, b, atol=1e-5)


@torch.inference_mode()
def test_refresh_picks_up_new_weights():
    d, other = random_drafter(2), random_drafter(3)
    rt = DrafterRuntime(d)
    ids, f, pos = torch.randint(0, V, (1, 4)), torch.randn(1, 4, H), torch.arange(4)[None]
    before = rt(ids, f, pos, DrafterCache(d.cfg, rows=1, capacity=4), torch.tensor([0]))
    d.load_tensors({k: v.clone() for k, v in other.state_dict().items()})  # the engine's drafter hot-swap
    rt.refresh()
    c_mod, c_rt = _both(d)
    after = rt(ids, f, pos, c_rt, torch.tensor([0]))
    assert torch.allclose(d(ids, f, pos, cache=c_mod, cache_rows=torch.tensor([0])), after, atol=1e-5)
    assert not torch.allclose(before, after, atol=1e-3)


def test_cache_mask_against_a_hand_written_one():
    # row 0: 2 cached keys, row 1: 4; two new tokens each (causal among themselves); span 6
    m = Drafter.cache_mask(torch.tensor([2, 4]), 2, 6)
    want = [
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]],
        [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]],
    ]
    assert m.int().tolist() == want
    # a prefix mask hides cached key 1 from row 0's second token; a tree mask hides new token 0 from new token 1
    pm = torch.ones(2, 2, 4, dtype=torch.bool)
    pm[0, 1, 1] = False
    tm = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool).expand(2, 2, 2)
    m = Drafter.cache_mask(torch.tensor([2, 4]), 2, 6, tm, pm)
    assert m.int().tolist() == [
        [[1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0]],
        [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]],
    ]
    # one new token per row, equal lengths, no prefix mask: every key visible, no mask needed
    assert Drafter.cache_mask(torch.tensor([3, 3]), 1, 4) is None
    assert Drafter.cache_mask(torch.tensor([3, 2]), 1, 4).int().tolist() == [[[1, 1, 1, 1]], [[1, 1, 1, 0]]]
    # a prefix mask hides only the cached keys it covers (j < P): keys at or past P stay visible, and a single
    # new token with a prefix mask still needs the mask though every row is equally long
    pm = torch.tensor([[[True, False]]])
    assert Drafter.cache_mask(torch.tensor([4]), 1, 5, prefix_mask=pm).int().tolist() == [[[1, 0, 1, 1, 1]]]


@torch.inference_mode()
def test_right_padded_appends_equal_separate_ones():
    """EagleSource feeds several rows' pending pairs in one call, right-padded (new_lengths): each row's
    real outputs, cached K/V and new length equal feeding it alone."""
    d = random_drafter(4)
    rt = DrafterRuntime(d)
    c_one, c_pad = _both(d)
    g = torch.Generator().manual_seed(4)
    pre = {0: 3, 2: 6}
    for r, n in pre.items():
        ids, f = torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, H, generator=g)
        for c in (c_one, c_pad):
            rt(ids, f, torch.arange(n)[None], c, torch.tensor([r]))
    n_new = [2, 5]
    ids, f = torch.randint(0, V, (2, 5), generator=g), torch.randn(2, 5, H, generator=g)
    pos = torch.tensor([[3, 4, 5, 6, 7], [6, 7, 8, 9, 10]])
    padded = rt(ids, f, pos, c_pad, torch.tensor([0, 2]), new_lengths=torch.tensor(n_new))
    for b, (r, n) in enumerate(zip((0, 2), n_new)):
        alone = rt(ids[b : b + 1, :n], f[b : b + 1, :n], pos[b : b + 1, :n], c_one, torch.tensor([r]))
        assert torch.allclose(padded[b, :n], alone[0], atol=1e-5)
    assert c_pad.lengths.tolist() == c_one.lengths.tolist() == [5, 0, 11]
    for r, n in ((0, 5), (2, 11)):
        assert torch.allclose(c_pad.k[r, :, :n], c_one.k[r, :, :n], atol=1e-5)


@torch.inference_mode()
def test_sampled_chain_draws_from_the_filtered_drafter_distribution():
    """chain(params=, u=): level 0's p is the drafter's softmax under each row's filters, the same as
    spec/filters.py gives (temperature, top_k, top_p, min_p); every draft is the inverse-CDF draw of its
    u from the returned p, never a token of probability 0; scores are the drafts' cumulative log p."""
    from tlt.services.rollout.spec.accept import sample_probs
    from tlt.services.rollout.spec.filters import filtered_probs

    d = random_drafter(4)
    rt = DrafterRuntime(d)
    cache = DrafterCache(d.cfg, rows=3, capacity=8)
    g = torch.Generator().manual_seed(1)
    rows = torch.tensor([0, 1, 2])
    rt(torch.randint(0, V, (3, 5), generator=g), torch.randn(3, 5, H, generator=g),
       torch.arange(1, 6).expand(3, 5), cache, rows)
    h = torch.randn(3, H, generator=g)
    params = torch.tensor([[1.0, 0, 1.0, 0.0], [0.7, 5, 0.9, 0.0], [1.3, 0, 0.8, 0.05]])
    u = torch.rand(3, 4, generator=g)
    toks, scores, probs = rt.chain(h, cache, rows, torch.full((3,), 5), 4, params=params, u=u)
    assert toks.shape == (3, 4) and probs.shape == (3, 4, V)
    want = torch.stack([filtered_probs(d.compute_logits(h[i]), *params[i].tolist()) for i in range(3)])
    torch.testing.assert_close(probs[:, 0], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(toks, sample_probs(probs, u))
    picked = probs.gather(2, toks[..., None])[..., 0]
    assert (picked > 0).all()
    torch.testing.assert_close(scores, picked.log().cumsum(1), rtol=1e-5, atol=1e-5)
    assert int((probs[1] > 0).sum(-1).max()) <= 5  # top_k 5
    greedy_toks, _, none = rt.chain(h, cache, rows, torch.full((3,), 5), 4)
    assert none is None and greedy_toks.shape == (3, 4)


@torch.inference_mode()
@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_unfiltered_rows_draw_the_same_p_whatever_their_neighbours(min_p):
    """A batch where no row has top_k or top_p skips those filters (the common RL case: a temperature, nothing
    else). The p a row draws from must be bitwise what it is beside a row that does filter (then the whole batch
    takes the filtered path), at the same batch size (the drafter's linears switch kernels with the row count):
    else a sequence's drafts would depend on its neighbours' sampling parameters."""
    from tlt.services.rollout.spec.filters import filtered_probs

    d = random_drafter(4)
    rt = DrafterRuntime(d)
    g = torch.Generator().manual_seed(2)
    ids, feats = torch.randint(0, V, (3, 5), generator=g), torch.randn(3, 5, H, generator=g)
    h = torch.randn(3, H, generator=g)
    u = torch.rand(3, 4, generator=g)
    rows = torch.tensor([0, 1, 2])
    plain = torch.tensor([[1.0, 0, 1.0, min_p], [0.6, 0, 1.0, min_p], [1.2, 0, 1.0, 0.0]])
    mixed = plain.clone()
    mixed[2] = torch.tensor([1.0, 7, 0.9, 0.0])  # the third row with top_k and top_p

    def chain(params):
        cache = DrafterCache(d.cfg, rows=3, capacity=8)
        rt(ids, feats, torch.arange(1, 6).expand(3, 5), cache, rows)
        return rt.chain(h, cache, rows, torch.full((3,), 5), 4, params=params, u=u)

    toks, scores, probs = chain(plain)
    toks_m, scores_m, probs_m = chain(mixed)
    assert torch.equal(probs[:2], probs_m[:2]) and torch.equal(toks[:2], toks_m[:2])
    assert torch.equal(scores[:2], scores_m[:2])
    want = torch.stack([filtered_probs(d.compute_logits(h[i]), *plain[i].tolist()) for i in range(3)])
    torch.testing.assert_close(probs[:, 0], want, rtol=1e-5, atol=1e-6)
    assert (probs_m[2, 0] > 0).sum() <= 7  # the neighbour was filtered
    # the fast path itself against the filtered one, row by row (chain_draft takes it when no row filters)
    logits = torch.randn(3, V, generator=g) * 4
    fast = _draft_probs(logits, plain, False, min_p > 0)
    assert torch.equal(fast, _draft_probs(logits, plain, True, True))
    assert torch.equal(fast, _draft_probs_fn(logits, plain, False, min_p > 0))  # the scripted build, as chain_draft's


@torch.inference_mode()
def test_draft_min_p_is_relative_to_the_top_probability_like_the_targets():
    """The drafter's p cuts min_p as spec/filters.py cuts q: p < min_p * p_max, not p < min_p. Four tokens at
    ~0.23 and one at ~0.085: min_p 0.1 keeps the fifth (0.085 >= 0.023); an absolute cut would drop it, drafting
    from another support than the target's (only more rejections, but the drafts' p is meant to be q's shape)."""
    from tlt.services.rollout.spec.filters import filtered_probs

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -1.0, -5.0]])
    p = _draft_probs(logits, torch.tensor([[1.0, 0, 1.0, 0.1]]))
    assert (p > 0).sum().item() == 5
    torch.testing.assert_close(p, filtered_probs(logits, 1.0, 0, 1.0, 0.1), rtol=1e-6, atol=1e-7)


@torch.inference_mode()
def test_a_chain_stops_only_once_every_row_is_below_min_score():
    """chain(min_score=) drafts on while any row's cumulative log-prob is at least min_score: a threshold between
    the two rows' first scores keeps drafting past the first level (the better row may still be accepted)."""
    d = random_drafter(5)
    rt = DrafterRuntime(d)
    g = torch.Generator().manual_seed(3)
    rows = torch.tensor([0, 1])

    def chain(min_score):
        cache = DrafterCache(d.cfg, rows=2, capacity=8)
        rt(torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(4)),
           torch.randn(2, 4, H, generator=torch.Generator().manual_seed(5)), torch.arange(1, 5).expand(2, 4), cache, rows)
        return rt.chain(h, cache, rows, torch.full((2,), 4), 4, min_score=min_score)

    h = torch.randn(2, H, generator=g)
    _, scores, _ = chain(float("-inf"))
    assert scores.shape == (2, 4) and scores[0, 0] != scores[1, 0]
    hi, lo = scores[:, 0].max().item(), scores[:, 0].min().item()
    toks, _, _ = chain((hi + lo) / 2)
    assert toks.shape[1] >= 2  # one row still above the threshold after the first draft
    toks, _, _ = chain(hi + 1.0)
    assert toks.shape[1] == 1  # every row below it: no deeper draft
