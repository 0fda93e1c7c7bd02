"""ChainGraphs (tlt/model/drafter_graphs.py) in its "emulate" mode against the dynamic `DrafterRuntime.chain`.

The graphs' static call attends over the whole cache with each row's keys past its end masked, gathers rows by
index, pads the batch to a bucket with a scratch row and takes the filters as given: it must draft what the
dynamic chain drafts (greedy and sampled with the same uniforms), leave every real row's cached length as it was,
drop its graphs when the cache, the rotary tables or the weights are reallocated, and, in the engine, emit what
drafting without graphs emits. The "cuda" mode replays the same call from CUDA graphs: its test is in
tests/test_engine_cuda.py (GPU only). Tiny random drafters and models built in code.
"""

from __future__ import annotations

import pytest
import torch

from tiny_drafter import H, V, random_drafter

from tlt.model.drafter import Drafter, DrafterCache, DrafterConfig
from tlt.model.drafter_graphs import ChainGraphs
from tlt.model.drafter_runtime import DrafterRuntime


@torch.inference_mode()
def _filled_cache(rt: DrafterRuntime, rows: int, lengths: dict[int, int], seed: int) -> DrafterCache:
    """A cache whose rows hold `lengths` fed pairs (row 0, the graphs' scratch row, none), in the drafter's dtype."""
    cache = DrafterCache(rt.drafter.cfg, rows=rows, capacity=8, dtype=rt.dtype)
    g = torch.Generator().manual_seed(seed)
    for r, n in lengths.items():
        ids, f = torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, H, generator=g).to(rt.dtype)
        rt(ids, f, torch.arange(n)[None], cache, torch.tensor([r]))
    return cache


def _target_drafter(eng) -> Drafter:  # noqa: ANN001 - LLMEngine
    """A random drafter sharing the engine's target embedding and lm_head."""
    return Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)


@pytest.fixture(scope="module")
def ckpt320(tmp_path_factory):
    """A tiny random Qwen2 checkpoint with a 320-position context: past the drafter cache's first 256."""
    from tlt.services.rollout.engine.testing import random_checkpoint

    return random_checkpoint(tmp_path_factory.mktemp("m320") / "ckpt", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=320, weight_scale=0.02)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("rows", [[3], [5, 2], [6, 1, 4], [2, 7, 5, 1, 3]])
def test_emulated_graphs_draft_what_the_dynamic_chain_drafts(rows: list[int], sampled: bool) -> None:
    d = random_drafter(len(rows))
    rt = DrafterRuntime(d)
    lengths = {r: 3 + 2 * i for i, r in enumerate(rows)}  # rows of different lengths, not consecutive
    cache = _filled_cache(rt, 8, lengths, seed=len(rows))
    graphs = ChainGraphs(rt, cache, scratch_row=0, buckets=(1, 2, 4, 8), mode="emulate")
    g = torch.Generator().manual_seed(7)
    n, depth = len(rows), 6
    h = torch.randn(n, H, generator=g)
    r = torch.tensor(rows)
    root_pos = torch.tensor([lengths[x] for x in rows])
    params = u = None
    if sampled:
        params = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.7, 0.0, 0.9, 0.0], [1.3, 5.0, 1.0, 0.05]] * 2)[:n]
        u = torch.rand(n, depth, generator=g)
    flags = ChainGraphs.filter_flags(params[:, 1:].tolist()) if params is not None else 0  # EagleSource's host flags
    before = cache.lengths.clone()
    want = rt.chain(h, cache, r, root_pos, depth, params=params, u=u)
    need = int(root_pos.max()) + 1 + depth  # what EagleSource knows from the sequences' lengths
    cache.ensure(need)
    rt._ensure_rope(need)
    kept = {x: cache.k[x, :, : lengths[x]].clone() for x in rows}
    got = graphs.chain(h, r, root_pos, depth, params, u, flags, need)
    assert got is not None
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], atol=1e-4)
    if sampled:
        assert torch.allclose(got[2], want[2], atol=1e-5)
    else:
        assert got[2] is None and want[2] is None
    assert torch.equal(cache.lengths, before)  # drafted entries are dead: no row's length moved
    for x in rows:  # nor its cached keys (the padding rows draft into row 0)
        assert torch.equal(cache.k[x, :, : lengths[x]], kept[x])
    assert graphs.captures == 1


