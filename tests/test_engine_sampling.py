"""Native engine: seeded sampling, n samples with shared prompt blocks, stop rules, logprobs, features,
weight swaps and request validation.

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


class _BytePieces:
    """A byte-level tokenizer in miniature: each token id is a byte string, decoding joins them and replaces a
    split multi-byte character by U+FFFD, as a byte-level BPE tokenizer decodes."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:  # noqa: ANN001, ANN003
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _emit(seq, tokens, tok, max_model_len=100):  # noqa: ANN001, ANN202
    """Append `tokens` one at a time as the engine does, checking after each; the reasons seen."""
    from tlt.services.rollout.engine.stop import check_stop

    reasons = []
    for t in tokens:
        seq.token_ids.append(t)
        reasons.append(check_stop(seq, t, tok, max_model_len))
    return reasons


def _stop_seq(max_tokens=10, eos=frozenset(), prompt=(0,), **params):  # noqa: ANN001, ANN202
    from tlt.services.rollout.engine.sequence import Sequence

    return Sequence("r", 0, prompt, SamplingParams(temperature=0.0, **params), max_tokens=max_tokens, seed=0,
                    eos_ids=eos)


def test_stop_string_whose_last_character_alone_is_new_is_found():
    tok = _BytePieces({0: b"", 1: b"abc", 2: b"d", 3: b"e"})
    seq = _stop_seq(stop=("bcd",))
    # "abc" checked: no match; then "d" completes "bcd", which starts 2 characters before the checked end
    assert _emit(seq, [1, 2], tok) == [None, FinishReason.STOP]
    assert seq.text == "a" and seq.output_ids == [1, 2]


def test_the_earliest_of_several_stop_strings_cuts_the_text():
    tok = _BytePieces({0: b"", 1: b"a", 2: b"bcxyz"})
    seq = _stop_seq(stop=("xyz", "c"))
    assert _emit(seq, [1, 2], tok) == [None, FinishReason.STOP]
    assert seq.text == "ab"  # "c" (at 2) comes before "xyz" (at 3)


def test_a_stop_string_completed_by_the_second_half_of_a_character_is_found():
    tok = _BytePieces({0: b"", 1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"z"})  # "\xc3\xa9" is U+00E9
    seq = _stop_seq(stop=("\u00e9",))
    assert _emit(seq, [1, 2, 3], tok) == [None, None, FinishReason.STOP]  # "a\ufffd", then "a\u00e9"
    assert seq.text == "a"


def test_max_tokens_context_limit_and_eos_finish_at_exactly_their_token():
    tok = _BytePieces({i: b"x" for i in range(10)})
    assert _emit(_stop_seq(max_tokens=3), [5, 5, 5], tok) == [None, None, FinishReason.LENGTH]
    # prompt of 2 + 3 outputs = the model's 5 positions: the third output is the last
    assert _emit(_stop_seq(prompt=(0, 0)), [5, 5, 5], tok, max_model_len=5) == [None, None, FinishReason.LENGTH]
    assert _emit(_stop_seq(eos=frozenset({7})), [5, 7], tok) == [None, FinishReason.STOP]
    assert _emit(_stop_seq(eos=frozenset({7}), ignore_eos=True), [5, 7], tok) == [None, None]
    assert _emit(_stop_seq(stop_token_ids=(6,)), [5, 6], tok) == [None, FinishReason.STOP]


