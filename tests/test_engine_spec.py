"""The engine step with a SpecDecoder attached (n-gram drafts): greedy output identical to plain
decoding, multi-token emissions respect max_tokens / stop ids, counters and features stay consistent.

Random-initialised Qwen2 checkpoint written in the test; nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.types import FinishReason, GenerationRequest, SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("spec") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                             seed=2, weight_scale=0.03)


def _prompts():
    g = torch.Generator().manual_seed(3)
    # repetitive prompts so the n-gram drafter finds matches
    out = []
    for i in range(6):
        motif = torch.randint(3, 250, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append(tuple((motif * 12)[: 20 + 3 * i]))
    return out


def test_spec_greedy_equals_plain(ckpt):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0, return_features=True)
    reqs = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(_prompts())]
    plain = LLMEngine(ckpt, EngineConfig(block_size=8)).generate(reqs)
    spec_engine = LLMEngine(ckpt, EngineConfig(block_size=8))
    spec_engine.enable_spec(SpecConfig(mode="static", static_arm="4_2_8", threshold=64, hysteresis_steps=1,
                                       drafter="ngram"))
    spec = spec_engine.generate(reqs)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids) and b.features.shape[0] == len(b.token_ids)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-3)
    verified = sum(c.spec.verify_steps for c in spec)
    accepted = sum(c.spec.accepted_tokens for c in spec)
    assert verified > 0 and accepted > verified, "n-gram drafts on repetitive text must get accepted"
    stats = spec_engine.stats().spec
    assert stats["verify_steps"] > 0 and spec_engine.stats().kv_usage == 0.0


def test_spec_respects_max_tokens_and_stop_ids(ckpt):
    engine = LLMEngine(ckpt, EngineConfig(block_size=8))
    engine.enable_spec(SpecConfig(mode="static", static_arm="4_2_8", threshold=64, hysteresis_steps=1, drafter="ngram"))
    base = engine.generate([GenerationRequest("b", _prompts()[0], SamplingParams(temperature=0.0, max_tokens=30,
                                                                                  ignore_eos=True))])[0]
    for n in (1, 5, 13, *range(2, 30, 3)):
        out = engine.generate([GenerationRequest(f"m{n}", _prompts()[0], SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True))])[0]
        assert out.token_ids == base.token_ids[:n] and out.finish_reason is FinishReason.LENGTH
        # every kept token is counted once: by a plain step or as accepted by a verify pass (not the
        # tokens of an accepted path that max_tokens cut)
        assert out.spec.accepted_tokens + out.spec.plain_decode_steps == n
    tok = base.token_ids[9]
    out = engine.generate([GenerationRequest("s", _prompts()[0], SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(tok,)))])[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    assert out.finish_reason is FinishReason.STOP


def test_ngram_indexes_are_dropped_when_a_request_is_over(ckpt):
    """A finished or aborted request's n-gram index is never read again: the engine must drop it (it costs
    ~1 KB per token; keeping the last 1024 requests grew replicas by GBs with RL-sized groups)."""
    engine = LLMEngine(ckpt, EngineConfig(block_size=8))
    engine.enable_spec(SpecConfig(mode="static", static_arm="4_2_8", threshold=64, hysteresis_steps=1, drafter="ngram"))
    groups = engine.spec_decoder.source.groups
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    engine.generate([GenerationRequest(f"g{i}", p, params, n=3) for i, p in enumerate(_prompts())])
    assert len(groups) == 0
    engine.add_request(GenerationRequest("aborted", _prompts()[1], params, n=3))
    engine.add_request(GenerationRequest("kept", _prompts()[2], params, n=3))
    for _ in range(4):
        engine.step()
    assert {"aborted", "kept"} <= set(groups), "both requests draft while they run"
    engine.abort_request("aborted")
    assert set(groups) == {"kept"}
    while engine.has_unfinished():
        engine.step()
    assert len(groups) == 0


def test_a_seeded_sample_does_not_depend_on_what_else_is_in_its_batch(ckpt):
    """A seeded request gives the same tokens alone and batched with others, with speculation on as
    without (sampler.py, accept.py, rng.py: each uniform is a function of the sequence's key and position).
    Each verify step used to draw one uniform per node of the batch's LARGEST tree for every row, so a sequence's
    stream, hence its sampled tokens, changed with the trees of unrelated requests beside it."""
    spec = SpecConfig(mode="static", static_arm="4_2_8", threshold=64, hysteresis_steps=1, drafter="ngram")
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=123)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def run(others):
        engine = LLMEngine(ckpt, EngineConfig(block_size=8))
        engine.enable_spec(spec)
        reqs = [GenerationRequest("A", _prompts()[0], params)]
        reqs += [GenerationRequest(f"o{i}", p, greedy) for i, p in enumerate(others)]
        out = engine.generate(reqs)[0].token_ids
        assert engine.stats().spec["verify_steps"] > 5
        return out

    assert run([]) == run(_prompts()[1:4])


def test_a_temperature_that_would_overflow_is_refused_at_add_request(ckpt):
    """temperature 1e-40 is > 0 but logits / 1e-40 overflow float32: the filters gave NaN and the engine step
    raised (in torch.multinomial) for every request of the batch, killing a replica. SamplingParams.validate
    refuses 0 < T < 1e-20 (a 400 at the servers) before a request reaches a step; T = 0 is greedy."""
    engine = LLMEngine(ckpt, EngineConfig(block_size=8))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(GenerationRequest("t", _prompts()[0], SamplingParams(temperature=1e-40, max_tokens=4)))
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request(GenerationRequest("k", _prompts()[0], SamplingParams(top_k=10**30, max_tokens=4)))
    assert not engine.has_unfinished()
    out = engine.generate([GenerationRequest("ok", _prompts()[0], SamplingParams(temperature=1e-20, max_tokens=4))])
    assert len(out[0].token_ids) == 4


def test_a_prefill_chunk_cut_to_one_token_is_not_speculated(ckpt):
    """The scheduler cuts a new prompt's first chunk to the token budget left after the running decodes.
    Left with one token, the chunk is one new token like a decode (`is_decode_only`), but the sequence is
    not in decode state: speculating it raised ValueError and killed the step. It runs plainly, and the
    output is plain greedy's."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [GenerationRequest(f"r{i}", (5 + i, 6, 7), params) for i in range(15)]
    late = GenerationRequest("late", tuple(range(3, 13)), params)
    # 16 tokens a step: 15 decodes leave one token for the late prompt's first chunk
    config = EngineConfig(block_size=8, max_num_batched_tokens=16)
    plain = LLMEngine(ckpt, config).generate([*first, late])
    engine = LLMEngine(ckpt, config)
    engine.enable_spec(SpecConfig(mode="static", static_arm="3_1_4", threshold=32, hysteresis_steps=1, drafter="ngram"))
    for r in first:
        engine.add_request(r)
    for _ in range(4):  # every prompt prefilled; from here on 15 decodes a step
        engine.step()
    engine.add_request(late)
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c.token_ids) for c in engine.step()[1])
    assert done == {c.request_id: c.token_ids for c in plain}
    assert engine.stats().spec["verify_steps"] > 0


