"""Native engine: seeded sampling, n samples with shared prompt blocks, stop rules, logprobs, features,
weight swaps and request validation (stop strings and detokenisation: test_engine_stop.py).

A random-initialised Qwen2 checkpoint with the task tokenizer is written in
the test; references are computed with `transformers` forward passes and
the shared `filter_logits`. Nothing is faked.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tlt.model.loader import CheckpointError
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.spec.filters import filter_logits
from tlt.services.rollout.types import FinishReason, GenerationRequest, SamplingParams

torch.set_num_threads(1)
PROMPT = tuple(range(20, 60))  # 40 tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("sampling") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                             seed=1, weight_scale=0.05)


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()


def make(ckpt, **kw):
    kw.setdefault("block_size", 8)
    return LLMEngine(ckpt, EngineConfig(**kw))


SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=1234, max_tokens=24, ignore_eos=True)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(ckpt):
    alone = make(ckpt).generate([GenerationRequest("x", PROMPT, SAMPLED, n=4)])
    assert len({tuple(c.token_ids) for c in alone}) > 1, "the n samples of one request must differ"
    crowded = make(ckpt, max_num_seqs=16)
    others = [GenerationRequest(f"o{i}", tuple(range(5, 15 + i)), SamplingParams(temperature=1.0, max_tokens=30,
                                                                                  ignore_eos=True)) for i in range(6)]
    outs = crowded.generate(others[:3] + [GenerationRequest("x", PROMPT, SAMPLED, n=4)] + others[3:])
    mine = [c for c in outs if c.request_id == "x"]
    assert [c.token_ids for c in mine] == [c.token_ids for c in alone]
    tight = make(ckpt, max_num_seqs=16, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32)
    outs = tight.generate(others + [GenerationRequest("x", PROMPT, SAMPLED, n=4)])
    assert tight.stats().num_preemptions > 0
    assert [c.token_ids for c in outs if c.request_id == "x"] == [c.token_ids for c in alone]



def test_a_negative_seed_does_not_share_a_positive_seeds_stream(ckpt):
    """torch's CPU generator kept only the low 32 bits of its seed, and `seed_for` reduced modulo 2**63 - 1
    (-1 modulo 2**32): every negative seed got the stream of a positive one, seed -1 that of 2273207700 (and
    seed -200000000 that of 2073207701, both int32). Keys are now 64-bit (counter-based uniforms): each
    int64 seed has its own stream for a given sample index."""
    from tlt.services.rollout.engine.sequence import Sequence
    from tlt.services.rollout.spec.rng import counter_uniforms, key_tensor

    def outputs(seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return [c.token_ids for c in make(ckpt).generate([GenerationRequest("s", PROMPT, params, n=2)])]

    assert outputs(-1) != outputs(2273207700)
    assert outputs(-1) == outputs(-1)  # still reproducible

    def stream(seed: int, sample_index: int = 0) -> list[float]:
        seq = Sequence("r", sample_index, (1,), SamplingParams(temperature=1.0), 4, seed, frozenset())
        return counter_uniforms(key_tensor([seq.rng_key]), torch.arange(4)[None])[0].tolist()

    inv = pow(1_000_003, -1, 2**32)
    for s in (-1, -2, -7919, -200000000, -(2**31)):
        partner = (s - inv) % 2**32  # the seed whose stream a negative seed shared before
        assert stream(s) != stream(partner), (s, partner)
        assert stream(s) != stream(s, 1)  # the samples of one request differ
        assert stream(s) != stream(s + 2**32)  # seeds equal modulo 2**32 (shared a generator seed) differ

def test_n_samples_share_full_prompt_blocks_and_copy_the_partial_one(ckpt):
    engine = make(ckpt, block_size=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request(GenerationRequest("g", PROMPT, greedy, n=4))
    bm = engine.block_manager
    engine.step()  # the first sample prefills the prompt; the others wait a step for its last block
    assert bm.shared_hits == 0 and bm.num_blocks - bm.num_free == 5 and len(engine.scheduler.waiting) == 3
    engine.step()
    # 40 tokens = 5 blocks; the 4 full blocks before the last token are shared, the 5th is per sample, its
    # first 7 tokens' K/V copied from the first sample's: each other sample computes only the 40th token
    assert bm.shared_hits == 3 * 4 and bm.tail_copies == 3
    first, *others = engine.scheduler.running
    assert all(s.block_table[:4] == first.block_table[:4] and len(s.block_table) == 5 for s in others)
    assert len({s.block_table[4] for s in (first, *others)}) == 4
    outs = []
    while engine.has_unfinished():
        outs += engine.step()[1]
    single = make(ckpt).generate([GenerationRequest("s", PROMPT, greedy)])[0]
    assert all(c.token_ids == single.token_ids for c in outs) and len(outs) == 4


def test_stop_string_stop_token_max_tokens(ckpt):
    engine = make(ckpt)
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = engine.generate([GenerationRequest("f", PROMPT, base)])[0]
    assert full.finish_reason is FinishReason.LENGTH and len(full.token_ids) == 40
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and len(text) > 10
    out = engine.generate([GenerationRequest("s", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                                         stop=(stop,)))])[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == text[: text.find(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 40
    tok = full.token_ids[5]
    out = engine.generate([GenerationRequest("t", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                                         stop_token_ids=(tok,)))])[0]
    first = full.token_ids.index(tok)
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason is FinishReason.STOP
    out = engine.generate([GenerationRequest("m", PROMPT, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))])[0]
    assert out.token_ids == full.token_ids[:7] and out.finish_reason is FinishReason.LENGTH


def test_eos_and_ignore_eos(ckpt, tmp_path):
    """Declare a token the model emits as eos: it stops there unless ignore_eos."""
    full = make(ckpt).generate([GenerationRequest("f", PROMPT, SamplingParams(temperature=0.0, max_tokens=20,
                                                                                ignore_eos=True))])[0]
    eos = full.token_ids[6]
    copy = tmp_path / "eos"
    shutil.copytree(ckpt, copy)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((copy / name).read_text())
        cfg["eos_token_id"] = eos
        (copy / name).write_text(json.dumps(cfg))
    engine = make(copy)
    stopped = engine.generate([GenerationRequest("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=20))])[0]
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    kept = engine.generate([GenerationRequest("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=20,
                                                                           ignore_eos=True))])[0]
    assert kept.token_ids == full.token_ids and kept.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=10, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
])
def test_logprobs_and_features_match_reference(ckpt, hf, params):
    engine = make(ckpt)
    out = engine.generate([GenerationRequest("l", PROMPT, params.__class__(**{**params.__dict__, "return_features": True}))])[0]
    ids = torch.tensor([PROMPT + tuple(out.token_ids)])
    with torch.no_grad():
        res = hf(ids, output_hidden_states=True)
    n0 = len(PROMPT) - 1
    logits = res.logits[0, n0 : n0 + len(out.token_ids)]
    if params.greedy:
        ref = torch.log_softmax(logits, -1)
        assert out.token_ids == logits.argmax(-1).tolist()
    else:
        ref = torch.log_softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p), -1)
    chosen = ref[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    assert torch.allclose(torch.tensor(out.logprobs), chosen, atol=1e-4)
    for i, top in enumerate(out.top_logprobs):
        vals, idx = ref[i].topk(params.logprobs)
        assert list(top) == idx.tolist() and torch.allclose(torch.tensor(list(top.values())), vals, atol=1e-4)
    feats = out.features
    assert feats.dtype == torch.float16 and feats.shape == (len(out.token_ids), 64)
    want = res.hidden_states[-1][0, n0 : n0 + len(out.token_ids)]
    assert torch.allclose(feats.float(), want, atol=2e-3)


def test_update_weights_validates_then_applies_atomically(ckpt, hf):
    engine = make(ckpt)
    req = lambda rid: GenerationRequest(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    before = engine.generate([req("a")])[0]
    expected = engine.expected_weights()
    assert expected["model.norm.weight"] == ((64,), torch.float32)
    new_head = hf.lm_head.weight.detach().flip(0).clone()
    with pytest.raises(CheckpointError, match="expected shape"):
        engine.update_weights("policy", {"lm_head.weight": new_head, "model.norm.weight": torch.ones(63)}, 1)
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        engine.update_weights("policy", {"lm_head.weight": new_head, "bogus": torch.ones(1)}, 1)
    with pytest.raises(CheckpointError, match="dtype"):
        engine.update_weights("policy", {"lm_head.weight": new_head.double()}, 1)
    assert engine.versions.policy == 0
    assert engine.generate([req("b")])[0].token_ids == before.token_ids
    # a swap while a request is in flight: it continues with the new weights and says so
    engine.add_request(req("c"))
    engine.step()
    engine.step()
    engine.update_weights("policy", {"lm_head.weight": new_head}, 7)
    done = []
    while engine.has_unfinished():
        done += engine.step()[1]
    assert done[0].versions.policy == 7 and done[0].versions.policy_min == 0
    after = engine.generate([req("d")])[0]
    assert after.versions.policy == 7 and after.versions.policy_min is None
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state[0, -1]
    assert after.token_ids[0] == int((new_head @ hidden).argmax())


def test_weight_update_invalidates_cached_prefix_blocks(ckpt, hf):
    """Prompt blocks cached under the old weights must not be reused for a request after a policy swap."""
    import copy

    engine = make(ckpt)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    engine.generate([GenerationRequest("old", PROMPT, greedy)])  # leaves PROMPT's full blocks cached
    name = "model.layers.0.self_attn.v_proj.weight"  # changes every cached K/V of the prompt
    new = torch.randn(engine.expected_weights()[name][0], generator=torch.Generator().manual_seed(3)) * 0.5
    engine.update_weights("policy", {name: new}, 1)
    out = engine.generate([GenerationRequest("new", PROMPT, greedy)])[0]
    ref_model = copy.deepcopy(hf)
    with torch.no_grad():
        ref_model.model.layers[0].self_attn.v_proj.weight.copy_(new)
        logits = ref_model(torch.tensor([PROMPT + tuple(out.token_ids)])).logits[0, len(PROMPT) - 1 : -1]
    assert out.token_ids == logits.argmax(-1).tolist()
    ref_lp = torch.log_softmax(logits, -1)[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
    assert torch.allclose(torch.tensor(out.logprobs), ref_lp, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: logits on the GPU, counter uniforms drawn there")
def test_sampling_cuda_logits_with_the_sequences_cpu_generators():
    """Sampling GPU logits gives the CPU's tokens (it once raised: sequences owned CPU generators; the counter
    uniforms are now computed on the logits' device, bit for bit the same integers)."""
    from tlt.services.rollout.engine.sampler import sample
    from tlt.services.rollout.engine.sequence import Sequence

    seqs = [Sequence("c", i, (1, 2), SAMPLED if i else SamplingParams(temperature=0.0, logprobs=1), 4, 7, frozenset())
            for i in range(3)]
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    on_cpu = sample(logits, [Sequence("c", i, (1, 2), s.params, 4, 7, frozenset()) for i, s in enumerate(seqs)])
    on_gpu = sample(logits.cuda(), seqs)  # raised "Expected a 'cuda' device type for generator" before the fix
    assert on_gpu.token_ids[0] == int(logits[0].argmax())
    assert on_gpu.token_ids == on_cpu.token_ids


