"""SpecDecoder's arm choice inside the native engine (tiny random Qwen2, tests/spec_decoder_helpers.py): the
bandit's reward is the tokens a whole engine step keeps over its wall time (a drafter's catch-up is not charged
to the arm drafted next; after "plain" arm steps alone it is theirs, and after a prefill, SD off, an over-budget or
a no-room step it is no arm's), the "plain" arm lets it stop speculating, a verify-token budget decodes plainly
when no arm fits, and the hysteresis counts decode steps only (the output, where compared, is the plain greedy
output).
"""

from __future__ import annotations

import torch

from spec_decoder_helpers import SPEC, STATIC, _engine, _requests, _spec_generate, ckpt  # noqa: F401 - ckpt: fixture
from tlt.model.drafter import Drafter, DrafterConfig
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.decoder import SpecDecoder
from tlt.services.rollout.types import GenerationRequest, SamplingParams


def test_bandit_reward_is_tokens_per_whole_engine_step(ckpt, monkeypatch):
    """TLT.md section 5: reward = tokens / step wall time. The engine closes each verify step's reward
    after emitting, so time spent outside `decode` (here a 30 ms emission) is in it: every reward is
    below emitted / 0.03 s. Rewarding the decode call alone would favour short arms, which need more
    steps (and so more of the per-step costs) for the same tokens."""
    import time as _time

    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **SPEC), eng.runner, eng.block_manager)
    real_emit = eng._emit

    def slow_emit(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        _time.sleep(0.03)
        return real_emit(*args, **kw)

    monkeypatch.setattr(eng, "_emit", slow_emit)
    records = []
    real_record = dec.bandit.record
    monkeypatch.setattr(dec.bandit, "record", lambda b, arm, n, s: records.append((n, s)) or real_record(b, arm, n, s))
    _spec_generate(eng, dec, _requests(2, 1, 20))
    assert len(records) == dec.stats()["verify_steps"] > 3
    assert all(s >= 0.03 for _, s in records), records



def test_drafter_catch_up_is_not_charged_to_the_arm(ckpt, monkeypatch):
    """While SD is off (here the hysteresis steps) the learned drafter only buffers the plain steps' pairs;
    the first speculative step feeds that backlog before drafting. That catch-up is owed to the steps
    without SD, not to the arm chosen next: charged to it, one slow step after every switch-on biased that
    arm's median. A 100 s jump of the clock inside the backlog's feed (a real feed; the clock every module reads
    jumps, so no real wait and no load on a shared machine can blur it) must appear in the catch-up time and in
    no reward."""
    import time as _time

    real_clock, jump = _time.perf_counter, [0.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: real_clock() + jump[0])
    eng = _engine(ckpt)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    one_arm = dict(SPEC, hysteresis_steps=4, bucket_arms=(("4_2_8",), ("3_2_6",)))
    dec = SpecDecoder(SpecConfig(drafter="learned", drafter_path="(in memory)", **one_arm), eng.runner,
                      eng.block_manager, drafter)
    real_feed = dec.source._feed_group
    fed = []

    def slow_first_feed(jobs):  # noqa: ANN001, ANN202
        if not fed:  # the first feed is the backlog of the plain steps before SD switched on
            jump[0] += 100.0
        fed.append(len(jobs))
        return real_feed(jobs)

    monkeypatch.setattr(dec.source, "_feed_group", slow_first_feed)
    records = []
    real_record = dec.bandit.record
    monkeypatch.setattr(dec.bandit, "record", lambda b, arm, n, s: records.append(s) or real_record(b, arm, n, s))
    plain = _engine(ckpt).generate(_requests(2, 1, 16))
    assert [c.token_ids for c in _spec_generate(eng, dec, _requests(2, 1, 16))] == [c.token_ids for c in plain]
    st = dec.stats()
    assert len(records) == st["verify_steps"] > 3 and fed
    assert max(records) < 50, records  # the delayed feed is in no arm's step time
    assert st["catch_up_seconds"] >= 100 and st["catch_ups"] >= 1, st  # but it is accounted for
    from tlt.services.common.metrics import Metrics
    from tlt.services.rollout.spec_metrics import SpecMetrics

    metrics = Metrics("rollout")
    SpecMetrics(metrics).update(0, st)
    line = next(x for x in metrics.render().decode().splitlines() if x.startswith("rollout_spec_catch_up_seconds_total{"))
    assert float(line.split()[-1]) >= 100, line  # and on /metrics

def test_catch_up_after_plain_arm_steps_is_charged_to_plain(ckpt, monkeypatch):
    """A "plain" arm step leaves the learned drafter behind by its tokens: the next verify step first feeds them
    (a catch-up, 4.7 ms against a 55 ms step on CPU). That time is owed to the plain step(s) that made it
    necessary: left out of every reward, the plain arm looked cheaper than it is. The first catch-up after a
    plain step that followed a verify step jumps the clock by 100 s (no real wait): the plain rewards must carry
    it and no drafting arm's."""
    import time as _time

    real_clock, jump = _time.perf_counter, [0.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: real_clock() + jump[0])
    eng = _engine(ckpt)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    arms = dict(SPEC, epsilon=1.0, bucket_arms=(("4_2_8", "plain"), ("3_2_6", "plain")))  # random choices: both
    dec = SpecDecoder(SpecConfig(drafter="learned", drafter_path="(in memory)", **arms), eng.runner,
                      eng.block_manager, drafter)
    real_catch_up, jumped = dec.source.catch_up, []

    def slow_catch_up(seqs):  # noqa: ANN001, ANN202
        if not jumped and dec.verify_steps and dec.last_arm is not None and dec.last_arm.is_plain:
            jump[0] += 100.0  # the drafter was up to date after a verify step; only plain steps followed
            jumped.append(dec.arm_stats["plain"]["verify_steps"])
        return real_catch_up(seqs)

    monkeypatch.setattr(dec.source, "catch_up", slow_catch_up)
    _spec_generate(eng, dec, _requests(2, 1, 24))  # two sequences decoded together from their first decode step
    assert jumped and dec.stats()["catch_up_seconds"] >= 100
    rewards = {True: [], False: []}
    for by_arm in dec.bandit._rewards:
        for arm, by_size in by_arm.items():
            rewards[arm.is_plain] += [r for w in by_size.values() for r in w.recent]
    # the plain steps before it carry the 100 s, shared by their tokens (2 a step): their times add up to it
    assert sum(2 / r for r in rewards[True]) >= 100 and dec.stats()["catch_up_charged_seconds"] >= 100, rewards
    assert min(rewards[False]) > 1, rewards  # and no drafting arm's step has any of it (>= 2 tokens, real time)


def test_plain_arm_lets_the_bandit_stop_speculating_when_drafts_do_not_pay(ckpt):
    """A drafter that is never right (random weights: the stale-drafter failure of TLT.md section 8) makes
    every verify step slower than a plain one for ~1 token per sequence. With the "plain" arm among its
    arms the bandit measures not speculating like any other arm and settles on it; output stays identical."""
    reqs = lambda: _requests(3, 2, 60)  # noqa: E731
    plain = _engine(ckpt).generate(reqs())
    eng = _engine(ckpt, blocks=128)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    cfg = SpecConfig(drafter="learned", drafter_path="(in memory)",
                     **dict(SPEC, bucket_arms=(("plain", "6_1_7"), ("plain", "6_1_7"))))
    dec = SpecDecoder(cfg, eng.runner, eng.block_manager, drafter)
    spec = _spec_generate(eng, dec, reqs())
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    st = dec.stats()
    assert st["mean_accept_len"] < 1.5, st  # the drafts are (almost) never accepted
    arms = st["arms"]
    assert arms["plain"]["emitted"] == arms["plain"]["seq_steps"]  # one token per sequence per plain step
    assert st["verify_steps"] == arms["6_1_7"]["verify_steps"]  # plain-arm steps are not verify steps
    buckets = [b for b in st["bandit"] if sum(a["chosen"] for a in b["arms"]) > 20]
    assert buckets
    for b in buckets:  # measured as slower, the 7-token verify step is left to epsilon exploration
        by_arm = {a["arm"]: a for a in b["arms"]}
        assert by_arm["plain"]["samples"] > 0 and by_arm["plain"]["chosen"] > 2 * by_arm["6_1_7"]["chosen"], b


def test_bandit_reward_counts_only_the_tokens_a_stop_keeps(ckpt, monkeypatch):
    """A sequence that reaches max_tokens in the middle of an accepted path keeps only the tokens up to
    the stop; the rest are no throughput. Every reward must be the tokens the engine appended in that
    step, so deep arms are not paid for drafts past the end of finishing sequences."""
    eng = _engine(ckpt)
    one_arm = dict(SPEC, bucket_arms=(("4_2_8",), ("3_2_6",)))  # adaptive, but the choices do not depend on timing
    dec = SpecDecoder(SpecConfig(drafter="ngram", **one_arm), eng.runner, eng.block_manager)
    eng.spec_decoder = dec
    eng.scheduler.on_release = dec.release
    records, decoded = [], []
    real_record, real_decode = dec.bandit.record, dec.decode
    monkeypatch.setattr(dec.bandit, "record", lambda b, arm, n, s: records.append(n) or real_record(b, arm, n, s))

    def decode(seqs):  # noqa: ANN001, ANN202 - the tokens each verify step's accepted paths held
        out = real_decode(seqs)
        decoded.append(0 if out is None else sum(len(e.token_ids) for e in out))
        return out

    monkeypatch.setattr(dec, "decode", decode)
    # 21 tokens: the random model repeats itself, so accepted paths run past the limit (2 steps here)
    for r in _requests(3, 2, 21):
        eng.add_request(r)
    rewarded, cut = 0, 0
    while eng.has_unfinished():
        n_rec, n_dec, emitted0 = len(records), len(decoded), dec.emitted_tokens
        steps, _ = eng.step()
        kept = sum(len(s.new_token_ids) for s in steps)
        if len(records) > n_rec:
            assert records[-1] == kept, (records[-1], kept)
            rewarded += 1
        if len(decoded) > n_dec and decoded[-1]:  # a verify step: the accept-length counts grow by what it kept too
            assert dec.emitted_tokens - emitted0 == kept, (dec.emitted_tokens - emitted0, kept)
            cut += decoded[-1] > kept  # the decoder's paths were longer than what the stop kept
    assert rewarded > 3 and cut > 0, (rewarded, cut)


def test_no_arm_within_the_verify_token_budget_decodes_plainly(ckpt, monkeypatch):
    """With a budget of 8 verified tokens, batch 1 fits 4_2_8, batch 2 fits 3_1_4 and batch >= 3 fits no
    arm (3_1_4 x 3 = 12, 2_1_3 x 3 = 9). The guard used to run the smallest arm anyway (9 > 8 tokens);
    such a step must decode plainly, counted as over_budget, and the output stays the plain greedy one.
    (Buckets 1 | >=2: a bucket none of whose arms fits at its smallest batch is refused by SpecConfig.)"""
    budget = 8
    buckets = dict(bucket_thresholds=(1, 2), bucket_arms=(("4_2_8", "3_1_4"), ("3_1_4", "2_1_3")))

    def reqs() -> list[GenerationRequest]:  # three lengths: the batch falls 3 -> 2 -> 1
        return [GenerationRequest(r.request_id, r.prompt_token_ids,
                                  SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), 1)
                for r, m in zip(_requests(3, 1), (16, 28, 40))]

    plain = _engine(ckpt).generate(reqs())
    eng = _engine(ckpt)
    dec = SpecDecoder(SpecConfig(drafter="ngram", verify_token_budget=budget, **{**SPEC, **buckets}), eng.runner,
                      eng.block_manager)
    verified = []  # each verify pass's draft_tokens x batch (instrumentation; the real forward runs)
    real_forward = dec._verify_forward
    monkeypatch.setattr(dec, "_verify_forward", lambda arm, tree, n_list, *a:
                        verified.append(arm.draft_tokens * len(n_list)) or real_forward(arm, tree, n_list, *a))
    spec = _spec_generate(eng, dec, reqs())
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    st = dec.stats()
    assert verified and max(verified) <= budget, verified
    assert st["over_budget"] > 0 and st["verify_steps"] == len(verified), st
    assert sum(b["over_budget"] for b in st["bandit"]) == st["over_budget"]