def _check_blocks(engine: LLMEngine) -> None:
    """Every KV block's ref count is the number of live sequences holding it, and it is free iff that is 0."""
    from collections import Counter

    bm = engine.block_manager
    held = Counter(b for s in engine.scheduler.running for b in s.block_table)
    assert all(not s.block_table for s in engine.scheduler.waiting)
    for b in bm.blocks:
        assert b.ref_count == held.get(b.id, 0) and (b.id in bm.free) == (b.ref_count == 0), b.id


def test_speculation_under_preemption_and_prefix_sharing(ckpt):
    """Tree speculation in a KV cache too small for the batch: sequences are preempted mid-speculation
    (their draft blocks freed) and recomputed, siblings share prompt blocks, accepted side branches are
    copied (kv_copies). Seeded samples stay token-identical to plain decoding in a roomy cache, every block
    is accounted for after every step, and a second wave of the same prompts, reusing the cached prefix
    blocks the first wave's speculating sequences left, is identical too."""
    params = SamplingParams(temperature=0.9, top_k=6, seed=11, max_tokens=30, ignore_eos=True, logprobs=0)
    waves = [[GenerationRequest(f"{w}{i}", p, params, 3) for i, p in enumerate(_prompts()[:4])] for w in "ab"]
    plain = LLMEngine(ckpt, EngineConfig(block_size=4)).generate(waves[0])
    engine = LLMEngine(ckpt, EngineConfig(block_size=4, num_kv_blocks=26))
    engine.enable_spec(SpecConfig(mode="static", static_arm="4_2_8", threshold=64, hysteresis_steps=1, drafter="ngram"))
    for wave in waves:
        for r in wave:
            engine.add_request(r)
        done = {}
        while engine.has_unfinished():
            done.update(((c.request_id[1:], c.sample_index), c) for c in engine.step()[1])
            _check_blocks(engine)
        assert [done[(c.request_id[1:], c.sample_index)].token_ids for c in plain] == [c.token_ids for c in plain]
        assert all(done[(c.request_id[1:], c.sample_index)].logprobs == pytest.approx(c.logprobs, abs=1e-4) for c in plain)
        assert engine.block_manager.num_free == 26
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_blocks > 0
    assert stats.spec["verify_steps"] > 0 and stats.spec["kv_copies"] > 0


