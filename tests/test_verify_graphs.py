"""Per-arm verify graphs of speculative decoding (services/rollout/engine/verify_graphs.py).

In-process: the plan (which arm gets graphs for which batch buckets, from the real SpecDecoder's
arm routing) and the pool's shapes and refusals. The padded static-buffer verify step itself runs on
the Triton tree kernel, so the `test_interpreter_*` cases run in a child `python -m pytest` started
with TRITON_INTERPRET=1 (as tests/test_engine_kernels.py does), fp32, tiny shapes:
  - one verify step, eager (`ModelRunner.extend` over the real nodes) vs the pool's "emulate" mode
    (padded to Q nodes and to the batch bucket): same hidden states and logits, same K/V for the real
    nodes, every other KV slot outside the scratch block untouched;
  - whole greedy generations with graphs emulated and adaptive speculation: tokens identical to
    speculation off (lossless; the PyTorch path's plain decode), and the same drafts / acceptances /
    arms as the eager verify path on the kernels.
Nothing is faked: a random tiny Qwen2 and the real kernels, interpreted. CUDA graph capture
(mode "cuda") needs a GPU: tests/test_engine_cuda.py (`pytest -m gpu`; passed on an H200 in session 30).
"""

from __future__ import annotations


import pytest
import torch

from kernel_params import run_interpreter_child
from tlt.kernels.launch import interpreter_ready
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.decode_graphs import default_buckets
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.engine.verify_graphs import VerifyGraphs, plan_verify_graphs
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.decoder import SpecDecoder
from tlt.services.rollout.spec.tree import Arm, ancestor_mask
from tlt.services.rollout.types import GenerationRequest, SamplingParams

INTERPRETER_CASES = 2
needs_interpreter = pytest.mark.skipif(
    not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from process start: runs in the child process"
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("vgraphs") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=128,
                             seed=5, weight_scale=0.03)


