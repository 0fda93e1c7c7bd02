"""SpecDecoder inside the native engine on a tiny random Qwen2 checkpoint (built in code, no downloads).

The engine's own step drives the decoder (schedule -> draft/verify/accept or plain -> emit with
per-token stops). Greedy speculative output must equal plain greedy output token for token, with
both drafters; sampled logprobs must equal the target's filtered log q; a drafter trained on the
target's features must be accepted (pair alignment end to end). The bandit's rewards, budget and
hysteresis inside the engine: tests/test_spec_decoder_bandit.py (shared set-up: tests/spec_decoder_helpers.py).
"""

from __future__ import annotations

import pytest
import torch

from spec_decoder_helpers import SPEC, STATIC, _engine, _requests, _spec_generate, ckpt  # noqa: F401 - ckpt: fixture
from tlt.model.drafter import Drafter, DrafterConfig, training_pairs
from tlt.services.drafter.loss import drafter_loss
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.decoder import SpecDecoder, build_spec_decoder
from tlt.services.rollout.types import GenerationRequest, SamplingParams


@pytest.mark.parametrize("mode,arm", [("adaptive", "8_4_16"), ("static", "4_2_8")])
def test_greedy_spec_equals_plain_greedy_with_ngram_drafter(ckpt, mode, arm):
    plain = _engine(ckpt).generate(_requests())
    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **dict(SPEC, mode=mode, static_arm=arm)), eng.runner,
                      eng.block_manager)
    spec = _spec_generate(eng, dec, _requests())
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    for a, b in zip(spec, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    st = dec.stats()
    assert st["verify_steps"] > 5, st
    if mode == "static":  # deterministic trees (the bandit's choices depend on timing)
        assert st["kv_copies"] > 0, st  # some accepted paths left the first branch: their K/V moved
    assert st["mean_accept_len"] > 1.0, st  # the random model repeats itself: n-grams get accepted


def test_greedy_spec_equals_plain_greedy_with_learned_drafter(ckpt):
    plain = _engine(ckpt).generate(_requests(2, 1, 24))
    eng = _engine(ckpt)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    dec = SpecDecoder(SpecConfig(drafter="learned", drafter_path="(in memory)", **SPEC), eng.runner,
                      eng.block_manager, drafter)
    spec = _spec_generate(eng, dec, _requests(2, 1, 24))
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert dec.stats()["verify_steps"] > 5


def test_build_from_config_loads_a_saved_drafter(ckpt, tmp_path):
    eng = _engine(ckpt)
    assert build_spec_decoder(SpecConfig(mode="off"), eng.runner, eng.block_manager) is None
    torch.manual_seed(1)
    Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head).save(tmp_path / "d")
    dec = build_spec_decoder(SpecConfig(drafter="learned", drafter_path=str(tmp_path / "d"), **SPEC), eng.runner,
                             eng.block_manager)
    assert dec.source.drafter.embed.data_ptr() == eng.model.embed.data_ptr()  # shared, not copied
    plain = _engine(ckpt).generate(_requests(1, 1, 12))
    assert [c.token_ids for c in _spec_generate(eng, dec, _requests(1, 1, 12))] == [c.token_ids for c in plain]


def test_no_room_for_drafts_falls_back_to_plain_decoding(ckpt):
    plain = _engine(ckpt, blocks=64).generate(_requests(1, 1, 20))
    eng = _engine(ckpt, blocks=7)  # 28 slots: a 25-token sequence leaves no room for 8-node trees at the end
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    cfg = SpecConfig(drafter="learned", drafter_path="(in memory)", **dict(SPEC, mode="static", static_arm="4_2_8"))
    dec = SpecDecoder(cfg, eng.runner, eng.block_manager, drafter)
    spec = _spec_generate(eng, dec, _requests(1, 1, 20))
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert dec.stats()["no_room"] > 0 and dec.stats()["verify_steps"] > 0
    # the decision is exported: on /metrics and in gRPC GetStatus (neither carried it)
    from tlt.services.common.metrics import Metrics
    from tlt.services.rollout.grpc_api import spec_status
    from tlt.services.rollout.spec_metrics import SpecMetrics

    metrics = Metrics("rollout")
    SpecMetrics(metrics).update(0, dec.stats())
    line = next(x for x in metrics.render().decode().splitlines() if x.startswith("rollout_spec_no_room_steps_total{"))
    assert float(line.split()[-1]) == dec.stats()["no_room"]
    status = spec_status(dec.stats())
    assert (status.no_room, status.over_budget, status.switches) == (
        dec.stats()["no_room"], dec.stats()["over_budget"], dec.stats()["switches"])