def _sentencepiece_tokenizer():
    """A Llama-2 / Mistral / TinyLlama style tokenizer (the decoder transformers' LlamaConverter writes, whose
    Strip(" ", 1, 0) drops the first token's leading space), built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "\u2581The": 2, "\u2581answer": 3, "\u2581is": 4, "\u2581Paris": 5,
             "\u2581Observation": 6, ":": 7, "<0xC3>": 8, "<0xA9>": 9, "\u2581caf": 10}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")


def test_a_sentencepiece_outputs_leading_space_is_kept_and_a_stop_string_on_it_found():
    """The output was decoded alone, so the decoder's strip took the space the model wrote: the stop string
    " Observation:" at the start of the output was never found, and prompt + completion lost a space."""
    from tlt.services.rollout.engine.detok import continuation_text

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [6, 7, 5]  # "The answer is" + " Observation: Paris"
    whole = tok.decode([*prompt, *out])
    assert continuation_text(tok, prompt, out) == whole[len(tok.decode(prompt)):] == " Observation: Paris"
    seq = _stop_seq(prompt=prompt, stop=(" Observation:",))
    assert _emit(seq, out[:2], tok) == [None, FinishReason.STOP] and seq.text == ""
    seq = _stop_seq(prompt=prompt, stop=(" Paris",))
    assert _emit(seq, out, tok) == [None, None, FinishReason.STOP] and seq.text == " Observation:"


def test_incremental_text_is_the_one_shot_text_and_decodes_a_window_not_the_output():
    """Every token decoded the whole output for the stop check (quadratic: ~1 ms a token per sequence at 4k
    tokens on the engine's loop). The window's text must equal one decode of prompt + output, characters split
    into byte-fallback pieces included, while each decode sees a bounded number of tokens."""
    import random

    from tlt.services.rollout.engine.detok import CONTEXT_TOKENS, IncrementalText, continuation_text

    tok = _sentencepiece_tokenizer()
    longest = []
    real = type(tok).decode

    def spy(self, ids, *a, **kw):  # noqa: ANN001, ANN202
        longest.append(len(ids))
        return real(self, ids, *a, **kw)

    rng = random.Random(0)
    for trial in range(30):
        prompt = [rng.choice([2, 3, 4, 10]) for _ in range(rng.randint(1, 8))]
        # (8, 9): "é" in two byte pieces, a character split across tokens (valid UTF-8: a sampled invalid byte
        # run decodes to a different count of U+FFFD depending on where a window cuts it, as in vLLM)
        out = [t for _ in range(rng.randint(1, 300)) for t in rng.choice([[2], [3], [4], [5], [6], [7], [10], [8, 9]])]
        inc = IncrementalText(tok, prompt)
        type(tok).decode, longest[:] = spy, []
        try:
            for t in out:
                inc.push([t])
            inc.flush()
        finally:
            type(tok).decode = real
        assert inc.text == continuation_text(tok, prompt, out), trial
        assert max(longest) <= CONTEXT_TOKENS + 4, max(longest)  # a window, however long the output
    seq = _stop_seq(max_tokens=1000, prompt=(2, 3), stop=("zzz",))  # the engine's stop check decodes the same way
    type(tok).decode, longest[:] = spy, []
    try:
        assert set(_emit(seq, [5, 6, 7] * 100, tok, max_model_len=1000)) == {None}
    finally:
        type(tok).decode = real
    assert max(longest) <= CONTEXT_TOKENS + 4, max(longest)


def test_the_streamed_text_of_a_sentencepiece_output_joins_to_its_completion_text():
    # the HTTP stream decodes as the engine does (after the prompt's last tokens): a stream that dropped the
    # leading space could not be completed by the engine's text (TextStream.finish sends nothing it cannot append)
    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import TextStream

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [6, 7, 5]
    stream = TextStream(tok, (), prompt=prompt)
    deltas = [stream.push([t]) for t in out]
    assert deltas[0] == " Observation"
    assert "".join(deltas) + stream.finish(continuation_text(tok, prompt, out)) == " Observation: Paris"


def test_a_tokenizer_that_cleans_up_spaces_still_finds_stop_strings_and_streams_its_text():
    """transformers' clean_up_tokenization_spaces rewrites text already decoded when the next token comes
    (" it '" then "s": " it's"): the window's earlier text was no prefix of the new one, the incremental text
    stopped growing for good, and a stop string after it was never found."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import TextStream

    vocab = {"<unk>": 0, "\u0120it": 1, "\u0120'": 2, "s": 3, "\u0120STOP": 4, "\u0120ok": 5, "\u0120hi": 6, "\u0120.": 7}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", clean_up_tokenization_spaces=True)
    out = [1, 2, 3, 5, 7, 5, 4, 5]
    assert continuation_text(tok, (6,), out) == tok.decode(out) == " it's ok. ok STOP ok"
    seq = _stop_seq(max_tokens=20, prompt=(6,), stop=(" STOP",))
    assert _emit(seq, out[:7], tok)[-1] == FinishReason.STOP and seq.text == " it's ok. ok"
    seq = _stop_seq(max_tokens=20, prompt=(6,), stop=("it's",))  # only the cleaned text holds it
    assert _emit(seq, out[:3], tok)[-1] == FinishReason.STOP and seq.text == " "
    stream = TextStream(tok, (), prompt=(6,))
    sent = "".join(stream.push([x]) for x in out)
    assert sent + stream.finish(continuation_text(tok, (6,), out)) == " it's ok. ok STOP ok"


def test_the_prompt_context_reaches_past_special_tokens_and_starts_on_a_character():
    """The context was exactly the prompt's last 5 tokens: 5 special tokens (which the decode skips) left the strip
    to the output again, and a cut inside a byte-fallback character made the whole run U+FFFD, so the context was
    dropped; either way a Llama-2 style output lost its leading space and a stop string on it."""
    from tlt.services.rollout.engine.detok import continuation_text

    tok = _sentencepiece_tokenizer()
    for prompt in ((2, 3, 4, 1, 1, 1, 1, 1), (2, 3, 4, 8, 9, 8, 9, 8, 9)):  # ... </s> x5; ... "ééé" in byte pieces
        assert continuation_text(tok, prompt, [5]) == " Paris", prompt
        seq = _stop_seq(prompt=prompt, stop=(" Paris",))
        assert _emit(seq, [5], tok) == [FinishReason.STOP] and seq.text == ""


def test_a_stray_byte_does_not_freeze_the_text():
    """A byte after a byte-fallback character turns the whole run into U+FFFD, so the window's earlier text ("é")
    was no prefix of the new one ("���"), and a prefix check froze the text for good: a stop string after it was
    never found, and the stream sent nothing more."""
    from tlt.services.rollout.openai_convert import TextStream

    tok = _sentencepiece_tokenizer()
    out = [4, 8, 9, 9, 4, 5, 6, 7]  # " is" "é" <stray 0xA9> " is Paris Observation:"
    seq = _stop_seq(max_tokens=20, prompt=(2, 3), stop=(" Paris",))
    assert _emit(seq, out[:6], tok)[-1] == FinishReason.STOP and seq.text.endswith(" is")
    stream = TextStream(tok, (), prompt=(2, 3))
    assert "".join(stream.push([t]) for t in out).endswith(" Observation:")
    # a stream fed engine steps of several tokens (speculation) joins to the completion's one-shot text
    from tlt.services.rollout.engine.detok import continuation_text

    final = continuation_text(tok, (2, 3), out)
    stream = TextStream(tok, (".",), prompt=(2, 3))
    sent = "".join(stream.push(out[i:i + 2]) for i in range(0, len(out), 2))
    assert sent + stream.finish(final) == final


def test_a_stream_never_sends_text_it_holds_back():
    # text shorter than the holdback: a negative slice end took characters from the end instead of none
    from tlt.services.rollout.openai_convert import TextStream

    tok = _BytePieces({1: b" the", 2: b" it"})
    stream = TextStream(tok, ("x" * 12,))  # holds back 11 characters
    assert [stream.push([1]), stream.push([2])] == ["", ""]
    assert stream.finish(" the it") == " the it"


def test_a_bpe_tokenizer_is_not_cleaned_up_as_transformers_does_not_clean_it():
    # transformers 5 skips clean_up_tokenization_spaces for a BPE model (it would corrupt BPE text): cleaning it
    # here found stop strings in text the completion would not hold
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tlt.services.rollout.engine.detok import cleans_up, continuation_text

    vocab = {"<unk>": 0, "\u0120it": 1, "\u0120.": 2, "\u0120'": 3, "s": 4}
    t = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", clean_up_tokenization_spaces=True)
    assert not cleans_up(tok)
    assert continuation_text(tok, (1,), [1, 2, 3, 4]) == tok.decode([1, 2, 3, 4]) == " it . 's"


def test_a_sentencepiece_tokens_logprobs_keep_its_leading_space():
    """Each logprob's token was decoded on its own, so the decoder's strip took the space of every `▁word` token:
    the tokens read "Observation", ":", "Paris" in a text " Observation: Paris", `text_offset` drifted one
    character left per word, and the chat `bytes`, joined as OpenAI documents, did not rebuild the content."""
    from tlt.model.tokenizer import test_tokenizer
    from tlt.services.rollout.engine.detok import continuation_text
    from tlt.services.rollout.openai_convert import _token_text_and_bytes, chat_logprobs, completion_logprobs

    tok = _sentencepiece_tokenizer()
    prompt, out = (2, 3, 4), [6, 7, 5, 10, 8, 9]  # "The answer is" + " Observation: Paris café" (é in 2 byte pieces)
    text = continuation_text(tok, prompt, out)
    assert text == " Observation: Paris caf\u00e9"
    lp = completion_logprobs(tok, out, [-0.1] * len(out), [{5: -0.1, 6: -0.2}] * len(out), 1, text)
    assert lp.tokens == [" Observation", ":", " Paris", " caf", "<0xC3>", "<0xA9>"]
    assert lp.text_offset == [0, 12, 13, 19, 23, 23]
    assert lp.top_logprobs[0] == {" Paris": -0.1, " Observation": -0.2}
    chat = chat_logprobs(tok, out, [-0.1] * len(out), None, 0)
    assert bytes(b for c in chat.content for b in c.bytes).decode() == text
    # a byte-level BPE tokenizer's (GPT-2, Qwen, Llama 3: the task's) tokens read as before, on their own
    task = test_tokenizer()
    for i in range(len(task)):
        alone = task.decode([i])
        if "\ufffd" not in alone:
            assert _token_text_and_bytes(task, i) == (alone, list(alone.encode())), i


def test_a_long_stop_string_does_not_make_the_short_ones_search_the_whole_text(monkeypatch):
    """Each new token searched every stop string from (checked end - the LONGEST stop string's length): one long
    stop string beside short ones made every token search the whole output again, quadratic in its length. Each
    string is now searched from where a match of its own length could begin."""
    from tlt.services.rollout.engine import detok

    starts: dict[str, list[int]] = {}

    class Recorded(str):
        def find(self, sub, start=0, *rest):  # noqa: ANN001, ANN202
            starts.setdefault(sub, []).append(start)
            return str.find(self, sub, start, *rest)

    cleaned = detok.IncrementalText.cleaned
    monkeypatch.setattr(detok.IncrementalText, "cleaned", lambda self: Recorded(cleaned(self)))
    tok = _BytePieces({0: b"", 1: b"ab", 2: b"q"})
    seq = _stop_seq(max_tokens=400, stop=("x" * 5000, "q"))
    reasons = _emit(seq, [1] * 300 + [2], tok, max_model_len=1000)
    assert reasons[-1] == FinishReason.STOP and reasons[:-1] == [None] * 300 and seq.text == "ab" * 300
    assert max(starts["q"]) >= 2 * 299 - detok.CLEANUP_HOLDBACK, starts["q"][-3:]  # near the end, not 0