def test_a_learned_drafter_loaded_at_start_is_version_0_and_ngram_is_none(ckpt):
    """common.proto: drafter version 0 = the weights loaded at start, -1 = none. The native engine stamped -1
    on every completion until the first push even when `--drafter DIR` had loaded a drafter (the SGLang
    backend said 0), so a client could not tell a served drafter from none."""
    from tlt.model.drafter import Drafter, DrafterConfig

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = {"mode": "static", "static_arm": "4_2_8", "threshold": 64, "hysteresis_steps": 1}
    learned = LLMEngine(ckpt, EngineConfig(block_size=8))
    drafter = Drafter(DrafterConfig.from_model_config(learned.model_config), learned.model.embed,
                      learned.model.lm_head).eval()
    learned.enable_spec(SpecConfig(**base, drafter="learned", drafter_path="(in memory)"), drafter)
    ngram = LLMEngine(ckpt, EngineConfig(block_size=8))
    ngram.enable_spec(SpecConfig(**base, drafter="ngram"))
    for engine, want in ((learned, 0), (ngram, -1), (LLMEngine(ckpt, EngineConfig(block_size=8)), -1)):
        out = engine.generate([GenerationRequest("v", _prompts()[0], greedy)])
        assert out[0].versions.drafter == want and engine.stats().versions.drafter == want
    learned.update_weights("drafter", {k: v.detach().clone() for k, v in drafter.state_dict().items()}, 3)
    assert learned.generate([GenerationRequest("w", _prompts()[0], greedy)])[0].versions.drafter == 3