@torch.inference_mode()
def test_a_batch_past_the_largest_bucket_is_left_to_the_dynamic_chain() -> None:
    rt = DrafterRuntime(random_drafter())
    cache = _filled_cache(rt, 4, {1: 3, 2: 3, 3: 3}, seed=0)
    graphs = ChainGraphs(rt, cache, scratch_row=0, buckets=(1, 2), mode="emulate")
    rows = torch.tensor([1, 2, 3])
    assert graphs.chain(torch.zeros(3, H), rows, torch.tensor([3, 3, 3]), 4) is None
    # a batch as large as a bucket takes that bucket (the largest too), not the next one or the dynamic chain
    assert [graphs.bucket_for(n) for n in (1, 2, 3)] == [1, 2, None]
    assert graphs.chain(torch.zeros(2, H), rows[:2], torch.tensor([3, 3]), 1) is not None
    # a chain needing positions past the rotary tables (the cache has them) is refused, not written past them
    cache.ensure(rt._cos.shape[0] + 8)
    with pytest.raises(ValueError, match="grow them first"):
        graphs.chain(torch.zeros(2, H), rows[:2], torch.tensor([3, 3]), 1, need=rt._cos.shape[0] + 1)


@torch.inference_mode()
def test_graphs_are_dropped_when_what_they_point_at_is_reallocated() -> None:
    rt = DrafterRuntime(random_drafter())
    cache = _filled_cache(rt, 4, {1: 3}, seed=0)
    graphs = ChainGraphs(rt, cache, scratch_row=0, buckets=(1, 2), mode="emulate")
    args = (torch.zeros(1, H), torch.tensor([1]), torch.tensor([3]), 4)
    graphs.chain(*args)
    graphs.chain(*args)
    assert graphs.captures == 1  # the same key: reused
    rt.refresh()  # a drafter hot-swap re-derives the fused weights
    graphs.chain(*args)
    assert graphs.captures == 2
    cache.ensure(4 * cache.capacity)  # the cache grown: new storage
    graphs.chain(*args)
    assert graphs.captures == 3


def test_a_cuda_graph_mode_for_a_drafter_off_the_gpu_is_refused() -> None:
    rt = DrafterRuntime(random_drafter())
    with pytest.raises(ValueError, match="CUDA"):
        ChainGraphs(rt, DrafterCache(rt.drafter.cfg, rows=2, capacity=8), 0, (1,), "cuda")
    with pytest.raises(ValueError, match="increasing"):
        ChainGraphs(rt, DrafterCache(rt.drafter.cfg, rows=2, capacity=8), 0, (2, 1), "emulate")


def test_the_engine_emits_the_same_tokens_with_emulated_drafter_graphs(tmp_path) -> None:
    """Greedy and seeded sampled requests (sampled chains, rejection sampling: what is emitted depends on what was
    drafted) through the native engine with a learned drafter: token for token the same with drafter_graphs =
    "emulate" as with "off"; the graphs were all captured as the decoder was built (the cache did not grow)."""
    from spec_decoder_helpers import _engine, _spec_generate

    from tlt.services.rollout.engine.testing import random_checkpoint
    from tlt.services.rollout.spec.config import SpecConfig
    from tlt.services.rollout.spec.decoder import SpecDecoder
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    ckpt = random_checkpoint(tmp_path / "ckpt", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, max_position_embeddings=256, weight_scale=0.02)
    g = torch.Generator().manual_seed(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    # other lengths: the batch shrinks 6 -> 4 -> 2 sequences, and 6 runs padded to the bucket of 8
    sampled = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, logprobs=0, seed=11) for n in (17, 23)]
    requests = [GenerationRequest(f"r{i}", tuple(torch.randint(3, 60, (6 + i,), generator=g).tolist()), p, 2)
                for i, p in enumerate((greedy, *sampled))]
    outs, decoders = [], []
    for graphs in ("off", "emulate"):
        eng = _engine(ckpt)
        torch.manual_seed(0)
        drafter = _target_drafter(eng)
        cfg = SpecConfig(drafter="learned", drafter_path="(in memory)", mode="static", static_arm="5_1_6",
                         threshold=8, hysteresis_steps=1, verify_token_budget=0, drafter_graphs=graphs)
        dec = SpecDecoder(cfg, eng.runner, eng.block_manager, drafter)
        captured = dec.source.graphs.captures if dec.source.graphs is not None else 0
        outs.append([(c.request_id, c.sample_index, c.token_ids) for c in _spec_generate(eng, dec, requests)])
        decoders.append(dec)
        if graphs != "off":  # every graph the rollout used was captured as the decoder was built, none during it
            assert captured == 4 * 2 and dec.source.graphs.captures == captured  # 4 buckets x greedy / sampled
    assert outs[0] == outs[1]
    assert decoders[1].stats()["verify_steps"] > 5
    assert decoders[0].source.graphs is None


