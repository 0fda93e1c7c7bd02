"""Seeded differential fuzz of the native engine against `transformers`: Qwen3 and Llama, sampling filters, stop strings.

tests/test_engine_differential.py drives a Qwen2 engine through preemption, prefix sharing, chunked
prefill, aborts and weight updates with greedy references. This file adds what it does not check,
over the same kind of random traffic (arrivals while others run, aborts and retries under the same id,
n > 1, 1-token prompts, prompts ending exactly at a block boundary and at the context limit, a KV
pool small enough to preempt, step budgets that chunk prefill, prefix sharing on and off, the decode
mirror forced on for some engines):

- three families: Qwen2 (qkv bias, GQA), Qwen3 (q/k norm, head_dim 24 != hidden / heads, MHA,
  linear rope scaling), Llama (Llama-3 rope scaling past its original context, tied embeddings, MQA);
  each checkpoint lists two extra eos ids so eos stops happen;
- sampled requests (temperature, top_k, top_p, min_p, explicit or default seeds): every sampled
  token must be the inverse-CDF draw of the engine's documented uniform u(key, position) from the
  distribution `transformers`' own logits warpers (Temperature, TopK, TopP, MinP) give on its logits
  (float64; a token is only excused when u lies within 1e-4 of its interval), and its logprob
  log q(token);
- stop strings cut out of the greedy continuation's text across a token boundary: the completion
  must end at the first token whose decoded output contains one, with its text cut before it;
- greedy tokens, logprobs, top logprobs and features against a teacher-forced `transformers`
  forward of each completion; finish reasons; streamed tokens and logprobs = the completion's.

The block manager's bookkeeping is checked after every step and, at the end, every block must be
free. Random-initialised checkpoints are written in the test (no downloads); nothing is faked.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tlt.model.testing import random_checkpoint
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.sequence import SeqStatus
from tlt.services.rollout.spec.rng import PLAIN, counter_uniforms, key_tensor
from tlt.services.rollout.types import CompletionOutput, FinishReason, GenerationRequest, SamplingParams

FAMILIES = {
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", head_dim=24, num_key_value_heads=4, rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama": dict(family="llama", tie_word_embeddings=True, num_key_value_heads=1, rope_theta=500.0,
                  rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=32)),
}
TOKENS = (3, 310)  # prompt token ids are drawn from here (the vocabulary has 320 rows)


class Reference:
    """`transformers` on one checkpoint: teacher-forced logits / final hidden states, greedy continuations."""

    def __init__(self, path) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._fwd: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    @torch.inference_mode()
    def forward(self, tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens not in self._fwd:
            out = self.model(torch.tensor([tokens]), output_hidden_states=True)
            self._fwd[tokens] = out.logits[0].float(), out.hidden_states[-1][0].float()
        return self._fwd[tokens]

    @torch.inference_mode()
    def greedy(self, prompt: tuple[int, ...], n: int) -> list[int]:
        if len(self._greedy.get(prompt, ())) < n:
            ids = self.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0]
            self._greedy[prompt] = ids[len(prompt):].tolist()
        return self._greedy[prompt][:n]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple]:
    """family -> (checkpoint folder, Reference)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, (name, spec) in enumerate(FAMILIES.items()):
        spec = dict(spec)
        path = random_checkpoint(root / name, family=spec.pop("family"), seed=i, initializer_range=0.15,
                                 max_position_embeddings=256, **spec)
        gen = json.loads((path / "generation_config.json").read_text())
        gen["eos_token_id"] = [gen["eos_token_id"], 100 + i, 200 + i]  # eos the random model emits now and then
        (path / "generation_config.json").write_text(json.dumps(gen))
        out[name] = path, Reference(path)
    return out


def warped_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """log q of a sampled row from `transformers`' warpers, in the engine's order (temperature, top_k, top_p, min_p)."""
    x, ids = logits[None].double(), torch.zeros(1, 1, dtype=torch.long)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0].log_softmax(-1)


def inverse_cdf(logq: torch.Tensor, u: float) -> tuple[int, torch.Tensor]:
    """The token a uniform u picks from q (float64), and q's CDF."""
    q = logq.exp()
    cdf = q.cumsum(-1)
    tok = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])
    return min(tok, int((q > 0).nonzero().max())), cdf