def test_rejection_sampled_chains_do_not_depend_on_a_greedy_neighbour(ckpt):
    """chain_sampling (learned chains verified by rejection sampling) applied to a step only when EVERY sequence
    sampled and EVERY drafter row was warm; otherwise the whole batch fell back to the tree walk, which emits other
    tokens for the same key. So a seeded request's samples changed with a greedy request beside it. Now each row
    takes its own path (a cold row's: tests/test_spec_eagle.py). A step that decodes plainly (a newcomer's prefill
    beside it) still emits plain decoding's token: SpecConfig.chain_sampling says so. Also: the rejection path's
    logprobs were the log of a float32 softmax, -inf wherever a probability underflowed; now log_softmax, as plain
    sampling's."""
    from tlt.model.drafter import Drafter, DrafterConfig

    spec = SpecConfig(mode="static", static_arm="4_1_5", threshold=64, hysteresis_steps=1, drafter="learned",
                      drafter_path="(in memory)", chain_sampling=True, verify_token_budget=0)
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=123, logprobs=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def engine(with_spec: bool = True) -> LLMEngine:
        e = LLMEngine(ckpt, EngineConfig(block_size=8))
        if with_spec:
            torch.manual_seed(0)
            e.enable_spec(spec, Drafter(DrafterConfig.from_model_config(e.model_config), e.model.embed,
                                        e.model.lm_head).eval())
        return e

    def run(others):
        e = engine()
        out = e.generate([GenerationRequest("A", _prompts()[0], params),
                          *(GenerationRequest(f"o{i}", p, greedy) for i, p in enumerate(others))])
        assert e.stats().spec["verify_steps"] > 5
        return {c.request_id: c for c in out}

    alone = run([])["A"]
    assert all(lp > -1e4 for lp in alone.logprobs) and all(v > -1e4 for t in alone.top_logprobs for v in t.values())
    crowded = run(_prompts()[1:4])
    assert crowded["A"].token_ids == alone.token_ids
    plain = engine(with_spec=False).generate([GenerationRequest(f"o{i}", p, greedy) for i, p in enumerate(_prompts()[1:4])])
    assert [crowded[f"o{i}"].token_ids for i in range(3)] == [c.token_ids for c in plain]  # greedy stays lossless


def test_a_reproducible_request_emits_plain_decodings_tokens_under_rejection_sampled_chains(ckpt):
    """SamplingParams.reproducible: a seeded request takes the tree walk even where chain_sampling would verify its
    chain by rejection sampling, so its tokens are plain decoding's for the seed whatever the drafter (the trainer's
    evals pair their samples by these uniforms). The same request without it emits other tokens (rejection sampling's
    residual draws use their own uniforms): what the flag changes. Its neighbour in the batch, not reproducible, keeps
    rejection sampling (per row), and the wire formats carry the flag."""
    import dataclasses

    from tlt.model.drafter import Drafter, DrafterConfig
    from tlt.services.rollout.grpc_api import sampling_params
    from tlt.services.rollout.openai_schema import CompletionRequest
    from tlt.v1 import rollout_pb2

    spec = SpecConfig(mode="static", static_arm="4_1_5", threshold=64, hysteresis_steps=1, drafter="learned",
                      drafter_path="(in memory)", chain_sampling=True, verify_token_budget=0)
    loose = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=77)
    exact = dataclasses.replace(loose, reproducible=True)

    def run(params: SamplingParams, with_spec: bool = True) -> list[tuple[int, ...]]:
        e = LLMEngine(ckpt, EngineConfig(block_size=8))
        if with_spec:
            torch.manual_seed(0)
            e.enable_spec(spec, Drafter(DrafterConfig.from_model_config(e.model_config), e.model.embed,
                                        e.model.lm_head).eval())
        out = e.generate([GenerationRequest("A", _prompts()[0], params, n=3),
                          GenerationRequest("B", _prompts()[1], loose, n=2)])
        if with_spec:
            assert e.stats().spec["verify_steps"] > 5
        return [tuple(c.token_ids) for c in sorted(out, key=lambda c: (c.request_id, c.sample_index))]

    plain = run(loose, with_spec=False)
    assert run(exact)[:3] == plain[:3]
    assert run(loose)[:3] != plain[:3]  # rejection-sampled chains: exact in distribution, other tokens
    assert run(exact)[3:] == run(loose)[3:] != plain[3:]  # B is not reproducible: still rejection sampled
    assert sampling_params(rollout_pb2.SamplingParams(reproducible=True)).reproducible
    assert not sampling_params(rollout_pb2.SamplingParams()).reproducible
    body = CompletionRequest(model="m", prompt="1", reproducible=True)
    assert body.sampling_params(8, None).reproducible