def test_the_bandit_counts_only_the_steps_an_arm_ran(ckpt):
    """A step whose drafts find no KV room decodes plainly: the adaptive bandit's chosen counts stay those of
    the verify steps each arm ran (they counted the withdrawn choices too)."""
    plain = _engine(ckpt, blocks=64).generate(_requests(1, 1, 20))
    eng = _engine(ckpt, blocks=7)  # as above: the last steps have no room for 8-node trees
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    cfg = SpecConfig(drafter="learned", drafter_path="(in memory)",
                     **dict(SPEC, bucket_thresholds=(1,), bucket_arms=(("4_2_8",),)))
    dec = SpecDecoder(cfg, eng.runner, eng.block_manager, drafter)
    assert [c.token_ids for c in _spec_generate(eng, dec, _requests(1, 1, 20))] == [c.token_ids for c in plain]
    st = dec.stats()
    assert st["no_room"] > 0 and st["verify_steps"] > 0, st
    (bucket,) = st["bandit"]
    assert bucket["arms"][0]["chosen"] == st["arms"]["4_2_8"]["verify_steps"] == st["verify_steps"], st
    assert bucket["explored"] + bucket["exploited"] == st["verify_steps"], st


@pytest.mark.parametrize("max_tokens", [9, 13, 17, 24])
def test_accept_length_counts_only_the_tokens_a_stop_leaves(ckpt, max_tokens):
    """A stop (here max_tokens) cuts the rest of an accepted path: those tokens are never appended, yet they counted
    in emitted_tokens, the arms' `emitted` and so mean_accept_len (`tlt bench rollout`'s accept column, /metrics):
    32 tokens over 12 verify steps where 30 were kept. The truth: each completion's own count of the tokens verify
    steps appended to it (SpecCounters.accepted_tokens, the engine's `_emit`)."""
    eng = _engine(ckpt, blocks=256)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **dict(SPEC, mode="static", static_arm="8_1_9")), eng.runner,
                      eng.block_manager)
    out = _spec_generate(eng, dec, _requests(3, 2, max_tokens))
    st = dec.stats()
    kept = sum(c.spec.accepted_tokens for c in out)
    assert st["verify_steps"] > 0 and all(len(c.token_ids) == max_tokens for c in out), st
    assert st["emitted_tokens"] == kept == sum(a["emitted"] for a in st["arms"].values()), st
    assert st["mean_accept_len"] == pytest.approx(kept / st["seq_steps"])


def test_drafts_never_pass_the_context_limit(ckpt):
    reqs = [GenerationRequest("c", _requests(1, 1)[0].prompt_token_ids,
                              SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))]
    cfg = EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=30)
    plain = LLMEngine(ckpt, cfg).generate(reqs)
    eng = LLMEngine(ckpt, cfg)
    # the engine keeps spare RoPE rows past the limit for draft trees; cut them to test the guard
    eng.model.cos, eng.model.sin = eng.model.cos[:30], eng.model.sin[:30]
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    dec = SpecDecoder(SpecConfig(drafter="learned", drafter_path="(in memory)", **dict(SPEC, mode="static",
                                                                                     static_arm="4_2_8")),
                      eng.runner, eng.block_manager, drafter)
    spec = _spec_generate(eng, dec, reqs)
    assert spec[0].token_ids == plain[0].token_ids and len(spec[0].prompt_token_ids) + len(spec[0].token_ids) == 30
    assert dec.stats()["no_room"] > 0