def stop_cut(tokenizer, out: list[int], stops: tuple[str, ...]) -> str | None:
    """The decoded output cut before its first stop string, or None if it holds none."""
    text = tokenizer.decode(out, skip_special_tokens=True)
    hits = [text.find(s) for s in stops if s in text]
    return text[: min(hits)] if hits else None


@dataclass
class Tracked:
    req: GenerationRequest
    keys: list[int | None]  # each sample's RNG key (None when greedy)
    aborted: bool = False
    streams: dict[int, list[int]] = field(default_factory=dict)
    stream_logprobs: dict[int, list[float]] = field(default_factory=dict)
    finished: Counter[int] = field(default_factory=Counter)
    done: dict[int, CompletionOutput] = field(default_factory=dict)


def _prompts(g: random.Random, bs: int, max_len: int) -> list[tuple[int, ...]]:
    """Shared prefixes (some ending exactly at a block boundary, one beyond, one short of it), duplicates,
    1-token prompts and prompts one or a few tokens short of the context limit."""
    base = [g.randrange(*TOKENS) for _ in range(40)]
    out = [[g.randrange(*TOKENS)], [5]]
    for m in (1, 2, 3):
        if bs * m < max_len - 8:
            out += [base[: bs * m], base[: bs * m + 1], base[: max(1, bs * m - 1)]]
    out += [base[: g.randrange(1, 30)] + [g.randrange(*TOKENS) for _ in range(g.randrange(0, 8))] for _ in range(4)]
    out += [[g.randrange(*TOKENS) for _ in range(g.randrange(1, 30))] for _ in range(3)]
    out = [p for p in [*out, out[-1]] if len(p) < max_len - 4]
    out.append([g.randrange(*TOKENS) for _ in range(max_len - 1)])
    out.append(base[:8] + [g.randrange(*TOKENS) for _ in range(max_len - 10)])
    return [tuple(p) for p in out]


def _request(g: random.Random, rid: str, prompts, ref: Reference, tokenizer, max_len: int,
             capacity: int) -> GenerationRequest:
    prompt = g.choice(prompts)
    room = min(max_len, capacity) - len(prompt)
    if room < 1:
        prompt = prompts[0]
        room = min(max_len, capacity) - len(prompt)
    max_tokens = g.choice([None, g.randrange(1, room + 1), g.randrange(1, min(room, 12) + 1)])
    if max_tokens is None and max_len > capacity:
        max_tokens = room
    greedy = g.random() < 0.65
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    if greedy and g.random() < 0.5:
        cont = ref.greedy(prompt, max_tokens or max_len - len(prompt))
        if g.random() < 0.5:
            stop_ids = (g.choice(cont), g.randrange(*TOKENS))
        else:  # a piece of the continuation's text that starts in token j and ends in token j + 1 or later
            j = g.randrange(0, max(1, len(cont) - 1))
            a = tokenizer.decode(cont[:j], skip_special_tokens=True)
            b = tokenizer.decode(cont[: j + 2], skip_special_tokens=True)
            if len(b) > len(a) + 1:
                s0 = g.randrange(len(a), len(b) - 1)
                s = b[s0 : g.randrange(s0 + 1, len(b) + 1)]
                if "\ufffd" not in s:
                    stop = (s,) if g.random() < 0.7 else (s, "zzq")
    elif not greedy and g.random() < 0.3:
        stop = (g.choice(["a", "e", " ", "1", "th", "\n"]),)
    params = SamplingParams(
        temperature=0.0 if greedy else g.choice([0.5, 0.8, 1.0, 1.3]),
        top_k=0 if greedy else g.choice([0, 0, 1, 3, 20]),
        top_p=1.0 if greedy else g.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=0.0 if greedy else g.choice([0.0, 0.0, 0.05, 0.3]),
        seed=None if g.random() < 0.3 else g.randrange(-2**40, 2**40),
        max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids, ignore_eos=g.random() < 0.5,
        logprobs=g.choice([None, 0, 2, 5]), return_features=g.random() < 0.3,
    )
    return GenerationRequest(rid, prompt, params, g.choice([1, 1, 1, 2, 3, 6]))