def test_hysteresis_counts_only_decode_steps(ckpt):
    """SD switches on after `hysteresis_steps` consecutive DECODE steps at/below the threshold (SpecConfig,
    switch.py). Counting every scheduled step let a prompt's chunked prefill satisfy the hysteresis, so the
    first decode step already speculated; a step that prefills beside decodes must not count either."""
    eng = LLMEngine(ckpt, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16))
    dec = SpecDecoder(SpecConfig(drafter="ngram", **dict(STATIC, hysteresis_steps=3)), eng.runner, eng.block_manager)
    steps: list[tuple[bool, bool]] = []  # per engine step: (decode-only, speculated)
    wants = dec.wants
    dec.wants = lambda batch: steps.append((batch.is_decode_only, wants(batch))) or steps[-1][1]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng.spec_decoder, eng.scheduler.on_release = dec, dec.release
    dec.switch.update(dec.config.threshold + 1)  # as after a batch above the threshold: the hysteresis applies
    eng.add_request(GenerationRequest("a", tuple(range(5, 53)), params))  # 48 tokens: 3 prefill chunks of 16
    for _ in range(4):  # 3 prefill steps, then 1 decode step
        eng.step()
    assert [d for d, _ in steps] == [False, False, False, True]
    eng.add_request(GenerationRequest("b", tuple(range(5, 25)), params))  # 20 tokens: 2 steps beside a's decodes
    while eng.has_unfinished():
        eng.step()
    assert not any(s for d, s in steps if not d)
    decodes = [s for d, s in steps if d]
    assert decodes[:3] == [False, False, True], steps  # the 3rd decode step is the first to speculate
    assert dec.stats()["switches"] == 1