def test_trained_drafter_is_accepted(ckpt):
    """Train the drafter on the target's own features (pairs built by `training_pairs`), then speculate:
    acceptance well above 1 shows that training and inference align pairs the same way."""
    reqs = _requests(2, 1, 40)
    feat_reqs = [GenerationRequest(r.request_id, r.prompt_token_ids,
                                   SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, return_features=True))
                 for r in reqs]
    eng = _engine(ckpt)
    outs = eng.generate(feat_reqs)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    # both responses have 40 tokens: one batch [2, 40]; the pair at index j sits at position p - 1 + j + 1
    toks = torch.tensor([[c.prompt_token_ids[-1], *c.token_ids[:-1]] for c in outs])  # positions p-1 .. p+n-2
    pairs = training_pairs(toks, torch.stack([c.features.float() for c in outs]))
    positions = pairs.positions + torch.tensor([[len(c.prompt_token_ids) - 1] for c in outs])
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(150):
        pred = drafter(pairs.input_ids, pairs.features, positions)
        loss = drafter_loss(pred, pairs.target, eng.model.lm_head)
        opt.zero_grad()
        loss.loss.backward()
        opt.step()
    assert loss.top1 > 0.9, loss
    drafter.eval()
    eng = _engine(ckpt)
    drafter.set_shared(eng.model.embed, eng.model.lm_head)
    dec = SpecDecoder(SpecConfig(drafter="learned", drafter_path="(in memory)", **STATIC), eng.runner,
                      eng.block_manager, drafter)
    spec = _spec_generate(eng, dec, reqs, observe=False)
    assert [c.token_ids for c in spec] == [c.token_ids for c in outs]
    assert dec.stats()["mean_accept_len"] > 2.0, dec.stats()
    assert dec.stats()["cold_starts"] == len(reqs)  # nobody fed the plain steps: one root-only step each
    # fed with the plain steps' features, the drafter is warm the moment SD switches on
    eng = _engine(ckpt)
    drafter.set_shared(eng.model.embed, eng.model.lm_head)
    dec = SpecDecoder(SpecConfig(drafter="learned", drafter_path="(in memory)", **STATIC), eng.runner,
                      eng.block_manager, drafter)
    spec = _spec_generate(eng, dec, reqs)
    assert [c.token_ids for c in spec] == [c.token_ids for c in outs]
    assert dec.stats()["cold_starts"] == 0 and dec.stats()["mean_accept_len"] > 2.0, dec.stats()


def test_sampled_spec_logprobs_are_the_targets_under_the_filters(ckpt):
    """Sampling with speculation: every emitted token's logprob equals log q (temperature 0.8, top_p 0.9)
    computed by `transformers` on the whole sequence, so no token outside the filtered support appears."""
    from transformers import AutoModelForCausalLM

    from tlt.services.rollout.spec.filters import filter_logits

    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, logprobs=0, seed=3)
    reqs = [GenerationRequest(f"s{i}", r.prompt_token_ids, params, 2) for i, r in enumerate(_requests(2, 1))]
    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **SPEC), eng.runner, eng.block_manager)
    outs = _spec_generate(eng, dec, reqs)
    assert dec.stats()["verify_steps"] > 5
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for c in outs:
        ids = torch.tensor([list(c.prompt_token_ids) + list(c.token_ids)])
        with torch.no_grad():
            logits = hf(ids).logits[0]
        p = len(c.prompt_token_ids)
        logq = filter_logits(logits[p - 1 : -1], 0.8, 0, 0.9, 0.0).log_softmax(-1)
        want = logq.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        assert torch.isfinite(want).all()
        assert c.logprobs == pytest.approx(want.tolist(), abs=2e-3)


