"""Mutation audit of ChainGraphs (tlt/model/drafter_graphs.py): what tests/test_drafter_graphs.py left unpinned.

Each test names the mutants (G-n, from the audit's log) it kills. Nothing is faked: the real ChainGraphs in its
"emulate" mode, the real DrafterRuntime, DrafterCache and EagleSource on tiny random drafters built in code (the
same helpers as tests/test_drafter_graphs.py). Emulated graphs run the padded static call eagerly, so what they
expose is which graphs are kept, dropped and captured (`captures`, `graphs`), the constructor's checks, the
`need` bounds and the padding rows' cache row. The "cuda" mode (capture, replay, the private memory pool) is
GPU-only: tests/test_engine_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from test_drafter_graphs import _filled_cache
from tiny_drafter import H, V, random_drafter

from tlt.model.drafter import DrafterCache
from tlt.model.drafter_graphs import ChainGraphs
from tlt.model.drafter_runtime import DrafterRuntime


def _graphs(buckets: tuple[int, ...] = (1, 2), lengths: dict[int, int] | None = None, rows: int = 4,
            scratch: int = 0) -> tuple[DrafterRuntime, DrafterCache, ChainGraphs]:
    rt = DrafterRuntime(random_drafter())
    cache = _filled_cache(rt, rows, {1: 3} if lengths is None else lengths, seed=0)
    return rt, cache, ChainGraphs(rt, cache, scratch_row=scratch, buckets=buckets, mode="emulate")


_ARGS = (torch.zeros(1, H), torch.tensor([1]), torch.tensor([3]), 4)  # one greedy chain from row 1


def test_the_constructor_refuses_bad_modes_and_buckets() -> None:
    """G-1 (no mode check: any mode but "cuda" runs emulated), G-3 (duplicate buckets pass: `sorted(buckets)`
    instead of `sorted(set(buckets))`), G-4 (a bucket of 0 passes), G-5 (no buckets: an IndexError, not the
    ValueError naming them). Valid buckets, strictly increasing from 1, are accepted."""
    rt = DrafterRuntime(random_drafter())
    cache = DrafterCache(rt.drafter.cfg, rows=2, capacity=8)
    with pytest.raises(ValueError, match="'cuda' or 'emulate'"):
        ChainGraphs(rt, cache, 0, (1,), "eager")  # type: ignore[arg-type]
    for buckets in ((1, 1, 2), (0, 1), ()):
        with pytest.raises(ValueError, match="strictly increasing"):
            ChainGraphs(rt, cache, 0, buckets, "emulate")
    assert ChainGraphs(rt, cache, 0, (1, 3, 8), "emulate").buckets == (1, 3, 8)


@torch.inference_mode()
def test_graphs_are_dropped_when_the_rotary_tables_alone_grow() -> None:
    """G-14 (the rotary tables' addresses and size left out of the generation): a graph reads cos / sin at their
    old addresses. Here the cache already covers the positions, so only the tables are reallocated: the graphs are
    dropped and captured again; without a change nothing is."""
    rt, cache, graphs = _graphs()
    cache.ensure(4 * rt._cos.shape[0])
    graphs.chain(*_ARGS)
    graphs.chain(*_ARGS)
    assert graphs.captures == 1
    capacity = cache.capacity
    rt.ensure_chain(cache, 2 * rt._cos.shape[0])  # tables grown, the cache (large enough) not
    assert cache.capacity == capacity
    graphs.chain(*_ARGS)
    assert graphs.captures == 2 and len(graphs.graphs) == 1


@torch.inference_mode()
def test_graphs_are_dropped_when_the_targets_embedding_or_lm_head_is_replaced() -> None:
    """G-17 / G-18 (the embedding's / lm_head's address left out of the generation): the target's embedding and
    lm_head are shared by reference (`Drafter.set_shared`); replacing either drops the graphs, and the chain then
    drafts with the new one, as the dynamic chain does."""
    rt, cache, graphs = _graphs()
    graphs.chain(*_ARGS)
    g = torch.Generator().manual_seed(1)
    d = rt.drafter
    d.set_shared(torch.randn(V, H, generator=g), d.lm_head)
    graphs.chain(*_ARGS)
    assert graphs.captures == 2
    d.set_shared(d.embed, torch.randn(V, H, generator=g))
    got = graphs.chain(*_ARGS)
    assert graphs.captures == 3
    want = rt.chain(_ARGS[0], cache, _ARGS[1], _ARGS[2], _ARGS[3])
    assert torch.equal(got[0], want[0])


def test_graphs_are_dropped_when_the_sources_cache_grows_rows() -> None:
    """G-13 (the cache's K, V and lengths addresses left out of the generation, only its capacity kept):
    EagleSource grows the cache's rows (new K, V and lengths, the same capacity) when more sequences draft than it
    has rows; the graphs hold the old ones and must be dropped."""
    from tlt.services.rollout.spec.drafting import EagleSource

    source = EagleSource(random_drafter(), graphs="emulate", graph_buckets=(1, 2), rows=2)
    graphs = source.graphs
    with torch.inference_mode():
        graphs.chain(*_ARGS)
    assert graphs.captures == 1
    capacity, nrows = source.cache.capacity, source.cache.k.shape[0]
    for i in range(3):  # 2 sequence rows (+ the scratch row): the third sequence grows them
        source._row((f"s{i}", 0))
    assert source.cache.k.shape[0] > nrows and source.cache.capacity == capacity
    with torch.inference_mode():
        graphs.chain(*_ARGS)
    assert graphs.captures == 2


@torch.inference_mode()
def test_capture_all_captures_only_the_kinds_asked_for_and_only_once() -> None:
    """G-33 (greedy and sampled swapped), G-36 (both kinds captured whatever was asked), G-34 (a key already
    captured captured again), G-31 (smallest bucket first: on a GPU the smaller graphs share the memory pool the
    largest one sized; an order emulate cannot feel, so it is pinned here as the contract): capture_all of greedy chains only captures one graph per bucket and depth, all
    greedy, then sampled only adds the sampled ones, and calling it again captures nothing; a chain on a
    captured key captures nothing either."""
    rt, cache, graphs = _graphs(buckets=(1, 2, 4))
    graphs.capture_all((3, 5), greedy=True, sampled=False)
    assert graphs.kinds == (False,) and graphs.captures == 3 * 2
    assert list(graphs.graphs) == [(b, d, False, 0) for b in (4, 2, 1) for d in (3, 5)]  # largest bucket first
    graphs.capture_all((3, 5), greedy=False, sampled=True)
    assert graphs.kinds == (True,) and graphs.captures == 3 * 2 * 2
    assert {k for k in graphs.graphs if k[2]} == {(b, d, True, 0) for b in (1, 2, 4) for d in (3, 5)}
    graphs.capture_all((3, 5))
    assert graphs.kinds == (False, True) and graphs.captures == 3 * 2 * 2
    graphs.chain(torch.zeros(2, H), torch.tensor([1, 2]), torch.tensor([3, 3]), 5)
    assert graphs.captures == 3 * 2 * 2


@torch.inference_mode()
def test_a_greedy_chain_ignores_filter_flags_in_its_graph_key() -> None:
    """G-44 (the key keeps the filter flags of a greedy chain): EagleSource computes the flags from every row's
    params, greedy ones too; a greedy chain never filters, so it replays the greedy graph capture_all captured,
    capturing nothing, and drafts what the dynamic greedy chain drafts."""
    rt, cache, graphs = _graphs()
    graphs.capture_all((4,), greedy=True, sampled=False)
    captured = graphs.captures
    for flags in (1, 2, 3):
        got = graphs.chain(*_ARGS, filter_flags=flags)
        assert graphs.captures == captured
    want = rt.chain(_ARGS[0], cache, _ARGS[1], _ARGS[2], _ARGS[3])
    assert torch.equal(got[0], want[0]) and got[2] is None


@torch.inference_mode()
def test_need_is_checked_against_the_cache_and_the_tables_inclusively() -> None:
    """G-40 (the cache's capacity not checked), G-39 (one past it allowed), G-42 / G-41 (a need equal to the
    capacity / to the tables' size refused): `need` may equal what the cache and the rotary tables cover, and
    not exceed either."""
    rt, cache, graphs = _graphs()
    assert cache.capacity < rt._cos.shape[0]
    assert graphs.chain(*_ARGS, need=cache.capacity) is not None
    with pytest.raises(ValueError, match="grow them first"):
        graphs.chain(*_ARGS, need=cache.capacity + 1)
    cache.ensure(rt._cos.shape[0] + 8)
    assert graphs.chain(*_ARGS, need=rt._cos.shape[0]) is not None


@torch.inference_mode()
def test_padding_rows_draft_into_the_scratch_row_given_not_row_0() -> None:
    """G-59 (padding reset to row 0 instead of the scratch row): with scratch row 5, row 0 is a sequence's; a
    bucket of 4 run for 3 rows, row 0 among them, must not also draft into row 0 from the padding slot (two chains
    writing one row corrupt each other): the same drafts as the dynamic chain."""
    lengths = {0: 4, 1: 6, 2: 5, 3: 7}
    rt, cache, graphs = _graphs(buckets=(4,), lengths=lengths, rows=6, scratch=5)
    g = torch.Generator().manual_seed(9)
    depth, need = 6, 16
    rt.ensure_chain(cache, need)
    for rows in ([3, 2, 1, 0], [0, 1, 2]):
        r = torch.tensor(rows)
        h, root_pos = torch.randn(len(rows), H, generator=g), torch.tensor([lengths[x] for x in rows])
        want = rt.chain(h, cache, r, root_pos, depth)
        got = graphs.chain(h, r, root_pos, depth, need=need)
        assert torch.equal(got[0], want[0])
        assert torch.allclose(got[1], want[1], atol=1e-4)


@torch.inference_mode()
def test_params_without_uniforms_draft_greedily_as_the_dynamic_chain_does() -> None:
    """G-43 (a chain taken as sampled when params are given, not when uniforms are): `DrafterRuntime.chain` drafts
    greedily unless given uniforms; the graphs do the same (the greedy graph, no distributions), not an
    AssertionError."""
    rt, cache, graphs = _graphs()
    params = torch.tensor([[0.7, 0.0, 1.0, 0.0]])
    got = graphs.chain(*_ARGS, params=params)
    want = rt.chain(_ARGS[0], cache, _ARGS[1], _ARGS[2], _ARGS[3], params=params)
    assert torch.equal(got[0], want[0]) and got[2] is None and want[2] is None
    assert set(graphs.graphs) == {(1, 4, False, 0)}


@torch.inference_mode()
def test_top_k_of_one_is_a_filter() -> None:
    """G-63 (top_k > 1 taken as the filter's predicate): top_k = 1 keeps only the argmax, a filter like any other
    (`chain_draft` on the device tests top_k > 0): its flag is set, and a sampled chain with it drafts through the
    graphs what the dynamic chain drafts, every distribution one-hot."""
    assert ChainGraphs.filter_flags([(1, 1.0, 0.0)]) == 1
    rt, cache, graphs = _graphs()
    params = torch.tensor([[1.5, 1.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(2)
    h, u = torch.randn(1, H, generator=g), torch.rand(1, 4, generator=g)
    got = graphs.chain(h, *_ARGS[1:], params=params, u=u, filter_flags=ChainGraphs.filter_flags([(1, 1.0, 0.0)]))
    want = rt.chain(h, cache, _ARGS[1], _ARGS[2], _ARGS[3], params=params, u=u)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[2], want[2])
    assert torch.equal(got[2].amax(-1), torch.ones(1, 4))


@torch.inference_mode()
def test_a_bf16_drafters_static_buffers_take_its_dtype() -> None:
    """helper-198's G-14 (the static `h` buffer made in the default float32): a bf16 drafter's graphs draft from
    bf16 hidden states, as its dynamic chain does (the same tokens; a float32 buffer fed to bf16 weights fails or
    drifts). The cache is bf16 too, as EagleSource makes it for a bf16 drafter."""
    rt = DrafterRuntime(random_drafter(7).to(torch.bfloat16))
    assert rt.dtype == torch.bfloat16
    cache = _filled_cache(rt, 4, {1: 3, 2: 4}, seed=7)
    g = torch.Generator().manual_seed(7)
    graphs = ChainGraphs(rt, cache, scratch_row=0, buckets=(2,), mode="emulate")
    h = torch.randn(2, H, generator=g).to(torch.bfloat16)
    rows, root_pos = torch.tensor([1, 2]), torch.tensor([3, 4])
    want = rt.chain(h, cache, rows, root_pos, 4)
    got = graphs.chain(h, rows, root_pos, 4, need=8)
    assert graphs.graphs[(2, 4, False, 0)][1]["h"].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1].float(), want[1].float(), atol=1e-2)