def test_a_drafter_hot_swap_captures_the_new_weights_graphs_at_once() -> None:
    """EagleSource.reset (the engine's drafter hot-swap) re-derives the fused weights, which the graphs hold the
    addresses of: they are captured again right there, not inside the next rollout's first chains."""
    from tlt.services.rollout.spec.drafting import EagleSource

    source = EagleSource(random_drafter(), graphs="emulate", graph_buckets=(1, 2), rows=4)
    source.graphs.capture_all((3, 5))
    assert source.graphs.captures == 2 * 2 * 2
    source.reset()
    assert source.graphs.captures == 2 * 2 * 2 * 2
    assert len(source.graphs.graphs) == 8  # the old ones dropped


@torch.inference_mode()
def test_padding_rows_never_draft_into_a_row_a_larger_batch_left_in_them() -> None:
    """A bucket's graph run first for 4 rows, then for 3 of them in another order: the fourth slot, now padding,
    still names a real row (the first batch's last) unless reset to the scratch row, and that row drafting twice at
    once (as itself and as padding, from another root) would corrupt its chain."""
    rt = DrafterRuntime(random_drafter(5))
    lengths = {1: 4, 2: 6, 3: 5, 4: 7}
    cache = _filled_cache(rt, 6, lengths, seed=5)
    graphs = ChainGraphs(rt, cache, scratch_row=0, buckets=(4,), mode="emulate")
    g = torch.Generator().manual_seed(9)
    depth, need = 6, 16
    rt.ensure_chain(cache, need)
    first = torch.tensor([1, 2, 3, 4])
    graphs.chain(torch.randn(4, H, generator=g), first, torch.tensor([lengths[x] for x in [1, 2, 3, 4]]), depth,
                 need=need)
    rows = torch.tensor([4, 1, 2])
    h, root_pos = torch.randn(3, H, generator=g), torch.tensor([lengths[x] for x in [4, 1, 2]])
    want = rt.chain(h, cache, rows, root_pos, depth)
    got = graphs.chain(h, rows, root_pos, depth, need=need)
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], atol=1e-4)


def test_the_engine_sizes_the_drafter_cache_for_its_context_and_with_graphs_captures_nothing_mid_rollout(ckpt320) -> None:
    """The cache started with 256 positions; a sequence past them grew it, which dropped every graph and captured
    them again inside the rollout (session 32, H200: the whole-rollout bench's batch 2-4 bucket ran at 0.65x of
    plain decoding). The engine sizes it for its context (up to DRAFTER_CACHE_POSITIONS), with graphs or without:
    a 300-token sequence in a 320-position model grows nothing and captures nothing after the decoder is built,
    and drafts as without graphs."""
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.spec.config import SpecConfig
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    request = GenerationRequest("long", tuple(range(3, 11)), SamplingParams(temperature=0.0, max_tokens=300,
                                                                           ignore_eos=True))
    outs = []
    for graphs in ("off", "emulate"):
        eng = LLMEngine(ckpt320, EngineConfig(device="cpu", block_size=16, max_num_seqs=4))
        torch.manual_seed(0)
        drafter = _target_drafter(eng)
        eng.enable_spec(SpecConfig(drafter="learned", drafter_path="(in memory)", mode="static", static_arm="5_1_6",
                                   threshold=4, hysteresis_steps=1, verify_token_budget=0, drafter_graphs=graphs),
                        drafter)
        source = eng.spec_decoder.source
        captured = source.graphs.captures if source.graphs is not None else 0
        start = source.cache.capacity
        outs.append(eng.generate([request])[0].token_ids)
        assert start >= eng.max_model_len + 5 and source.cache.capacity == start  # eagerly too (session 33)
        if graphs != "off":
            assert source.graphs.captures == captured > 0 and eng.stats().spec["verify_steps"] > 30
    assert len(outs[0]) == 300 and outs[0] == outs[1]