def check_blocks(engine: LLMEngine) -> None:
    """Ref counts = block-table references, free list = unreferenced blocks, shared blocks hold K/V, and a
    registered prefix block holds the tokens of every sequence that uses it."""
    bm, sch = engine.block_manager, engine.scheduler
    bs = bm.block_size
    assert len(sch.running) <= sch.max_num_seqs
    for s in sch.waiting:
        assert s.status is SeqStatus.WAITING and not s.block_table and s.num_computed == 0, s
    refs: Counter[int] = Counter()
    for s in sch.running:
        assert s.status is SeqStatus.RUNNING and len(set(s.block_table)) == len(s.block_table), s
        refs.update(s.block_table)
        for i, bid in enumerate(s.block_table):
            b = bm.blocks[bid]
            if b.hash is not None and bm.by_hash.get(b.hash) is b:
                assert b.token_ids == tuple(s.token_ids[i * bs : (i + 1) * bs]), (s, i)
    for b in bm.blocks:
        assert b.ref_count == refs[b.id] and (b.ref_count == 0) == (b.id in bm.free), b.id
        assert b.ref_count <= 1 or b.computed, f"block {b.id} is shared but holds no K/V yet"
    for h, b in bm.by_hash.items():
        assert b.hash == h and len(b.token_ids) == bs and (b.computed or b.ref_count > 0), b.id


def drive(engine: LLMEngine, g: random.Random, ref: Reference, max_len: int) -> list[Tracked]:
    """Requests arriving over the first 25 steps, 2% of steps aborting a live one (half retried at once
    under the same id); block checks after every step; returns every request added."""
    prompts = _prompts(g, engine.block_manager.block_size, max_len)
    capacity = engine.block_manager.num_blocks * engine.block_manager.block_size
    arrivals = sorted((g.randrange(0, 25), i) for i in range(g.randrange(6, 24)))
    by_id: dict[str, Tracked] = {}
    added: list[Tracked] = []

    def add(rid: str) -> None:
        req = _request(g, rid, prompts, ref, engine.tokenizer, max_len, capacity)
        engine.add_request(req)
        t = Tracked(req, [s.rng_key for s in engine._seqs[rid]])
        by_id[rid] = t
        added.append(t)

    step = 0
    while step <= 25 or engine.has_unfinished():
        for at, i in arrivals:
            if at == step and f"r{i}" not in engine._seqs:
                add(f"r{i}")
        live = [t for t in by_id.values() if engine.holds(t.req.request_id)]
        if live and g.random() < 0.02:
            victim = g.choice(live)
            engine.abort_request(victim.req.request_id)
            victim.aborted = True
            if g.random() < 0.5:
                add(victim.req.request_id)
        steps, done = engine.step()
        for o in steps:
            t = by_id[o.request_id]
            assert not t.aborted, f"{o.request_id} emitted after it was aborted"
            t.streams.setdefault(o.sample_index, []).extend(o.new_token_ids)
            if o.new_logprobs is not None:
                t.stream_logprobs.setdefault(o.sample_index, []).extend(o.new_logprobs)
            t.finished[o.sample_index] += o.finished
        for c in done:
            by_id[c.request_id].done[c.sample_index] = c
        check_blocks(engine)
        step += 1
        assert step < 3000, "the engine made no progress"
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine._seqs and not engine.scheduler.running and not engine.scheduler.waiting
    return added


def check_token(t: int, j: int, row: torch.Tensor, p: SamplingParams, key: int | None, position: int) -> torch.Tensor:
    """Assert the engine's token t at output index j is the reference's; return the reference log-distribution."""
    if p.greedy:
        best = int(row.argmax())
        assert t == best or float(row[best] - row[t]) < 1e-4, f"greedy token {j}: {t}, transformers {best}"
        return row.double().log_softmax(-1)
    logq = warped_logprobs(row, p)
    assert torch.isfinite(logq[t]), f"sampled token {j} ({t}) is outside the filtered distribution"
    u = float(counter_uniforms(key_tensor([key]), torch.tensor([position]), PLAIN)[0])
    want, cdf = inverse_cdf(logq, u)
    lo, hi = float(cdf[t - 1]) if t else 0.0, float(cdf[t])
    assert t == want or min(abs(u - lo), abs(u - hi)) < 1e-4, f"sampled token {j}: {t}, inverse CDF at u={u}: {want}"
    return logq


