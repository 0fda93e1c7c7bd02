"""Differential test of the native engine against `transformers` greedy decoding, all hard paths at once.

One seeded, reproducible scenario per speculation setting drives the engine through: a KV pool so
small that sequences are preempted and recomputed; many prompts sharing a long prefix, exact
duplicates and n > 1 samples (prefix sharing, partial tails copied); a step token budget smaller than the prompts (chunked
prefill); requests added while others decode; random aborts mid-flight (half of them retried at once
under the same request id); stop token ids and max_tokens placed at KV block boundaries; a few sampled
requests in the same batches; and two policy weight updates (to other weights, then back), each while
requests are in flight. Every greedy completion is checked token for token against a per-prompt
`transformers` greedy continuation (computed once per weight set) cut by the request's own stops,
with its logprobs, top-3 logprobs and features where asked; after an update, new requests must match
the reference of the NEW weights (the prefix cache must not serve K/V computed with the old ones).
Requests in flight across an update are checked up to the update (afterwards their K/V is mixed by
design). The block manager's bookkeeping (ref counts = block-table references, free list, hashes,
no shared or shareable block without K/V) is checked after every step, and at the end every block,
sequence and drafter state must be released.

Speculation: off, and static chain / tree arms with the model-free n-gram drafter and with a random
(untrained) learned drafter, whose drafts are rarely accepted (output must still be exact; new random
drafter weights are pushed at the first update). The slow sweep adds seeds, engine shapes (block size
1..16, pools, budgets, batch caps, context limits, prefix sharing off) and more arms / the adaptive
bandit.

Random-initialised Qwen2 checkpoints are written in the test (no downloads); nothing is faked.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import safetensors.torch
import torch
import transformers

from tlt.model.drafter import Drafter, DrafterConfig
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.sequence import SeqStatus
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.types import CompletionOutput, FinishReason, GenerationRequest, SamplingParams

BS = 4  # KV block size: small, so stops and max_tokens often land on block boundaries
MAX_NEW = 20  # longest completion; the reference continuations have this many tokens
NUM_BLOCKS = 26  # the KV pool: the longest request needs 15 blocks, a full batch far more
ENGINE = dict(block_size=BS, num_kv_blocks=NUM_BLOCKS, max_num_seqs=6, max_num_batched_tokens=16,
              max_model_len=128)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(checkpoint folder, second weight set, the checkpoint's own weights), weight sets in HF names."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("differential")
    shape = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position_embeddings=256, weight_scale=0.05)
    ckpt = random_checkpoint(root / "v0", seed=0, **shape)
    other = random_checkpoint(root / "v1", seed=1, **shape)
    load = safetensors.torch.load_file
    return ckpt, load(str(other / "model.safetensors")), load(str(ckpt / "model.safetensors"))


def _prompts(seed: int) -> list[tuple[int, ...]]:
    """Prompts sharing a 29-token prefix (some identical), repeated motifs (n-gram hits) and random ones."""
    g = random.Random(seed)
    prefix = [g.randrange(3, 250) for _ in range(29)]
    out = [tuple(prefix + [g.randrange(3, 250) for _ in range(g.randrange(0, 10))]) for _ in range(6)]
    out.append(out[0])
    out.append(tuple(prefix[:BS * 5]))  # ends exactly at a block boundary of the shared prefix
    for _ in range(3):
        motif = [g.randrange(3, 250) for _ in range(g.randrange(2, 5))]
        out.append(tuple((motif * 20)[: g.randrange(8, 40)]))
    out += [tuple(g.randrange(3, 250) for _ in range(g.randrange(1, 40))) for _ in range(4)]
    return out


@dataclass(frozen=True)
class Reference:
    tokens: list[int]  # greedy continuation, MAX_NEW tokens, eos ignored
    logprobs: list[float]  # log-softmax of each of those tokens
    top: list[dict[int, float]]  # the 3 most likely tokens and their log-softmax, per position
    features: torch.Tensor  # [MAX_NEW, H] last hidden state (after the final norm) that produced each token


@pytest.fixture(scope="module")
def references(weights) -> dict[int, list[Reference]]:
    """{weight set: [Reference per prompt]} from `transformers` (0: the checkpoint, 1: the update)."""
    ckpt, new, _ = weights
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    model.generation_config.eos_token_id = None
    refs = {}
    with torch.inference_mode():
        for version in (0, 1):
            if version == 1:
                model.load_state_dict(new, strict=False)
            refs[version] = []
            for p in _prompts(0):
                ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)[0]
                fwd = model(ids[None, :-1], output_hidden_states=True)
                lp = fwd.logits[0, len(p) - 1 :].float().log_softmax(-1)
                out = ids[len(p):]
                vals, top = lp.topk(3, dim=-1)
                refs[version].append(Reference(out.tolist(), lp.gather(1, out[:, None])[:, 0].tolist(),
                                               [dict(zip(t, v)) for t, v in zip(top.tolist(), vals.tolist())],
                                               fwd.hidden_states[-1][0, len(p) - 1 :].float()))
    return refs


@dataclass
class Planned:
    req: GenerationRequest
    prompt: int  # index into _prompts()
    wave: int  # added `offset` steps after the start (wave 0) or after the wave-th weight update
    offset: int
    version: int = -1  # policy version when added
    aborted: bool = False
    straddles: bool = False  # in flight when the weights changed
    streams: dict[int, list[int]] = field(default_factory=dict)  # sample -> tokens from StepOutputs
    done: dict[int, CompletionOutput] = field(default_factory=dict)  # sample -> its completion
    before_update: dict[int, int] = field(default_factory=dict)  # sample -> tokens emitted before the update


def _request(g: random.Random, rid: str, refs: dict[int, list[Reference]], bs: int, max_model_len: int,
             wave: int, offset: int) -> Planned:
    """A request with random prompt, n, max_tokens and stop ids; half of them end (by max_tokens or by a
    stop id the greedy continuation emits) exactly at a KV block boundary."""
    prompts = _prompts(0)
    k = g.randrange(len(prompts))
    p, ref = prompts[k], refs[0][k].tokens
    room = min(MAX_NEW, max_model_len - len(p))
    max_tokens: int | None = g.randrange(1, room + 1)
    if g.random() < 0.5:  # prompt + completion = m * block_size
        max_tokens = min(room, max(1, bs - len(p) % bs + bs * g.randrange(0, 4)))
    elif room == max_model_len - len(p) and g.random() < 0.3:
        max_tokens = None  # up to the context limit
    stop: tuple[int, ...] = ()
    if g.random() < 0.4:
        at = [j for j in range(room) if (len(p) + j + 1) % bs == 0] or [0]
        stop = (ref[g.choice(at)], g.randrange(3, 250))
    sampled = g.random() < 0.15  # a few sampled requests share the batches (checked for length only)
    params = SamplingParams(temperature=0.8 if sampled else 0.0, seed=g.randrange(1000) if sampled else None,
                            max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=g.random() < 0.7,
                            logprobs=g.choice((None, 0, 0, 3)), return_features=g.random() < 0.3)
    return Planned(GenerationRequest(rid, p, params, g.choice((1, 1, 2, 3))), k, wave, offset)


def _plan(seed: int, refs: dict[int, list[Reference]], bs: int = BS, max_model_len: int = 128) -> list[Planned]:
    """16 requests arriving over the first 12 steps, then 6 over the 10 steps after each of two weight updates."""
    g = random.Random(seed)
    waves = [0] * 16 + [1] * 6 + [2] * 6
    return [_request(g, f"r{i}", refs, bs, max_model_len, w, g.randrange(0, 12 if w == 0 else 10))
            for i, w in enumerate(waves)]


def _expected(p: Planned, ref: list[int], eos: set[int], max_model_len: int) -> list[int]:
    """The reference continuation cut by the request's stops, as the engine must cut it."""
    params = p.req.params
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    limit = params.max_tokens if params.max_tokens is not None else max_model_len - len(p.req.prompt_token_ids)
    out = []
    for t in ref[:limit]:
        out.append(t)
        if t in stops:
            break
    return out


