"""The native engine on a CUDA GPU: what the CPU suite checks, on the device the GPU presets use.

Marked `gpu`, so the default run deselects them and a CPU machine skips them. On a GPU machine: `pytest -m gpu
tests/`, or `bash deploy/gpu_check.sh` (what the device sessions run). First run on a GPU in session 30 (an
H200, torch 2.11 / triton 3.6): all 7 failed in prefill (`grouped_sdpa` viewed a CUDA SDPA output that cannot be
viewed); after the fix all 7 passed, with the 68 kernel parity cases. They are the same
checks as the CPU tests they mirror, on `device = "cuda"` in fp32 (bf16 greedy identity across batch shapes is
not expected: different matmul shapes round differently). Their CPU analog (device "cpu", graphs "emulate",
under TRITON_INTERPRET=1, by editing a copy of this file) passed in session 10; on the H200 they check:

- greedy decoding equals `transformers` generate on the same GPU (tests/test_engine.py);
- the Triton kernels, and plain decode replayed from CUDA graphs per batch bucket (`decode_graphs = "cuda"`),
  give the eager PyTorch path's tokens (tests/test_engine_kernels.py runs the emulated graphs under the
  interpreter);
- speculation with per-arm verify graphs (`decode_graphs = "cuda"` with a spec config) is greedy-lossless
  and replays a graph for every verify step (tests/test_verify_graphs.py, emulated there);
- (session 31, not yet run on a GPU) the drafter's chain replayed from CUDA graphs drafts what the eager chain
  drafts (tests/test_drafter_graphs.py, emulated there).
"""

from __future__ import annotations

import pytest
import torch

from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.types import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("cuda") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                             seed=0, weight_scale=0.05)


def _prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, 250, (int(k),), generator=g).tolist())
            for k in torch.randint(1, 60, (n,), generator=g)]


def _greedy(prompts, lengths=None, max_new: int = 16):  # noqa: ANN001, ANN202
    lengths = lengths or [max_new] * len(prompts)
    return [GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0))
            for i, (p, n) in enumerate(zip(prompts, lengths))]


def test_cuda_greedy_matches_transformers(ckpt) -> None:
    import transformers

    prompts = _prompts(24)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval().to("cuda")
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
            want.append(out[0, len(p):].tolist())  # eos stops both, as in tests/test_engine.py
    engine = LLMEngine(ckpt, EngineConfig(device="cuda", max_num_seqs=8, block_size=16))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    got = [o.token_ids for o in engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])]
    assert got == want


@pytest.mark.parametrize("kernels,graphs", [("triton", "off"), ("triton", "cuda")])
def test_cuda_kernels_and_decode_graphs_match_the_pytorch_path(ckpt, kernels, graphs) -> None:
    prompts = _prompts(12, seed=1)
    lengths = [int(x) for x in torch.randint(2, 24, (12,), generator=torch.Generator().manual_seed(2))]

    def run(**kw):  # noqa: ANN202
        engine = LLMEngine(ckpt, EngineConfig(device="cuda", max_num_seqs=16, block_size=16, **kw))
        return engine, engine.generate(_greedy(prompts, lengths))

    _, want = run(kernels="torch")
    engine, got = run(kernels=kernels, decode_graphs=graphs)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-3)
    if graphs == "cuda":
        assert engine.runner.graphs is not None and sum(engine.runner.graphs.per_bucket.values()) > 0


def test_cuda_verify_graphs_are_greedy_lossless(ckpt) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = []
    for n in (7, 12, 10, 9, 5):  # repetitive prompts: the n-gram drafter's drafts get accepted
        motif = torch.randint(3, 250, (int(torch.randint(2, 4, (1,), generator=g)),), generator=g).tolist()
        prompts.append(tuple((motif * 20)[:n]))
    lengths = [14, 4, 9, 6, 11]
    spec = SpecConfig(mode="adaptive", drafter="ngram", threshold=8, hysteresis_steps=1, bucket_thresholds=(1, 2, 3),
                      bucket_arms=(("3_2_6",), ("2_1_3",), ("2_2_4",)), epsilon=0.0)

    def run(spec_config: SpecConfig | None, graphs: str):  # noqa: ANN202
        engine = LLMEngine(ckpt, EngineConfig(device="cuda", kernels="triton", block_size=16, max_num_seqs=8,
                                              decode_graphs=graphs))
        if spec_config is not None:
            engine.enable_spec(spec_config)
        return engine, engine.generate(_greedy(prompts, lengths))

    _, plain = run(None, "off")
    engine, got = run(spec, "cuda")
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = engine.stats().spec
    assert stats["emitted_tokens"] > stats["verify_steps"], "drafts were accepted"
    pool = engine.runner.verify_graphs
    assert pool is not None and sum(pool.per_shape.values()) == stats["verify_steps"]