def check_completion(engine: LLMEngine, ref: Reference, t: Tracked, i: int, tally: Counter[str]) -> list[int]:
    p, prompt, tok = t.req.params, t.req.prompt_token_ids, engine.tokenizer
    c = t.done[i]
    out = c.token_ids
    assert out and out == t.streams[i] and t.finished[i] == 1, (t.req.request_id, i)
    assert list(c.prompt_token_ids) == list(prompt) and c.versions.policy == 0 and c.versions.policy_min is None
    limit = p.max_tokens if p.max_tokens is not None else engine.max_model_len - len(prompt)
    logits, hidden = ref.forward(prompt + tuple(out))
    for j, tk in enumerate(out):
        logq = check_token(tk, j, logits[len(prompt) - 1 + j], p, t.keys[i], len(prompt) + j)
        if c.logprobs is not None:
            assert c.logprobs[j] == pytest.approx(float(logq[tk]), abs=2e-4), (t.req.request_id, i, j)
        if p.logprobs:
            got = c.top_logprobs[j]
            assert len(got) == p.logprobs
            kth = float(logq.topk(p.logprobs).values[-1])
            for k, v in got.items():  # each is the reference's logprob of that token, and among its top k
                assert v == pytest.approx(float(logq[k]), abs=2e-4) and (float(logq[k]) >= kth - 2e-4 or v == kth)
        stopped = tk in p.stop_token_ids or (not p.ignore_eos and tk in engine.eos_ids)
        by_string = not stopped and bool(p.stop) and stop_cut(tok, out[: j + 1], p.stop) is not None
        at_limit = j + 1 >= limit or len(prompt) + j + 1 >= engine.max_model_len
        if j < len(out) - 1:
            assert not (stopped or by_string or at_limit), f"{t.req.request_id}#{i} went on past token {j}"
            continue
        assert stopped or by_string or at_limit, f"{t.req.request_id}#{i} ended without a reason"
        assert c.finish_reason is (FinishReason.STOP if stopped or by_string else FinishReason.LENGTH)
        # a stop token's text is left out, plain text or special (vLLM v1's detokenizer skips the last token)
        want_text = stop_cut(tok, out, p.stop) if by_string else tok.decode(out[:-1] if stopped else out,
                                                                            skip_special_tokens=True)
        assert c.text == want_text, (t.req.request_id, i, c.text, want_text)
        tally["stop_string"] += by_string
        tally["stop_id"] += stopped
    if c.logprobs is not None:
        assert t.stream_logprobs[i] == c.logprobs
        tally["logprobs"] += 1
    if p.return_features:
        want = hidden[len(prompt) - 1 : len(prompt) - 1 + len(out)]
        assert c.features.shape == want.shape and torch.allclose(c.features.float(), want, atol=3e-3)
        tally["features"] += 1
    tally["greedy" if p.greedy else "sampled"] += 1
    return out


def run_case(models, family: str, seed: int) -> tuple[LLMEngine, Counter[str]]:
    path, ref = models[family]
    g = random.Random(seed)
    bs = g.choice([1, 2, 4, 8, 16])
    max_len = g.choice([40, 48, 64])
    pool = g.choice([max_len, max_len + 8, 2 * max_len, 6 * max_len])  # tokens of KV
    config = EngineConfig(block_size=bs, num_kv_blocks=-(-pool // bs), max_num_seqs=g.choice([1, 2, 4, 8, 32]),
                          max_num_batched_tokens=g.choice([16, 17, 23, 64, 512]), max_model_len=max_len,
                          prefix_sharing=g.random() < 0.8, seed=seed)
    engine = LLMEngine(path, config)
    if g.random() < 0.4:  # every decode step through the dense mirror (its byte threshold keeps tiny batches off it)
        engine.model.mirror.min_bytes = 0
    tally: Counter[str] = Counter()
    for t in drive(engine, g, ref, max_len):
        if t.aborted:
            tally["aborted"] += 1
            continue
        outs = {tuple(check_completion(engine, ref, t, i, tally)) for i in range(t.req.n)}
        assert len(outs) == 1 or not t.req.params.greedy, f"{t.req.request_id}: greedy samples differ"
    return engine, tally


SEEDS = range(4)  # engine shapes and traffic per family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_matches_transformers_with_sampling_filters_and_stop_strings(models, family):
    total: Counter[str] = Counter()
    for seed in SEEDS:
        engine, tally = run_case(models, family, seed)
        total.update(tally)
        total["preemptions"] += engine.stats().num_preemptions
        total["prefix_hits"] += engine.stats().prefix_hit_blocks
    # the seeds reached every case they are meant to check
    for what in ("preemptions", "prefix_hits", "aborted", "sampled", "greedy", "stop_string", "stop_id", "logprobs",
                 "features"):
        assert total[what] > 0, (what, total)