def _catch_up_after(ckpt, monkeypatch, arms, requests, pick, event=None, after=lambda dec: True):
    """Decode `requests` through the engine's own step with a learned drafter, the bandit's arm scripted by
    `pick(state, batch_size)` ("draft": the bucket's first drafting arm, "plain", or None: the bandit's own choice,
    which may be None over the verify budget); `event(eng, dec)` runs once between engine steps after two "plain"
    steps. The first catch-up once `after(dec)` holds jumps the clock by 100 s (no real wait). Returns the decoder
    and every reward in the bandit's windows by "plain" or not."""
    import time as _time

    real_clock, jump = _time.perf_counter, [0.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: real_clock() + jump[0])
    eng = _engine(ckpt)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    dec = SpecDecoder(SpecConfig(drafter="learned", drafter_path="(in memory)", **arms), eng.runner,
                      eng.block_manager, drafter)
    state = {"plain": 0, "event": event is None, "jumped": False}
    real_choose, real_catch_up = dec.choose_arm, dec.source.catch_up

    def choose(batch_size):  # noqa: ANN001, ANN202 - the bandit still chooses (its counts), the script overrides
        arm, want = real_choose(batch_size), pick(state, batch_size)
        if arm is None or want is None:
            return arm
        arm = next(a for a in dec.bandit.arms[dec.bandit.bucket(batch_size)] if a.is_plain == (want == "plain"))
        state["plain"] += arm.is_plain
        return arm

    def slow_catch_up(seqs):  # noqa: ANN001, ANN202
        if state["event"] and not state["jumped"] and after(dec):
            jump[0] += 100.0
            state["jumped"] = True
        return real_catch_up(seqs)

    monkeypatch.setattr(dec, "choose_arm", choose)
    monkeypatch.setattr(dec.source, "catch_up", slow_catch_up)
    eng.spec_decoder, eng.scheduler.on_release = dec, dec.release
    for r in requests:
        eng.add_request(r)
    while eng.has_unfinished():
        if not state["event"] and state["plain"] >= 2:
            event(eng, dec)
            state["event"] = True
        eng.step()
    assert state["jumped"], "no catch-up after the event"
    rewards = {True: [], False: []}
    for by_arm in dec.bandit._rewards:
        for arm, by_size in by_arm.items():
            rewards[arm.is_plain] += [r for w in by_size.values() for r in w.recent]
    return dec, rewards