def check_blocks(engine: LLMEngine) -> None:
    """Block manager / scheduler invariants that must hold between any two steps."""
    bm, sch = engine.block_manager, engine.scheduler
    bs = bm.block_size
    for s in sch.waiting:
        assert s.status is SeqStatus.WAITING and not s.block_table and s.num_computed == 0, s
    refs: Counter[int] = Counter()
    for s in sch.running:
        assert s.status is SeqStatus.RUNNING and s not in sch.waiting, s
        assert len(set(s.block_table)) == len(s.block_table), (s, s.block_table)
        assert s.num_computed <= s.num_tokens and s.num_computed <= len(s.block_table) * bs, s
        refs.update(s.block_table)
    for b in bm.blocks:
        assert b.ref_count == refs[b.id], (b.id, b.ref_count, refs[b.id])
        assert (b.ref_count == 0) == (b.id in bm.free), b.id
        assert b.ref_count <= 1 or b.computed, f"block {b.id} is shared but holds no K/V yet"
    for h, b in bm.by_hash.items():
        assert b.hash == h and len(b.token_ids) == bs
        assert b.computed or b.ref_count > 0, f"free block {b.id} is still shareable but holds no K/V"
    for key, b in bm.by_tail.items():  # a partial tail others may copy: held, there, by the running sequence computing it
        owner = b.tail_owner
        assert b.tail == key and owner in sch.running and b.id in owner.block_table, (b.id, owner)
        assert owner.block_table.index(b.id) == (b.tail_end - 1) // bs, (b.id, b.tail_end, owner.block_table)
    for group in engine._seqs.values():
        for s in group:
            assert s.is_finished == (s.status is SeqStatus.FINISHED)
            if s.is_finished:
                assert not s.block_table


