"""The bandit's step time starts at the engine step's start, not at the decode call (TLT.md section 5: reward =
tokens / step wall time). What the engine does before `SpecDecoder.decode` (scheduling, copying prompt tails,
recording versions) is part of every step, speculative or not: timed from the decode call, a short arm's many
steps look cheaper than they are. The clock every module reads jumps 100 s inside the engine's schedule() of
each step, before decode is called (no real wait, so no load on a shared machine can blur it): each recorded
step time and `last_step_seconds` must hold exactly one jump. Tiny random Qwen2 (tests/spec_decoder_helpers.py).
"""

from __future__ import annotations

import time

from spec_decoder_helpers import SPEC, _engine, _requests, _spec_generate, ckpt  # noqa: F401 - ckpt: fixture
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.decoder import SpecDecoder

JUMP = 100.0


def test_step_time_counts_what_the_engine_step_did_before_decode(ckpt, monkeypatch):
    real_clock, jump = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jump[0])
    eng = _engine(ckpt)
    # random choices between a drafting arm and "plain": both kinds of step the decoder times
    arms = dict(SPEC, epsilon=1.0, bucket_arms=(("3_1_4", "plain"), ("2_1_3", "plain")))
    dec = SpecDecoder(SpecConfig(drafter="ngram", **arms), eng.runner, eng.block_manager)
    real_schedule = eng.scheduler.schedule

    def slow_schedule():  # noqa: ANN202 - between the step's start and its decode call
        jump[0] += JUMP
        return real_schedule()

    monkeypatch.setattr(eng.scheduler, "schedule", slow_schedule)
    records, last = [], []
    real_record = dec.bandit.record

    def record(batch, arm, tokens, seconds):  # noqa: ANN001, ANN202
        records.append((arm.name, seconds))
        last.append(dec.last_step_seconds)
        return real_record(batch, arm, tokens, seconds)

    monkeypatch.setattr(dec.bandit, "record", record)
    _spec_generate(eng, dec, _requests(2, 1, 24))
    chosen = {name for name, _ in records}
    assert dec.verify_steps > 2 and "plain" in chosen and len(chosen) > 1, records
    # the whole step: its own jump, and only its own (a start left over from an earlier step would hold two)
    assert all(JUMP <= s < 2 * JUMP for _, s in records), records
    assert all(JUMP <= s < 2 * JUMP for s in last), last
    assert JUMP <= dec.stats()["last_step_seconds"] < 2 * JUMP


def test_step_time_without_a_step_start_is_the_decode_calls(ckpt, monkeypatch):
    """A caller that drives `decode` itself and closes the step without a start: the decode call's time (the
    documented fallback), so a jump before the call is in no reward."""
    real_clock, jump = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + jump[0])
    eng = _engine(ckpt)
    one_arm = dict(SPEC, bucket_arms=(("3_1_4",), ("2_1_3",)))
    dec = SpecDecoder(SpecConfig(drafter="ngram", **one_arm), eng.runner, eng.block_manager)
    eng.add_request(_requests(1, 1, 24)[0])
    for _ in range(2):  # the prompt's prefill, then a first plain decode: decode-ready
        eng.step()
    seqs = list(eng.scheduler.running)
    assert seqs and all(s.num_computed == s.num_tokens - 1 for s in seqs)
    jump[0] += JUMP  # before the call: no step start says so
    assert dec.decode(seqs) is not None
    dec.finish_step()
    assert dec.last_step_seconds < JUMP / 2, dec.last_step_seconds