def test_add_request_rejects_bad_requests_and_abort_frees(ckpt):
    engine = make(ckpt, max_model_len=64)
    ok = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(GenerationRequest("e", (), ok))
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request(GenerationRequest("l", tuple(range(64)), ok))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(GenerationRequest("m", tuple(range(10)), SamplingParams(max_tokens=60)))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request(GenerationRequest("t", (1, 2), SamplingParams(temperature=-1)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(GenerationRequest("v", (1, 10**6), ok))
    with pytest.raises(ValueError, match="integers"):  # a float id passed here, then broke every later step
        engine.add_request(GenerationRequest("f", tuple(float(t) for t in PROMPT), ok))
    engine.add_request(GenerationRequest("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=10), n=3))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(GenerationRequest("a", PROMPT, ok))
    engine.step()  # the first sample prefills; the others copy its last block's K/V next step
    assert engine.stats().running == 1 and engine.stats().queued == 2 and engine.stats().kv_usage > 0
    engine.step()
    assert engine.stats().running == 3
    engine.abort_request("a")
    assert not engine.has_unfinished() and engine.stats().kv_usage == 0.0


def test_generate_leaves_nothing_running_when_a_later_request_is_refused(ckpt):
    engine = make(ckpt, max_model_len=64)
    good = GenerationRequest("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="context limit"):  # refused by add_request's own checks, after "good"
        engine.generate([good, GenerationRequest("long", tuple(range(64)))])
    assert not engine.has_unfinished() and engine.stats().kv_usage == 0.0
    (c,) = engine.generate([good])  # and the good one can be sent again
    assert len(c.token_ids) == 4


def test_unseeded_requests_draw_per_host_and_repeat_on_one(ckpt, monkeypatch):
    """Servers started from one config (pods) drew the same samples for their i-th unseeded requests."""
    import socket

    req = GenerationRequest("x", PROMPT, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), n=4)

    def samples(host: str) -> list[tuple[int, ...]]:
        monkeypatch.setattr(socket, "gethostname", lambda: host)
        return [tuple(c.token_ids) for c in make(ckpt).generate([req])]

    pod0 = samples("rollout-0")
    assert len(set(pod0)) == 4
    assert samples("rollout-0") == pod0  # a rerun on the same host repeats its draws
    assert not set(samples("rollout-1")) & set(pod0)


def test_a_max_model_len_past_the_models_context_is_refused(ckpt):
    from tlt.services.common.config import ConfigError

    with pytest.raises(ConfigError, match="max_model_len 512 is past the model's context 256"):
        make(ckpt, max_model_len=512)
    assert make(ckpt, max_model_len=256).max_model_len == 256 and make(ckpt).max_model_len == 256


def test_engine_needs_a_tokenizer(ckpt, tmp_path):
    copy = tmp_path / "notok"
    shutil.copytree(ckpt, copy)
    for f in copy.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        make(copy)


def test_sample_a_mixed_greedy_and_sampled_batch_on_the_cpu():
    """Greedy rows beside sampled rows keep the argmax and the raw log-softmax; a sampled row's logprobs are those of
    the filtered distribution it was drawn from; logprobs=0 asks for no alternatives (None), k > 0 for k."""
    from tlt.services.rollout.engine.sampler import sample
    from tlt.services.rollout.engine.sequence import Sequence

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 0.0],    # greedy, logprobs=0: argmax 1
                           [3.0, 1.0, 2.5, -2.0, 0.0],    # sampled, top_k=1: only token 0 survives -> q = one-hot
                           [-1.0, 0.0, 1.0, 4.0, 0.5]])   # greedy, logprobs=2: argmax 3
    params = [SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.8, top_k=1, seed=5, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=2)]
    seqs = [Sequence("m", i, (1, 2, 3), p, 4, 5, frozenset()) for i, p in enumerate(params)]
    before = logits.clone()
    out = sample(logits, seqs)
    assert out.token_ids == [1, 0, 3]
    assert torch.equal(logits, before)  # the caller's logits are not overwritten by the filtered ones
    raw = before.log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(float(raw[0, 1]), abs=1e-6)
    assert out.logprobs[2] == pytest.approx(float(raw[2, 3]), abs=1e-6)
    assert out.logprobs[1] == pytest.approx(0.0, abs=1e-6)  # log q(0) = log 1 under top_k = 1
    assert out.top_logprobs[0] is None
    assert set(out.top_logprobs[2]) == {3, 2}
    assert out.top_logprobs[2][2] == pytest.approx(float(raw[2, 2]), abs=1e-6)
    assert out.top_logprobs[1][0] == pytest.approx(0.0, abs=1e-6)
    assert len(out.top_logprobs[1]) == 2 and min(out.top_logprobs[1].values()) == float("-inf")