def drive(engine: LLMEngine, plan: list[Planned], refs: dict[int, list[Reference]], updates: list[dict], seed: int,
          readd: float = 0.0, drafter_update: dict | None = None) -> list[Planned]:
    """Run the scenario: arrivals, random aborts (re-adding the aborted id with a new request with
    probability `readd`), and the policy updates `updates` (versions 1, 2, ...), each once the requests
    before it have all arrived and at most 2 are still in flight; `drafter_update` is pushed with the first.
    Returns every request run (the plan and the re-added ones)."""
    g = random.Random(seed)
    requests = list(plan)
    by_id = {}
    bs, max_len = engine.block_manager.block_size, engine.max_model_len
    wave_start = {0: 0}  # wave -> the step it starts at
    last_update, step, version = 0, 0, 0
    while True:
        if version < len(updates) and step >= max(12, last_update + 12) and len(engine._seqs) <= 2:
            engine.update_weights("policy", updates[version], version + 1)
            if drafter_update is not None and version == 0:
                engine.update_weights("drafter", drafter_update, 1)
            version += 1
            last_update = wave_start[version] = step
            assert not engine.block_manager.by_hash, "a weight update must forget every cached prefix block"
            for p in requests:
                if p.req.request_id in engine._seqs and by_id.get(p.req.request_id) is p and not p.straddles:
                    p.straddles = True
                    p.before_update = {i: len(t) for i, t in p.streams.items()}
        for p in plan:
            if p.wave in wave_start and wave_start[p.wave] + p.offset == step:
                engine.add_request(p.req)
                p.version = version
                by_id[p.req.request_id] = p
        live = [p for p in by_id.values() if p.req.request_id in engine._seqs]
        if live and g.random() < 0.06:
            victim = g.choice(live)
            engine.abort_request(victim.req.request_id)
            victim.aborted = True
            if g.random() < readd:  # the same id again, at once (a client retry)
                again = _request(g, victim.req.request_id, refs, bs, max_len, version, step - wave_start[version])
                engine.add_request(again.req)
                again.version = version
                by_id[again.req.request_id] = again
                requests.append(again)
        steps, done = engine.step()
        for o in steps:
            p = by_id[o.request_id]
            assert not p.aborted, f"{o.request_id} emitted after it was aborted"
            p.streams.setdefault(o.sample_index, []).extend(o.new_token_ids)
        for c in done:
            p = by_id[c.request_id]
            assert c.token_ids == p.streams[c.sample_index], "completion differs from its streamed tokens"
            p.done[c.sample_index] = c
        check_blocks(engine)
        step += 1
        if version == len(updates) and step > last_update + 10 and not engine.has_unfinished():
            return requests
        assert step < 3000, "the engine made no progress"