def test_a_drafter_that_overflows_on_a_tree_arm_keeps_the_target_output(ckpt, monkeypatch):
    """A drafter push whose weights pass every check (finite, right shapes) but overflow in the activations a few
    levels down: NaN draft log-probs made tree selection drop a kept node's parent, an AssertionError killed the
    step (in a server: the replica, on every restart, since the push is re-applied). Trees now draft around such
    scores and verification keeps the output the target's."""
    import tlt.services.rollout.spec.drafting as drafting
    from tlt.model.drafter import Drafter, DrafterConfig

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = [GenerationRequest(f"r{i}", p, greedy) for i, p in enumerate(_prompts()[:3])]
    plain = [c.token_ids for c in LLMEngine(ckpt, EngineConfig(block_size=8)).generate(requests)]
    seen_nan = []
    build = drafting.build_tree

    def watching(root, expand, arm):
        def wrapped(step, beam, toks):
            lp = expand(step, beam, toks)
            seen_nan.append(bool(torch.isnan(lp).any()))
            return lp
        return build(root, wrapped, arm)

    monkeypatch.setattr(drafting, "build_tree", watching)  # sees the drafter's log-probs, changes nothing
    for scale in (1e2, 1e4):
        e = LLMEngine(ckpt, EngineConfig(block_size=8))
        torch.manual_seed(0)
        drafter = Drafter(DrafterConfig.from_model_config(e.model_config), e.model.embed, e.model.lm_head).eval()
        e.enable_spec(SpecConfig(mode="static", static_arm="8_4_16", threshold=64, hysteresis_steps=1,
                                 drafter="learned", drafter_path="(in memory)", verify_token_budget=0), drafter)
        own = {k: v for k, v in drafter.state_dict().items() if not k.startswith(("embed", "lm_head"))}
        e.update_weights("drafter", {k: v * scale for k, v in own.items()}, 1)  # accepted: finite weights
        out = e.generate(requests)
        assert [c.token_ids for c in out] == plain, scale
        assert e.stats().spec["verify_steps"] > 0
    assert any(seen_nan), "no drafter scale overflowed: the test shows nothing"


def test_a_tree_larger_than_the_draft_room_near_the_context_limit_stays_within_the_block_table(ckpt):
    """The runner's block tables (fixed-width under verify CUDA graphs) hold max_model_len + 128 positions a
    sequence; an arm of more than 128 draft tokens near the context limit reserved blocks past that width (an
    audit: `4_8_200` at the limit). Such a step now decodes plainly (counted in no_room), the output is plain's."""
    greedy = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    prompt = tuple((list(range(7, 40)) * 8)[:150])  # 150 + 100 = 250 of the 256 positions; 200 nodes fit early on
    plain = LLMEngine(ckpt, EngineConfig(block_size=8)).generate([GenerationRequest("a", prompt, greedy)])
    from tlt.model.drafter import Drafter, DrafterConfig

    e = LLMEngine(ckpt, EngineConfig(block_size=8))
    torch.manual_seed(0)
    e.enable_spec(SpecConfig(mode="static", static_arm="4_8_200", threshold=64, hysteresis_steps=1, drafter="learned",
                             drafter_path="(in memory)", verify_token_budget=0),
                  Drafter(DrafterConfig.from_model_config(e.model_config), e.model.embed, e.model.lm_head).eval())
    widest = 0
    reserve = e.spec_decoder._reserve

    def watching(seqs, n_nodes):
        nonlocal widest
        ok = reserve(seqs, n_nodes)
        widest = max([widest] + [len(s.block_table) for s in seqs])
        return ok

    e.spec_decoder._reserve = watching
    out = e.generate([GenerationRequest("a", prompt, greedy)])
    assert widest <= e.runner.max_blocks_per_seq, (widest, e.runner.max_blocks_per_seq)
    assert out[0].token_ids == plain[0].token_ids
    assert e.stats().spec["verify_steps"] > 0 and e.stats().spec["no_room"] > 0
