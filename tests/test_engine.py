"""Native engine greedy decoding equals `transformers` generate, whatever the batch and under preemption.

A random-initialised Qwen2 checkpoint (small, with the task tokenizer) is
written in the test; the reference is `transformers` greedy `generate` of
each prompt alone (eos stops it, as it stops the engine). Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.types import FinishReason, GenerationRequest, SamplingParams

torch.set_num_threads(1)
MAX_NEW = 16
NUM_PROMPTS = 50


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("engine") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                             seed=0, weight_scale=0.05)


@pytest.fixture(scope="module")
def prompts(ckpt):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (NUM_PROMPTS,), generator=g).tolist()
    return [tuple(torch.randint(3, 250, (n,), generator=g).tolist()) for n in lengths]


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def _requests(prompts, tag="r"):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return [GenerationRequest(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_greedy_matches_transformers(ckpt, prompts, reference, batch):
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=256, block_size=8))
    outs = engine.generate(_requests(prompts))
    mismatched = [i for i, (o, r) in enumerate(zip(outs, reference)) if o.token_ids != r]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    for o, r in zip(outs, reference):
        eos = set(engine.model_config.eos_token_ids)
        assert o.finish_reason == (FinishReason.STOP if r[-1] in eos else FinishReason.LENGTH)
    assert engine.stats().running == 0 and engine.stats().kv_usage == 0.0


def test_greedy_under_preemption_and_chunking(ckpt, prompts, reference):
    """A KV cache far too small for the batch forces preempt-and-recompute; tokens must not change."""
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=40, block_size=4, num_kv_blocks=40)
    engine = LLMEngine(ckpt, cfg)
    outs = engine.generate(_requests(prompts))
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert engine.block_manager.num_free == 40


def test_result_does_not_depend_on_batch_neighbours(ckpt, prompts, reference):
    """The same prompt alone, or added mid-flight among others, gives the same tokens."""
    engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=16, block_size=8))
    for r in _requests(prompts[:10], "a"):
        engine.add_request(r)
    got = {}
    for _ in range(5):
        for c in engine.step()[1]:
            got[c.request_id] = c.token_ids
    late = _requests(prompts[10:20], "b")
    for r in late:
        engine.add_request(r)
    while engine.has_unfinished():
        _, done = engine.step()
        for c in done:
            got[c.request_id] = c.token_ids
    assert [got[f"a{i}"] for i in range(10)] == reference[:10]
    assert [got[f"b{i}"] for i in range(10)] == reference[10:20]


def test_grpo_samples_prefill_their_prompt_once(ckpt, prompts, reference):
    """n = 6 greedy samples of each prompt (block size 16, so most prompts end in a partial block): every
    sample is transformers' continuation, and the tokens computed for the prompts are each prompt once
    plus one last token per further sample (full blocks shared, partial tails copied), where sharing
    full blocks alone recomputes every sample's partial tail."""
    n, chosen = 6, list(range(12))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    reqs = [GenerationRequest(f"g{i}", prompts[i], params, n=n) for i in chosen]
    computed = {}
    for sharing in (True, False):
        engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=128, max_num_batched_tokens=1024, block_size=16,
                                              prefix_sharing=sharing))
        prompt_tokens = [0]
        run = engine.runner.run

        def counting(batch, run=run, prompt_tokens=prompt_tokens):  # noqa: ANN001, ANN202
            prompt_tokens[0] += sum(k for k, s in zip(batch.num_new, batch.seqs) if s.num_computed < s.prompt_len)
            return run(batch)

        engine.runner.run = counting
        for r in reqs:
            engine.add_request(r)
        got: dict[str, dict[int, list[int]]] = {}
        while engine.has_unfinished():
            for c in engine.step()[1]:
                got.setdefault(c.request_id, {})[c.sample_index] = c.token_ids
        assert all(got[f"g{i}"] == {k: reference[i] for k in range(n)} for i in chosen)
        computed[sharing] = (prompt_tokens[0], engine.stats().prefix_tail_copies)
    tails = sum(1 for i in chosen if (len(prompts[i]) - 1) % 16)  # prompts whose last token is not first in its block
    assert computed[True] == (sum(len(prompts[i]) for i in chosen) + (n - 1) * len(chosen), (n - 1) * tails)
    assert computed[False] == (n * sum(len(prompts[i]) for i in chosen), 0)
