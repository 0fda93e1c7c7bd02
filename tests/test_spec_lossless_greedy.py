"""Greedy losslessness at scale (issue #4): 104 prompts of mixed lengths decoded with speculation off,
static with every arm (trees and chains), and adaptive, with the model-free n-gram drafter and a learned
EAGLE drafter, at batch sizes 1, 7 and 64 (the engine's max_num_seqs): every token identical to plain
greedy decoding.

The learned drafter is trained here for a few seconds on the target's own features, so that drafts are
accepted often (a random drafter would almost never be, and would leave the acceptance paths untested);
the prompts repeat motifs, so the n-gram drafter is accepted too. Each run asserts that speculation
actually ran and accepted drafts. Random-initialised Qwen2 checkpoint written in the test; nothing faked.
"""

from __future__ import annotations

import pytest
import torch

from tlt.model.drafter import Drafter, DrafterConfig, training_pairs
from tlt.services.drafter.loss import drafter_loss
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.spec.bandit import DEFAULT_BUCKET_ARMS
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.types import GenerationRequest, SamplingParams

N_PROMPTS = 104
MAX_TOKENS = 20
ARMS = sorted({a for bucket in DEFAULT_BUCKET_ARMS for a in bucket} | {"8_1_9", "5_1_6", "3_1_4", "4_2_8"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return random_checkpoint(tmp_path_factory.mktemp("lossless") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256, seed=7,
                             weight_scale=0.03)


def _requests() -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = []
    for i in range(N_PROMPTS):
        length = int(torch.randint(3, 60, (1,), generator=g))
        if i % 2:  # half repeat a short motif (n-gram matches), half are plain random tokens
            motif = torch.randint(3, 250, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            prompt = (motif * 30)[:length]
        else:
            prompt = torch.randint(3, 250, (length,), generator=g).tolist()
        out.append(GenerationRequest(f"p{i}", tuple(prompt), params))
    return out


def _engine(ckpt, batch: int) -> LLMEngine:
    return LLMEngine(ckpt, EngineConfig(max_num_seqs=batch, block_size=8, max_num_batched_tokens=4096))


@pytest.fixture(scope="module")
def reference(ckpt):
    """Plain greedy tokens per request (batch-independent: tests/test_engine.py checks that)."""
    return {c.request_id: c.token_ids for c in _engine(ckpt, 64).generate(_requests())}


@pytest.fixture(scope="module")
def drafter(ckpt, reference):
    """A drafter trained briefly on the target's features of the reference run (the first 16 requests)."""
    eng = _engine(ckpt, 64)
    reqs = [GenerationRequest(r.request_id, r.prompt_token_ids,
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                             return_features=True)) for r in _requests()[:16]]
    outs = eng.generate(reqs)
    torch.manual_seed(0)
    d = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    toks = torch.tensor([[c.prompt_token_ids[-1], *c.token_ids[:-1]] for c in outs])
    pairs = training_pairs(toks, torch.stack([c.features.float() for c in outs]))
    positions = pairs.positions + torch.tensor([[len(c.prompt_token_ids) - 1] for c in outs])
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(120):
        loss = drafter_loss(d(pairs.input_ids, pairs.features, positions), pairs.target, eng.model.lm_head)
        opt.zero_grad()
        loss.loss.backward()
        opt.step()
    return d.eval()


def _configs():
    """(drafter, mode, static arm, batch): every arm statically and adaptive, for both drafters; the batch
    sizes rotate so each drafter meets each of 1, 7, 64 several times."""
    out = []
    for drafter in ("ngram", "learned"):
        for i, arm in enumerate([*ARMS, None]):
            out.append((drafter, "adaptive" if arm is None else "static", arm, (1, 7, 64)[i % 3]))
        out.append((drafter, "adaptive+plain", None, 7))  # the bandit may also choose not to speculate
    return out


@pytest.mark.parametrize("drafter_kind,mode,arm,batch", _configs())
def test_greedy_identical_with_speculation(ckpt, reference, drafter, drafter_kind, mode, arm, batch):
    eng = _engine(ckpt, batch)
    arms = {} if mode != "adaptive+plain" else {"bucket_arms": tuple((*b, "plain") for b in SpecConfig().bucket_arms)}
    spec = SpecConfig(mode=mode.removesuffix("+plain"), static_arm=arm or "8_4_16", threshold=64, hysteresis_steps=1,
                      drafter=drafter_kind, drafter_path="(in memory)" if drafter_kind == "learned" else "",
                      epsilon=0.3, verify_token_budget=0, **arms)  # every arm at every batch, 8_4_48 x 64 too
    if drafter_kind == "learned":
        drafter.set_shared(eng.model.embed, eng.model.lm_head)
    eng.enable_spec(spec, drafter if drafter_kind == "learned" else None)
    outs = eng.generate(_requests())
    got = {c.request_id: c.token_ids for c in outs}
    wrong = [rid for rid in reference if got[rid] != reference[rid]]
    assert not wrong, f"{len(wrong)} of {N_PROMPTS} requests differ from plain greedy, e.g. {wrong[:3]}"
    st = eng.stats().spec
    assert st["verify_steps"] > 0 and st["mean_accept_len"] > 1.05, st  # speculation ran and drafts were accepted
    if mode.startswith("adaptive"):
        assert len(st["arms"]) > 1, st["arms"]  # the bandit explored
    if mode == "adaptive+plain":
        assert st["arms"]["plain"]["verify_steps"] > 0, st["arms"]  # some steps decoded plainly between verify steps



@pytest.fixture(scope="module")
def chain_scores(ckpt, drafter):
    """Cumulative draft log-probs [rows, 8] of the drafter's chains on the first 16 requests (batch 7)."""
    eng = _engine(ckpt, 7)
    drafter.set_shared(eng.model.embed, eng.model.lm_head)
    eng.enable_spec(SpecConfig(mode="static", static_arm="8_1_9", threshold=64, hysteresis_steps=1,
                               drafter="learned", drafter_path="(in memory)"), drafter)
    runtime, seen = eng.spec_decoder.source.runtime, []
    chain = runtime.chain

    def record(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        toks, scores, probs = chain(*args, **kw)
        seen.append(scores)
        return toks, scores, probs

    runtime.chain = record
    eng.generate(_requests()[:16])
    return torch.cat(seen)


@pytest.mark.parametrize("depth,batch", [(2, 7), (1, 1), (3, 64)])
def test_greedy_identical_with_confidence_cut_chains(ckpt, reference, drafter, chain_scores, depth, batch):
    """chain_min_prob cuts each sequence's chain where its cumulative draft probability falls below it.
    The threshold is the median of this drafter's cumulative probability at `depth` (measured above),
    so about half the rows of a verify step keep more drafts than the others: rows carry different
    numbers of drafts (padding, -1 tokens past each cut) and chains stop early. Output must not change."""
    min_prob = float(chain_scores[:, depth - 1].median().exp())
    eng = _engine(ckpt, batch)
    spec = SpecConfig(mode="static", static_arm="8_1_9", threshold=64, hysteresis_steps=1, drafter="learned",
                      drafter_path="(in memory)", chain_min_prob=min_prob)
    drafter.set_shared(eng.model.embed, eng.model.lm_head)
    eng.enable_spec(spec, drafter)
    source, counts = eng.spec_decoder.source, []
    draft = source.draft

    def record(seqs, arm, **kw):  # noqa: ANN001, ANN003, ANN202
        tree, n = draft(seqs, arm, **kw)
        counts.append(n)
        return tree, n

    source.draft = record
    outs = eng.generate(_requests())
    got = {c.request_id: c.token_ids for c in outs}
    wrong = [rid for rid in reference if got[rid] != reference[rid]]
    assert not wrong, f"{len(wrong)} of {N_PROMPTS} requests differ from plain greedy, e.g. {wrong[:3]}"
    st = eng.stats().spec
    assert st["mean_accept_len"] > 1.05, st
    assert 0 < st["drafted_tokens"] < 8 * st["arms"]["8_1_9"]["seq_steps"], st  # the cut dropped some drafts
    if batch > 1:
        assert any(len(set(n.tolist())) > 1 for n in counts)  # rows of one step kept different numbers