def test_top_logprobs_of_speculated_tokens(ckpt):
    """A verify step's k best alternatives per emitted token are those of the target at that position."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    req = GenerationRequest("t", _requests(1, 1)[0].prompt_token_ids, params)
    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **SPEC), eng.runner, eng.block_manager)
    eng.add_request(req)
    for _ in range(24):  # plain steps: enough text for the n-gram drafter to match
        eng.step()
    seq = eng.scheduler.running[0]
    batch = eng.scheduler.schedule()
    em = dec.decode(batch.seqs)[0]
    assert len(em.top_logprobs) == len(em.token_ids) >= 2  # drafts were accepted
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ctx = seq.token_ids[:]  # emissions are not appended when decode() is called directly
    for tok, tops in zip(em.token_ids, em.top_logprobs):
        with torch.no_grad():
            lp = hf(torch.tensor([ctx])).logits[0, -1].log_softmax(-1)
        vals, ids = lp.topk(3)
        assert list(tops) == ids.tolist() and list(tops.values()) == pytest.approx(vals.tolist(), abs=1e-4)
        ctx.append(tok)


def test_tree_steps_return_the_accepted_branchs_top_logprobs_and_features(ckpt):
    """A token accepted off a tree's first branch (node path[k], not node k) reports the alternatives and the
    target feature of the node that emitted it: each token's top logprobs and its feature row (return_features,
    the drafter service's training data) are plain greedy decoding's. Node k's instead gave another position's."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3, return_features=True)
    reqs = lambda: [GenerationRequest(r.request_id, r.prompt_token_ids, params, r.n) for r in _requests()]  # noqa: E731
    plain = _engine(ckpt).generate(reqs())
    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **STATIC), eng.runner, eng.block_manager)
    spec = _spec_generate(eng, dec, reqs())
    assert dec.stats()["kv_copies"] > 0  # some accepted paths left the first branch
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    for a, b in zip(spec, plain):
        assert len(a.top_logprobs) == len(b.top_logprobs) == len(a.token_ids)
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert list(ta) == list(tb) and list(ta.values()) == pytest.approx(list(tb.values()), abs=1e-4)
        assert a.features.shape == b.features.shape
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=2e-3, rtol=0)


def test_seeded_min_p_sampling_with_speculation_emits_plain_samplings_tokens(ckpt):
    """min_p is one of the target's filters in the verify step too: a seeded request with min_p (a low temperature
    to make the random model's distribution peaked enough for min_p to cut) emits plain sampling's tokens and
    logprobs with tree speculation on. Without it the walk drew from q without the cut."""
    params = SamplingParams(temperature=0.05, min_p=0.5, max_tokens=30, ignore_eos=True, logprobs=0, seed=11)
    reqs = lambda: [GenerationRequest(f"m{i}", r.prompt_token_ids, params, 2)  # noqa: E731
                    for i, r in enumerate(_requests(2, 1))]
    plain = _engine(ckpt).generate(reqs())
    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **STATIC), eng.runner, eng.block_manager)
    spec = _spec_generate(eng, dec, reqs())
    assert dec.stats()["verify_steps"] > 5
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    for a, b in zip(spec, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_stop_token_inside_an_accepted_run_ends_the_sequence_there(ckpt):
    base = _engine(ckpt).generate(_requests(1, 1, 40))[0].token_ids
    stop = base[12]  # the random model repeats itself: this token sits inside a run the drafts predict
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0, stop_token_ids=(stop,))
    reqs = [GenerationRequest(r.request_id, r.prompt_token_ids, params, r.n) for r in _requests(1, 1, 40)]
    plain = _engine(ckpt).generate(reqs)
    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **dict(SPEC, hysteresis_steps=1)), eng.runner, eng.block_manager)
    spec = _spec_generate(eng, dec, reqs)
    assert spec[0].token_ids == plain[0].token_ids and spec[0].token_ids[-1] == stop
    assert spec[0].finish_reason == plain[0].finish_reason
    assert dec.stats()["verify_steps"] > 0