def verify(engine: LLMEngine, plan: list[Planned], refs: dict[int, list[Reference]]) -> Counter[str]:
    """Every request that was not aborted against `refs[policy version when it was added]`."""
    eos = set(engine.eos_ids)
    tally: Counter[str] = Counter()
    for p in plan:
        if p.aborted:
            tally["aborted"] += 1
            continue
        ref = refs[p.version][p.prompt]
        want = _expected(p, ref.tokens, eos, engine.max_model_len)
        for i in range(p.req.n):
            c = p.done.get(i)
            assert c is not None, f"{p.req.request_id}#{i} never finished"
            if not p.req.params.greedy:
                limit = p.req.params.max_tokens or engine.max_model_len - len(p.req.prompt_token_ids)
                assert 1 <= len(c.token_ids) <= limit
                tally["sampled"] += 1
                continue
            if p.straddles:  # tokens before the update are the old weights'; after it the K/V is mixed
                k = p.before_update.get(i, 0)
                assert c.token_ids[:k] == want[:k], (p.req.request_id, i)
                tally["straddling"] += 1
                continue
            assert c.token_ids == want, (p.req.request_id, i, p.version, p.req.params, c.token_ids, want)
            stopped = want[-1] in set(p.req.params.stop_token_ids) | (set() if p.req.params.ignore_eos else eos)
            assert c.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)
            assert c.versions.policy == p.version and c.versions.policy_min is None
            if c.logprobs is not None:
                assert c.logprobs == pytest.approx(ref.logprobs[: len(want)], abs=2e-4), (p.req.request_id, i)
                tally["logprobs"] += 1
            if c.top_logprobs:
                assert len(c.top_logprobs) == len(want)
                for got, exp in zip(c.top_logprobs, ref.top, strict=False):
                    assert got.keys() == exp.keys() and list(got.values()) == pytest.approx(list(exp.values()), abs=2e-4)
                tally["top_logprobs"] += 1
            if c.features is not None:
                assert c.features.shape[0] == len(want)
                assert torch.allclose(c.features.float(), ref.features[: len(want)], atol=3e-3), (p.req.request_id, i)
                tally["features"] += 1
            tally[f"checked_v{p.version}"] += 1
    # everything released: no leaked blocks, no sequences, no drafter state
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine._seqs
    if engine.spec_decoder is not None:
        src = engine.spec_decoder.source
        assert not getattr(src, "groups", {}) and not getattr(src, "rows", {}) and not getattr(src, "pending", {})
    return tally


SPECS = {
    "off": None,
    "ngram-chain": dict(drafter="ngram", static_arm="3_1_4"),
    "ngram-tree": dict(drafter="ngram", static_arm="4_2_8"),
    "learned-chain": dict(drafter="learned", static_arm="3_1_4"),
    "learned-tree": dict(drafter="learned", static_arm="3_2_6"),
}
SEED = 3  # the default run's scenario (the slow sweep runs more); 2 until the tail copy moved siblings a step
SLOW_SPECS = {  # more arms and the adaptive bandit (with the "plain" arm), for the slow sweep
    **SPECS,
    "ngram-big-tree": dict(drafter="ngram", static_arm="8_4_16"),
    "learned-big-tree": dict(drafter="learned", static_arm="5_3_10"),
    "ngram-adaptive": dict(drafter="ngram", mode="adaptive", epsilon=0.5, bucket_arms=(("4_2_8", "3_1_4", "plain"),) * 4),
    "learned-adaptive": dict(drafter="learned", mode="adaptive", epsilon=0.5,
                             bucket_arms=(("3_2_6", "3_1_4", "plain"),) * 4),
    "ngram-switching": dict(drafter="ngram", static_arm="4_2_8", threshold=3, hysteresis_steps=2),  # SD on and off
}