def test_the_presized_cache_covers_what_a_tree_arm_writes_past_a_sequence(ckpt320) -> None:
    """A tree arm (topk > 1) writes (steps - 1) x topk expanded nodes past a sequence's length, more than its depth:
    an adaptive decoder whose arms mix trees and chains sizes the graphs' cache for the deepest write, so a tree
    step near the context's end does not grow it (which would drop the chains' graphs mid-rollout)."""
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.spec.config import SpecConfig

    eng = LLMEngine(ckpt320, EngineConfig(device="cpu", block_size=16, max_num_seqs=4))
    eng.enable_spec(SpecConfig(drafter="learned", drafter_path="(in memory)", mode="adaptive", threshold=4,
                               bucket_thresholds=(1, 2), bucket_arms=(("8_4_16", "4_1_5"), ("4_1_5", "plain")),
                               verify_token_budget=0, drafter_graphs="emulate"), _target_drafter(eng))
    assert eng.spec_decoder.source.cache.capacity >= eng.max_model_len + 7 * 4


def test_filter_flags_name_exactly_the_filters_some_row_uses() -> None:
    """The emulated-graphs test above catches flags that leave out a filter a row uses (its drafts would differ);
    this one catches flags that name a filter no row uses (the graph would sort and scatter for nothing)."""
    flags = ChainGraphs.filter_flags
    assert flags([]) == 0 and flags([(0, 1.0, 0.0), (0, 1.0, 0.0)]) == 0
    assert flags([(5, 1.0, 0.0)]) == 1 and flags([(0, 0.9, 0.0)]) == 1 and flags([(0, 1.0, 0.05)]) == 2
    assert flags([(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.1)]) == 3


def test_the_drafter_caches_start_size_is_capped(ckpt320, monkeypatch) -> None:
    """Rows for every sequence that may speculate and positions for the context are allocated up front, outside
    kv_cache_mb: a large max_num_seqs with a large threshold would take gigabytes on a real drafter. The start size
    is capped (positions first, down to 256, then rows, down to 8); the cache still grows as used, and decodes."""
    import tlt.services.rollout.spec.decoder as decoder
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.spec.config import SpecConfig
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    def start(cap: int) -> tuple[int, int, int]:
        monkeypatch.setattr(decoder, "DRAFTER_CACHE_START_BYTES", cap)
        eng = LLMEngine(ckpt320, EngineConfig(device="cpu", block_size=16, max_num_seqs=64))
        torch.manual_seed(0)
        eng.enable_spec(SpecConfig(drafter="learned", drafter_path="(in memory)", mode="static", static_arm="4_1_5",
                                   threshold=32, hysteresis_steps=1, verify_token_budget=0), _target_drafter(eng))
        cache = eng.spec_decoder.source.cache
        request = GenerationRequest("r", tuple(range(3, 11)), SamplingParams(temperature=0.0, max_tokens=280,
                                                                             ignore_eos=True))
        assert len(eng.generate([request])[0].token_ids) == 280
        return cache.k.shape[0], cache.k.shape[2], 2 * cache.k.numel() * cache.k.element_size()

    rows, positions, _ = start(1 << 40)  # no cap in reach: 64 rows (min(64, 2 x 32)), the context's positions
    assert rows == 64 and positions >= 320
    per_row_position = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, fp32
    rows, positions, size = start(64 * 300 * per_row_position)  # positions give way first
    assert rows == 64 and positions == 300 and size <= 64 * 300 * per_row_position
    rows, positions, _ = start(1)  # at the floors: 8 rows, 256 positions, grown to the 288-token sequence as used
    assert rows == 8 and positions == 512