def test_drafter_weight_push_through_the_engine(ckpt):
    from tlt.model.drafter import DrafterError

    eng = _engine(ckpt)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    eng.enable_spec(SpecConfig(drafter="learned", drafter_path="(in memory)", **SPEC), drafter)
    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in drafter.state_dict().items()}
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    bad = dict(new, **{"lm_head.weight": eng.model.lm_head.clone()})
    with pytest.raises(DrafterError, match="embedding/lm_head"):
        eng.update_weights("drafter", bad, 3)
    partial = {k: v for k, v in new.items() if k != "fc.weight"}
    with pytest.raises(DrafterError, match="missing"):
        eng.update_weights("drafter", partial, 3)
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())  # a bad push changes nothing
    assert eng.versions.drafter == 0  # still the drafter loaded at start
    bandit = eng.spec_decoder.bandit
    arm = bandit.arms[0][0]
    for _ in range(20):
        bandit.record(1, arm, 1, 1.0)  # the old drafter's rewards
    eng.update_weights("drafter", new, 3)
    assert eng.versions.drafter == 3
    assert len(bandit._rewards[0][arm][1]) == SpecConfig().rewards_kept_on_swap  # the push cut them to the last few
    assert all(torch.equal(new[k], v) for k, v in drafter.state_dict().items())
    plain = _engine(ckpt).generate(_requests(1, 1, 12))
    assert [c.token_ids for c in eng.generate(_requests(1, 1, 12))] == [c.token_ids for c in plain]