def run_scenario(weights, references, spec: dict | None, seed: int, **engine) -> tuple[LLMEngine, Counter[str]]:
    """Build the engine (ENGINE overridden by `engine`), attach `spec`, drive the seeded scenario with two
    policy updates (to the second weight set, then back to the first) and check everything."""
    ckpt, new, old = weights
    engine = LLMEngine(ckpt, EngineConfig(**{**ENGINE, **engine}))
    drafter_update = None
    if spec is not None:
        drafter = None
        if spec["drafter"] == "learned":
            torch.manual_seed(seed)
            cfg = DrafterConfig.from_model_config(engine.model_config)
            drafter = Drafter(cfg, engine.model.embed, engine.model.lm_head).eval()
            other = Drafter(cfg, engine.model.embed, engine.model.lm_head)
            drafter_update = {k: v.detach().clone() for k, v in other.state_dict().items()}  # pushed mid-run
        engine.enable_spec(SpecConfig(**{"mode": "static", "threshold": 64, "hysteresis_steps": 1,
                                         "drafter_path": "(in memory)", **spec}), drafter)
    plan = _plan(seed, references, engine.block_manager.block_size, engine.max_model_len)
    ran = drive(engine, plan, references, [new, old], seed, readd=0.5, drafter_update=drafter_update)
    tally = verify(engine, ran, {0: references[0], 1: references[1], 2: references[0]})
    if spec is not None:
        assert engine.stats().spec["verify_steps"] > 0, engine.stats().spec
    return engine, tally


@pytest.mark.parametrize("name", list(SPECS))
def test_engine_matches_transformers_through_every_hard_path(weights, references, name):
    engine, tally = run_scenario(weights, references, SPECS[name], seed=SEED)
    st = engine.stats()
    assert st.num_preemptions > 0, "the pool must be small enough to preempt"
    assert st.prefix_hit_blocks > 0 and st.prefix_tail_copies > 0
    # the scenario reached every case it is meant to check
    assert tally["checked_v0"] >= 5 and tally["checked_v1"] >= 2 and tally["checked_v2"] >= 2, tally
    assert tally["aborted"] > 0 and tally["straddling"] > 0 and tally["sampled"] > 0, tally
    assert tally["logprobs"] > 0 and tally["top_logprobs"] > 0 and tally["features"] > 0, tally
    if name.startswith("ngram"):
        assert st.spec["mean_accept_len"] > 1.1, st.spec  # drafts were accepted, not only verified
    if name == "ngram-tree":
        assert st.spec["kv_copies"] > 0, st.spec  # some accepted paths left the first branch: their K/V moved


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 13))
@pytest.mark.parametrize("name", list(SLOW_SPECS))
def test_engine_matches_transformers_sweep(weights, references, name, seed):
    """More seeds, and per seed another engine shape: block size (1 to 16), pool, step budget below or
    above the running batch, batch cap, context limit, prefix sharing on/off."""
    g = random.Random(seed)
    bs = g.choice([1, 2, 4, 8, 16])
    pool = g.choice([60, 68, 80, 104, 160])  # tokens; the longest request needs up to 59
    run_scenario(weights, references, SLOW_SPECS[name], seed, block_size=bs,
                 num_kv_blocks=max(-(-59 // bs), -(-pool // bs)), max_num_seqs=g.choice([1, 3, 6, 12, 24]),
                 max_num_batched_tokens=g.choice([16, 17, 23, 64]), prefix_sharing=g.random() < 0.8,
                 max_model_len=g.choice([56, 60, 64, 128]))