def _not_charged(dec, rewards) -> None:
    st = dec.stats()
    assert st["catch_up_seconds"] >= 100 and st["arms"]["plain"]["verify_steps"] >= 2, st
    assert st["catch_up_charged_seconds"] < 50, st  # the plain steps' own catch-ups only (real time)
    assert rewards[True] and min(rewards[True]) > 1, rewards  # no plain step carries the 100 s
    assert rewards[False] and min(rewards[False]) > 1, rewards  # nor any drafting arm's


def _late_request(max_tokens: int):  # noqa: ANN202
    def event(eng, dec) -> None:  # noqa: ANN001
        eng.add_request(GenerationRequest("late", tuple(range(7, 19)),
                                          SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    return event


def _draft_plain_then_draft(state, batch_size):  # noqa: ANN001, ANN202 - one verify step, "plain" to the event
    if state.setdefault("drafted", False) and not state["event"]:
        return "plain"
    state["drafted"] = True
    return "draft"


def test_catch_up_after_a_prefill_is_not_charged_to_plain(ckpt, monkeypatch):
    """After "plain" arm steps a prompt arrives: its prefill step decodes the others beside it without a verify,
    so the backlog the next verify step feeds is not the plain arm's doing alone, and none of it is charged."""
    arms = dict(SPEC, bucket_arms=(("4_2_8", "plain"), ("3_2_6", "plain")))
    dec, rewards = _catch_up_after(ckpt, monkeypatch, arms, _requests(2, 1, 24), _draft_plain_then_draft,
                                   _late_request(12))
    _not_charged(dec, rewards)


def test_catch_up_after_speculation_off_is_not_charged_to_plain(ckpt, monkeypatch):
    """After "plain" arm steps at a batch of 2 a third sequence takes the batch over the threshold (2): SD is off
    (the prefill, the steps over the threshold, the hysteresis steps), and the catch-up when it is back on is
    charged to no arm."""
    arms = dict(SPEC, threshold=2, bucket_arms=(("4_2_8", "plain"), ("3_2_6", "plain")))
    dec, rewards = _catch_up_after(ckpt, monkeypatch, arms, _requests(2, 1, 30), _draft_plain_then_draft,
                                   _late_request(4))
    assert dec.stats()["switches"] >= 3  # on, off with the third sequence, on again
    _not_charged(dec, rewards)


def test_catch_up_after_an_over_budget_step_is_not_charged_to_plain(ckpt, monkeypatch):
    """Budget 9: batch 3 runs 2_1_3 (9 tokens) or "plain", batch 2 fits no arm (4_1_5 x 2 = 10) and decodes
    plainly (over_budget), batch 1 runs 4_1_5. The catch-up at batch 1 follows the over-budget steps: not
    charged to the plain steps at batch 3 before them."""
    arms = dict(SPEC, verify_token_budget=9, bucket_arms=(("4_1_5",), ("2_1_3", "plain")))
    reqs = [GenerationRequest(r.request_id, r.prompt_token_ids,
                              SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), 1)
            for r, m in zip(_requests(3, 1), (10, 14, 24))]

    def pick(state, batch_size):  # noqa: ANN001, ANN202 - at batch 3: one verify step, then "plain"
        if batch_size < 3:
            return None
        drafted, state["drafted"] = state.get("drafted", False), True
        return "plain" if drafted else "draft"

    dec, rewards = _catch_up_after(ckpt, monkeypatch, arms, reqs, pick, after=lambda d: d.over_budget > 0)
    assert dec.stats()["over_budget"] > 0
    _not_charged(dec, rewards)


def test_catch_up_after_a_no_room_step_is_not_charged_to_plain(ckpt, monkeypatch):
    """A verify step that finds no KV room for its drafts decodes plainly (no_room). "plain", "plain", no room,
    "plain", then a verify step: its catch-up holds the no-room step's tokens, so it is charged to no arm (the
    catch-up the no-room step itself made first, after plain steps alone, is theirs)."""
    arms = dict(SPEC, bucket_arms=(("4_2_8", "plain"), ("3_2_6", "plain")))
    script = iter(["draft", "plain", "plain", "draft", "plain"])

    def no_room_once(eng, dec) -> None:  # noqa: ANN001 - the next verify step finds the KV cache full
        real = dec._reserve
        dec._reserve = lambda seqs, n_nodes: setattr(dec, "_reserve", real) or False

    dec, rewards = _catch_up_after(ckpt, monkeypatch, arms, _requests(2, 1, 24), lambda s, b: next(script, "draft"),
                                   no_room_once, after=lambda d: d.no_room > 0)
    assert dec.stats()["no_room"] == 1
    _not_charged(dec, rewards)