def test_engine_sampling_with_speculation_matches_the_exact_distribution(ckpt):
    """End to end through the engine: 3,000 samples (10 GRPO groups of 300, each with its own seed, as the
    servers seed the prompts of one request) of 3 tokens at temperature 1 with top_k 3 (27 possible
    continuations), speculating on every decode step, against the exact distribution enumerated with
    `transformers`: chi-square p > 0.001, nothing outside the support. (Ten groups, not one of 3,000: the
    n-gram drafter scans the n-gram hits of every sibling of a group for each sequence, a cost that grows
    with the square of the group's size; one group of 3,000 spent two thirds of the test's time there. The
    samples are the same in number and independence, so the chi-square test's power is unchanged.)
    The prompt holds "B y z C" for each first token y the target allows after it and each second token
    z it allows after y (sets grown until they hold every support the final prompt induces) and ends
    with "A B": a group's first sample draws its first token at prefill, then the n-gram tree's first level
    holds every allowed second token, so the second token always comes through acceptance, the third is the
    bonus. The other samples start a step later (they copy the prompt's partial last block: BlockManager)
    and draw their first token through a verify step too: from the tree's first level, which holds every
    allowed first token ("B y" in the prompt); their second from the second level or as the bonus."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    from tlt.services.rollout.engine.sequence import prompt_params
    from tlt.services.rollout.spec.filters import filter_logits

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def support(ctx):
        with torch.no_grad():
            q = filter_logits(hf(torch.tensor([list(ctx)])).logits[0, -1], 1.0, 3).softmax(-1)
        return q, torch.nonzero(q).flatten().tolist()

    def build(follow):  # "B y z C" for every first token y the target may draw and each z it allows next
        return tuple(t for y in sorted(follow) for z in sorted(follow[y]) for t in (9, y, z, 7)) + (5, 9)

    follow: dict[int, set[int]] = {}
    for _ in range(30):  # grow the sets until they contain every support the final prompt induces
        prompt = build(follow)
        grew = False
        for y in support(prompt)[1]:
            allowed = set(support(prompt + (y,))[1])
            if not allowed <= follow.get(y, set()):
                follow[y] = follow.get(y, set()) | allowed
                grew = True
        if not grew:
            break
    assert not grew, "the supports did not settle: pick other filler tokens"
    assert max(len(v) for v in follow.values()) <= 8  # the arm's topk below
    n, length, groups = 3000, 3, 10
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=length, ignore_eos=True, seed=11)
    eng = LLMEngine(ckpt, EngineConfig(num_kv_blocks=20000, block_size=4, max_num_seqs=n, max_num_batched_tokens=8 * n))
    cfg = SpecConfig(drafter="ngram", mode="static", static_arm="2_8_17", threshold=n, hysteresis_steps=1,
                     verify_token_budget=0)  # one verify step over all 3000 sequences: past any budget
    dec = SpecDecoder(cfg, eng.runner, eng.block_manager)
    outs = _spec_generate(eng, dec, [GenerationRequest(f"g{i}", prompt, prompt_params(params, i), n // groups)
                                     for i in range(groups)])
    st = dec.stats()
    # each group's first sample prefills its prompt and draws its first token plainly; the others start a step
    # later, over its copied K/V (BlockManager's partial tails), and draw every token through verify steps:
    # one over all 3000 sequences, and one for those whose third token was not drafted (the tree's 8 second-level
    # nodes cannot hold every allowed (y, z) pair, so some always are); the seed makes it exactly 2
    assert len(outs) == n and st["verify_steps"] == 2, st
    # drafts were accepted: 1.68 tokens kept a sequence a verify step (paths past max_tokens were counted: 1.9+)
    kept = sum(o.spec.accepted_tokens for o in outs)
    assert st["mean_accept_len"] == pytest.approx(kept / st["seq_steps"]) and kept / st["seq_steps"] > 1.5, st
    assert st["kv_copies"] > 0, st
    frontier = [((), 1.0)]
    for _ in range(length):
        nxt = []
        for toks, pr in frontier:
            q, sup = support(prompt + toks)
            nxt += [(toks + (t,), pr * float(q[t])) for t in sup]
        frontier = nxt
    exact = dict(frontier)
    counts: dict[tuple[int, ...], int] = {}
    for c in outs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    assert set(counts) <= set(exact)
    obs = [counts.get(k, 0) for k in exact]
    exp = [n * p for p in exact.values()]
    assert len(exp) == 27 and min(exp) > 5
    scale = sum(obs) / sum(exp)
    assert chisquare(obs, [e * scale for e in exp]).pvalue > 1e-3


def _drafter_trained_on(ckpt, prompt: tuple[int, ...], steps: int = 150) -> Drafter:
    """A drafter fitted to the target's features along its greedy continuation of `prompt` (and of a few
    random prompts), so that its distribution p is close to the target's q there."""
    eng = _engine(ckpt)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, return_features=True)
    reqs = [GenerationRequest("p", prompt, params)] + [GenerationRequest(r.request_id, r.prompt_token_ids, params)
                                                       for r in _requests(3, 1)]
    outs = eng.generate(reqs)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, betas=(0.9, 0.95))
    batches = []
    for c in outs:
        toks = torch.tensor([[c.prompt_token_ids[-1], *c.token_ids[:-1]]])
        pairs = training_pairs(toks, c.features.float()[None])
        batches.append((pairs, pairs.positions + len(c.prompt_token_ids) - 1))
    for _ in range(steps):
        for pairs, positions in batches:
            loss = drafter_loss(drafter(pairs.input_ids, pairs.features, positions), pairs.target, eng.model.lm_head)
            opt.zero_grad()
            loss.loss.backward()
            opt.step()
    return drafter.eval()


def _chain_sampling_counts(ckpt, drafter, prompt, n: int, length: int, params: SamplingParams,
                           chain_min_prob: float = 0.0):
    eng = LLMEngine(ckpt, EngineConfig(num_kv_blocks=20000, block_size=4, max_num_seqs=n, max_num_batched_tokens=8 * n))
    drafter.set_shared(eng.model.embed, eng.model.lm_head)
    cfg = SpecConfig(drafter="learned", drafter_path="(in memory)", mode="static", static_arm="3_1_4", threshold=n,
                     hysteresis_steps=1, verify_token_budget=0,  # one verify step over all n sequences
                     chain_min_prob=chain_min_prob)
    dec = SpecDecoder(cfg, eng.runner, eng.block_manager, drafter)
    outs = _spec_generate(eng, dec, [GenerationRequest("g", prompt, params, n)])
    counts: dict[tuple[int, ...], int] = {}
    for c in outs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    return counts, dec.stats(), outs


CUT = 0.12  # chain_min_prob of the cut-chain run below