@pytest.mark.parametrize("arm,sample", [("3_1_4", False), ("3_2_6", False), ("3_1_4", True)])
def test_cuda_learned_drafter_is_lossless(ckpt, arm, sample) -> None:
    """The learned (EAGLE) drafter drafts on the GPU: its trees must meet the decoder's CPU masks and the cold
    rows' CPU trees (before session 11 the first verify step raised "Expected all tensors to be on the same
    device"). Greedy: the plain tokens exactly; sampled chains (rejection sampling on the device): they run, and
    every completion has its full length."""
    from tlt.model.drafter import Drafter, DrafterConfig

    prompts = _prompts(6, seed=4)
    lengths = [16, 5, 11, 9, 14, 3]

    def run(with_spec: bool):  # noqa: ANN202
        engine = LLMEngine(ckpt, EngineConfig(device="cuda", block_size=16, max_num_seqs=8))
        if with_spec:
            torch.manual_seed(0)
            cfg = DrafterConfig.from_model_config(engine.model_config)
            drafter = Drafter(cfg, engine.model.embed, engine.model.lm_head).to(engine.model.device).eval()
            engine.enable_spec(SpecConfig(mode="static", static_arm=arm, drafter="learned", threshold=64,
                                          hysteresis_steps=1, drafter_path="(in memory)"), drafter)
        if sample:
            reqs = [GenerationRequest(f"s{i}", p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i))
                    for i, (p, n) in enumerate(zip(prompts, lengths))]
        else:
            reqs = _greedy(prompts, lengths)
        return engine, engine.generate(reqs)

    engine, got = run(True)
    assert engine.stats().spec["verify_steps"] > 0
    if sample:
        assert [len(o.token_ids) for o in got] == lengths
    else:
        _, plain = run(False)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]


@pytest.mark.parametrize("sample", [False, True])
def test_cuda_drafter_chain_graphs_draft_as_the_eager_chain(ckpt, sample) -> None:
    """Chain drafting replayed from CUDA graphs (SpecConfig.drafter_graphs = "cuda", tlt/model/drafter_graphs.py;
    written in session 31 after its device time was spent, first run here): greedy requests emit the plain
    tokens, and greedy and seeded sampled requests emit what the eager chain's engine emits (the same drafts);
    the graphs were captured and replayed. fp32, as the other engine tests."""
    from tlt.model.drafter import Drafter, DrafterConfig

    prompts = _prompts(6, seed=5)
    lengths = [16, 5, 11, 9, 14, 3]

    def requests():  # noqa: ANN202
        if sample:
            return [GenerationRequest(f"s{i}", p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i))
                    for i, (p, n) in enumerate(zip(prompts, lengths))]
        return _greedy(prompts, lengths)

    def run(graphs: str):  # noqa: ANN202
        engine = LLMEngine(ckpt, EngineConfig(device="cuda", block_size=16, max_num_seqs=8))
        torch.manual_seed(0)
        cfg = DrafterConfig.from_model_config(engine.model_config)
        drafter = Drafter(cfg, engine.model.embed, engine.model.lm_head).to(engine.model.device).eval()
        engine.enable_spec(SpecConfig(mode="static", static_arm="4_1_5", drafter="learned", threshold=8,
                                      hysteresis_steps=1, drafter_path="(in memory)", drafter_graphs=graphs), drafter)
        return engine, [o.token_ids for o in engine.generate(requests())]

    _, eager = run("off")
    engine, got = run("cuda")
    assert got == eager
    graphs = engine.spec_decoder.source.graphs
    assert graphs.captures > 0 and graphs.replays > 0
    # the drafter cache grown (as a long sequence grows it): the graphs hold its old addresses and are dropped,
    # then captured again, in a new pool (session 32: capturing into the released pool's handle tripped the
    # caching allocator's `use_count > 0` assert); the same requests again emit the same tokens
    captured = graphs.captures
    engine.spec_decoder.source.cache.ensure(2 * engine.spec_decoder.source.cache.capacity)
    assert [o.token_ids for o in engine.generate(requests())] == eager
    assert graphs.captures > captured
    assert engine.stats().spec["verify_steps"] > 0