def _named(plan: dict[Arm, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    return {a.name: bs for a, bs in plan.items()}


# ----------------------------------------------------------------------------- in-process


def _decoder_plan(ckpt, **spec) -> dict[str, tuple[int, ...]]:
    """The plan from a real SpecDecoder's arm routing (bandit buckets, budget, static arm)."""
    engine = LLMEngine(ckpt, EngineConfig(block_size=4))
    decoder = SpecDecoder(SpecConfig(drafter="ngram", **spec), engine.runner, engine.block_manager)
    return _named(plan_verify_graphs(decoder._arms_at, decoder.config.threshold, default_buckets(128)))


def test_each_arm_gets_graphs_only_for_its_bucket_batch_sizes(ckpt):
    # default buckets 1 | 2-4 | 5-20 | >=21, SD threshold 32; graph buckets 1, 2, 4, 8, 16, 32, 64, 128:
    # sizes 1 -> 1, 2 -> 2, 3-4 -> 4, 5-8 -> 8, 9-16 -> 16, 17-32 -> 32 (nothing above the threshold)
    assert _decoder_plan(ckpt) == {
        "4_1_5": (8, 16, 32),             # buckets 5-20 and >=21
        "8_4_8": (2, 4, 8, 16, 32),       # buckets 2-4, 5-20, >=21
        "8_4_16": (1, 2, 4, 8, 16, 32),   # buckets 1, 2-4, 5-20
        "8_4_32": (1, 2, 4),              # buckets 1, 2-4
        "8_4_48": (1,),                   # bucket 1
    }
    # a verify-token budget of 64 drafts x batch: an arm is planned only where the bandit may choose it
    # (13..20, where every arm of the bucket is over the budget, decode plainly: no graphs there; threshold 20, as
    # no arm of bucket >=21 fits at 21 and SpecConfig refuses a bucket that never speculates)
    assert _decoder_plan(ckpt, verify_token_budget=64, threshold=20) == {
        "4_1_5": (8, 16), "8_4_8": (2, 4, 8), "8_4_16": (1, 2, 4), "8_4_32": (1, 2), "8_4_48": (1,),
    }
    # the threshold bounds the sizes: at 4, bucket 5-20's and >=21's arms get nothing
    assert _decoder_plan(ckpt, threshold=4) == {"8_4_8": (2, 4), "8_4_16": (1, 2, 4), "8_4_32": (1, 2, 4),
                                               "8_4_48": (1,)}
    # "plain" verifies nothing; a static arm covers every size up to the threshold
    assert _decoder_plan(ckpt, bucket_thresholds=(1, 3), bucket_arms=(("plain", "3_2_6"), ("plain",)),
                         threshold=8) == {"3_2_6": (1, 2)}
    assert _decoder_plan(ckpt, mode="static", static_arm="3_2_6", threshold=5) == {"3_2_6": (1, 2, 4, 8)}
    assert _decoder_plan(ckpt, mode="off") == {}


def test_pool_shares_graphs_between_arms_of_one_node_count(ckpt):
    model = LLMEngine(ckpt, EngineConfig(block_size=4)).model
    model.kernels = "triton"  # only the checks and the buffers: nothing is launched
    plan = {Arm.parse("8_4_16"): (1, 2), Arm.parse("5_2_16"): (4,), Arm.parse("4_1_5"): (8,)}
    pool = VerifyGraphs(model, 4, 10, 99, plan, "emulate")
    assert pool.shapes == {5: (8,), 16: (1, 2, 4)}
    assert tuple(pool.static[16].mask.shape) == (4, 16, 16) and tuple(pool.static[5].ids.shape) == (40,)
    arm = Arm.parse("8_4_16")
    assert [pool.bucket_for(arm, n) for n in (1, 2, 3)] == [1, 2, None]  # only the arm's own buckets
    assert pool.bucket_for(Arm.parse("4_1_5"), 1) == 8 and pool.bucket_for(Arm.parse("3_2_6"), 1) is None
    assert pool.fits(arm, [3, 24]) and not pool.fits(arm, [3, 25])  # 25 + 16 nodes > 10 blocks x 4
    for mode, match in (("off", "'cuda' or 'emulate'"), ("cuda", "CUDA device")):
        with pytest.raises(ValueError, match=match):
            VerifyGraphs(model, 4, 10, 99, plan, mode)
    model.kernels = "torch"
    with pytest.raises(ValueError, match="kernels = 'triton'"):
        VerifyGraphs(model, 4, 10, 99, plan, "emulate")


def test_verify_graphs_in_child() -> None:
    if interpreter_ready():
        pytest.skip("this process already runs the interpreter: the cases run directly")
    run_interpreter_child(["-k", "test_interpreter_", __file__], exactly=INTERPRETER_CASES)


# ----------------------------------------------------------------------------- interpreter (child)


def _random_trees(counts: list[int], width: int, g: torch.Generator):
    """Trees of counts[i] real nodes padded to `width` (padding: token -1, parent 0, as pad_trees does)."""
    b = len(counts)
    tokens = torch.full((b, width), -1, dtype=torch.int64)
    parents = torch.zeros(b, width, dtype=torch.int64)
    depth = torch.zeros(b, width, dtype=torch.int64)
    for i, n in enumerate(counts):
        tokens[i, :n] = torch.randint(3, 250, (n,), generator=g)
        parents[i, 0] = -1
        for j in range(1, n):
            parents[i, j] = int(torch.randint(0, j, (1,), generator=g))
            depth[i, j] = depth[i, parents[i, j]] + 1
    return tokens, parents, depth


@needs_interpreter
def test_interpreter_verify_step_emulated_equals_eager(ckpt) -> None:
    """One verify step of 3 trees (6, 3 and 1 real nodes, drafted 5 wide, arm Q = 7) padded to bucket 4:
    the pool's padded step gives the eager step's hidden rows and logits, writes the real nodes' K/V
    where the eager step does, and leaves every other slot outside the scratch block untouched (a
    padding node or row writing into a live block, a wrong mask or table changes these)."""
    g = torch.Generator().manual_seed(0)
    # one thread: the bit-for-bit checks below hold for one CPU thread's maths (the interpreter child has
    # OMP_NUM_THREADS=1; `TRITON_INTERPRET=1 pytest` on this file alone ran multi-threaded and failed them)
    # max_model_len 32: padded tables (32 + 128 tree room) / 4 = 40 blocks wide, walked in 5 splits merged by the
    # split-K kernel (the model's 128 would make them 64 wide, in 8 splits: the same paths, more interpreted programs)
    engine = LLMEngine(ckpt, EngineConfig(kernels="triton", decode_graphs="emulate", threads=1, block_size=4,
                                          num_kv_blocks=40, decode_graph_buckets=(1, 2, 4), max_model_len=32))
    runner, model = engine.runner, engine.model
    arm = Arm.parse("3_3_7")
    pool = runner.enable_verify_graphs({arm: (4,)})
    assert pool is runner.verify_graphs and pool.shapes == {7: (4,)}
    for cache in (*model.k_caches, *model.v_caches):  # a populated cache: every prefix token has K/V
        cache.copy_(torch.randn(cache.shape, generator=g))
    ctx, counts = [5, 9, 2], [5, 3, 1]
    tokens, parents, depth = _random_trees(counts, 5, g)
    free = torch.randperm(40, generator=g).tolist()  # disjoint tables, with room for all Q positions
    tables = [free[0:4], free[4:8], free[8:10]]
    masks = ancestor_mask(parents)
    before = [c.clone() for c in (*model.k_caches, *model.v_caches)]

    valid = torch.arange(5)[None, :] < torch.tensor(counts)[:, None]
    eager = runner.extend(tokens[valid], (torch.tensor(ctx)[:, None] + depth)[valid], counts, ctx, tables,
                          [masks[i, :n, :n] for i, n in enumerate(counts)])
    eager_caches = [c.clone() for c in (*model.k_caches, *model.v_caches)]
    for c, b in zip((*model.k_caches, *model.v_caches), before):
        c.copy_(b)
    padded = pool.run(arm, tokens, depth, masks, counts, ctx, tables)
    assert pool.per_shape == {(7, 4): 1}

    assert padded.shape == eager.shape == (sum(counts), 64)
    # bit for bit: rows are independent, padding columns add exact zeros (fp32, this CPU's BLAS)
    assert torch.equal(padded, eager)
    assert torch.equal(model.compute_logits(padded), model.compute_logits(eager))
    scratch = runner.num_blocks
    for got, want, old in zip((*model.k_caches, *model.v_caches), eager_caches, before):
        assert torch.equal(got[:scratch], want[:scratch])
        written = (want[:scratch] != old[:scratch]).any(-1).any(-1)  # [blocks, block_size] slots eager wrote
        assert int(written.sum()) == sum(counts)
        assert torch.equal(got[:scratch][~written], old[:scratch][~written])  # padding wrote nowhere else
        assert torch.equal(want[scratch], old[scratch]) and not torch.equal(got[scratch], old[scratch])


@needs_interpreter
def test_interpreter_greedy_lossless_with_verify_graphs_emulated(ckpt) -> None:
    """Adaptive n-gram speculation with decode and verify graphs emulated: every token equals speculation
    off, and drafts, acceptances and arm choices equal the eager verify path's. Five requests of
    different lengths shrink the batch 5 -> 1 through the bandit buckets 1 | 2 | 3-5 (one arm each),
    so every arm's planned graphs run, and only those."""
    g = torch.Generator().manual_seed(3)
    prompts = []
    for n in (7, 12, 10, 9, 5):
        motif = torch.randint(3, 250, (int(torch.randint(2, 4, (1,), generator=g)),), generator=g).tolist()
        prompts.append((motif * 20)[:n])
    # verify steps at batch 5, 4, 2, 2, then 1 x 5: each bucket (8, 4, 2, 1) and so each of the 3 arms' graphs once
    # or more, with most steps at the small buckets (the interpreter's cost grows with the padded batch)
    lengths = [14, 2, 3, 4, 6]
    spec = SpecConfig(mode="adaptive", drafter="ngram", threshold=8, hysteresis_steps=1, bucket_thresholds=(1, 2, 3),
                      bucket_arms=(("3_2_6",), ("2_1_3",), ("2_2_4",)), epsilon=0.0)

    def run(spec_config: SpecConfig | None, graphs: str, kernels: str = "triton"):  # noqa: ANN202
        # max_model_len 40 (the longest request needs 21 + a tree): the static tables are (40 + 128 tree room) / 4 =
        # 42 blocks wide (the model's 128 would make them 64); the interpreter runs every split of a padded table
        engine = LLMEngine(ckpt, EngineConfig(kernels=kernels, block_size=4, max_num_seqs=8, decode_graphs=graphs,
                                              max_model_len=40))
        if spec_config is not None:
            engine.enable_spec(spec_config)
        reqs = [GenerationRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                                     logprobs=0))
                for i, (p, n) in enumerate(zip(prompts, lengths))]
        return engine, engine.generate(reqs)

    _, plain = run(None, "off", "torch")  # speculation off on the PyTorch path (the kernels' plain decode is
    # checked against it in tests/test_engine_kernels.py): the reference without the interpreter's cost
    eager_engine, eager = run(spec, "off")
    engine, got = run(spec, "emulate")
    for a, b, c in zip(plain, got, eager):
        assert b.token_ids == a.token_ids == c.token_ids
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4)
    untimed = lambda st: {k: v for k, v in st.items() if not k.endswith("seconds") and k != "bandit"}  # noqa: E731
    stats = engine.stats().spec
    assert untimed(stats) == untimed(eager_engine.stats().spec)  # same drafts, acceptances and arms
    assert stats["emitted_tokens"] > stats["verify_steps"], "drafts were accepted"
    pool = engine.runner.verify_graphs
    assert pool is not None and _named(pool.plan) == {"2_1_3": (2,), "2_2_4": (4, 8), "3_2_6": (1,)}
    # batch 1 -> 3_2_6 at bucket 1, 2 -> 2_1_3 at 2, 3-4 -> 2_2_4 at 4, 5 -> 2_2_4 at 8: all verify steps replayed
    assert set(pool.per_shape) == {(6, 1), (3, 2), (4, 4), (4, 8)}  # every planned graph ran
    assert sum(pool.per_shape.values()) == stats["verify_steps"]