def test_sampled_chains_through_the_engine_match_the_exact_distribution(ckpt, monkeypatch):
    """Chains sampled from a learned drafter's own distribution p and verified by rejection sampling
    (SpecConfig.chain_sampling, on whenever every sequence samples): 3,000 samples of 3 tokens at
    temperature 1, top_k 3, against the exact distribution from `transformers` (chi-square p > 0.001).
    The first token comes from the prefill step, the other two from one verify step: an accepted draft
    or the residual draw, then the next. The rule's power against biased variants is shown where p and
    q can be made to differ (tests/test_lossless_sampling.py); with a drafter this close to the target a
    biased rule changes little here. What this catches is the wiring (both tried): the draft
    distributions of the wrong level fail the chi-square (p ~ 1e-57), an unfiltered q the acceptance.
    The same with the confidence cut (`chain_min_prob`): rows keep 1 or 2 of their 3 drafts here. Judging the
    kept drafts against p instead of the cut's r passes here too (this drafter's p is too close to q); the
    harness's broken-rejection-cut case shows the chi-square failing it."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    from tlt.services.rollout.spec import decoder as decoder_module
    from tlt.services.rollout.spec import drafting as drafting_module
    from tlt.services.rollout.spec.accept import chain_accept_rejection, cut_sampled_chain
    from tlt.services.rollout.spec.filters import filter_logits

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    prompt = tuple(_requests(1, 1)[0].prompt_token_ids)
    drafter = _drafter_trained_on(ckpt, prompt)
    n, length = 3000, 3
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=length, ignore_eos=True, seed=13, logprobs=0)
    frontier = [((), 1.0)]
    for _ in range(length):
        nxt = []
        for toks, pr in frontier:
            with torch.no_grad():
                q = filter_logits(hf(torch.tensor([list(prompt + toks)])).logits[0, -1], 1.0, 3).softmax(-1)
            nxt += [(toks + (t,), pr * float(q[t])) for t in torch.nonzero(q).flatten().tolist()]
        frontier = nxt
    exact = dict(frontier)
    assert len(exact) == 27

    def pvalue(counts):  # noqa: ANN001, ANN202
        assert set(counts) <= set(exact), "a continuation outside the filtered support"
        obs, exp = [counts.get(k, 0) for k in exact], [n * p for p in exact.values()]
        scale = sum(obs) / sum(exp)
        return chisquare(obs, [e * scale for e in exp]).pvalue

    calls, cuts = [], []

    def counting(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append((args[1], kw.get("counts")))  # the distributions the drafts are judged against, and the counts
        return chain_accept_rejection(*args, **kw)

    def recording_cut(drafts, probs, min_prob):  # noqa: ANN001, ANN202
        kept, r = cut_sampled_chain(drafts, probs, min_prob)
        cuts.append((kept, r))
        return kept, r

    monkeypatch.setattr(decoder_module, "chain_accept_rejection", counting)
    monkeypatch.setattr(drafting_module, "cut_sampled_chain", recording_cut)
    counts, st, outs = _chain_sampling_counts(ckpt, drafter, prompt, n, length, params)
    assert calls and st["verify_steps"] == len(calls)  # every verify step went through rejection sampling
    # drafts were accepted often enough to matter (the drafter fitted here, from its seeded float32 training,
    # gives 1.29 on a 2-core AVX-512 Xeon and a little above 1.3 on Zen VMs; with no draft ever accepted: 1.0)
    assert st["mean_accept_len"] > 1.2, st
    assert pvalue(counts) > 1e-3
    # the confidence cut on sampled chains (chain_min_prob): rows keep different numbers of drafts, offered
    # from p restricted to what the cut keeps (accept.cut_sampled_chain); other samples, the same distribution
    uncut_calls = len(calls)
    assert not cuts  # chain_min_prob 0: no cut, no work
    cut_counts, cut_st, _ = _chain_sampling_counts(ckpt, drafter, prompt, n, length, params, chain_min_prob=CUT)
    full = 3 * cut_st["seq_steps"]  # the 3_1_4 arm's drafts, uncut
    assert 0.2 * full < cut_st["drafted_tokens"] < 0.9 * full, cut_st  # the cut ran, and kept some drafts
    # every verify step judged its kept drafts against the cut's r (not the drafter's p), with the cut's counts
    # (this drafter is too close to q for the chi-square below to see p used instead: the harness's does)
    assert len(cuts) == len(calls) - uncut_calls == cut_st["verify_steps"]
    for (kept, r), (judged, counts) in zip(cuts, calls[uncut_calls:]):
        assert judged.shape[1] == int(kept.max()) and torch.equal(judged, r[:, : judged.shape[1]])
        assert counts is not None and torch.equal(counts.cpu(), kept.cpu())
    assert pvalue(cut_counts) > 1e-3
    # a cut above every first draft's p (this drafter's are 0.3-0.4): each verify step a chain of no drafts
    none_counts, none_st, _ = _chain_sampling_counts(ckpt, drafter, prompt, n, length, params, chain_min_prob=0.9)
    assert none_st["verify_steps"] > 0 and none_st["drafted_tokens"] == 0, none_st
    assert pvalue(none_counts) > 1e-3
    # logprobs are the target's filtered log q of each emitted token
    c = outs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt + tuple(c.token_ids))])).logits[0]
    logq = filter_logits(logits[len(prompt) - 1 : -1], 1.0, 3).log_softmax(-1)
    assert c.logprobs == pytest.approx(
        logq.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1).tolist(), abs=2e-3)


def test_cut_sampled_chains_beside_a_greedy_row_keep_their_cut(ckpt, monkeypatch):
    """A step mixing rows whose chains were sampled from the drafter (rejection sampling) with a greedy row (the
    tree walk) verifies each part as it would be alone: the sampled rows keep the drafts the confidence cut left
    them (1 or 2 of 3 here, `drafted`), not the padded chain, so the sampled request emits the same tokens with or
    without the greedy request beside it (without its counts the rejection part read the cut drafts' -1 tokens)."""
    from tlt.services.rollout.spec import decoder as decoder_module

    prompt = tuple(_requests(1, 1)[0].prompt_token_ids)
    drafter = _drafter_trained_on(ckpt, prompt, steps=60)
    sampled = GenerationRequest("s", prompt, SamplingParams(temperature=1.0, top_k=3, max_tokens=12, ignore_eos=True,
                                                            seed=5), 6)
    greedy = GenerationRequest("g", _requests(2, 1)[1].prompt_token_ids,
                               SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    calls = []
    real = decoder_module._rejection

    def recording(full, tree, filters, keys, first, drafted=None):  # noqa: ANN001, ANN202
        calls.append((tree.tokens.shape[0], None if drafted is None else drafted.tolist()))
        return real(full, tree, filters, keys, first, drafted)

    monkeypatch.setattr(decoder_module, "_rejection", recording)

    def run(reqs):  # noqa: ANN001, ANN202
        eng = LLMEngine(ckpt, EngineConfig(num_kv_blocks=400, block_size=4, max_num_batched_tokens=256))
        drafter.set_shared(eng.model.embed, eng.model.lm_head)
        cfg = SpecConfig(drafter="learned", drafter_path="(in memory)", mode="static", static_arm="3_1_4",
                         threshold=16, hysteresis_steps=1, verify_token_budget=0, chain_min_prob=CUT,
                         chain_sampling=True)
        dec = SpecDecoder(cfg, eng.runner, eng.block_manager, drafter)
        return {(c.request_id, c.sample_index): c.token_ids for c in _spec_generate(eng, dec, reqs)}

    alone = run([sampled])
    calls.clear()
    crowded = run([sampled, greedy])
    # the mixed steps' rejection part: the 6 sampled rows of 7, keeping different numbers of drafts
    assert any(rows == 6 and drafted is not None and len(set(drafted)) > 1 for rows, drafted in calls), calls
    assert {k: v for k, v in crowded.items() if k[0] == "s"} == alone
