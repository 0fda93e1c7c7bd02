"""Mutation audit of the engine step, Sequence and SpecDecoder (engine.py, sequence.py, spec/decoder.py): tests for
what the rest of the suite left open, each naming the mutant (G-n, /tmp/mutE_log.md) it pins.

- per-step outputs of verify steps (what the streaming servers read): new_logprobs / new_top_logprobs line up
  with new_token_ids, also on the step a stop cuts inside an accepted run, and join to plain decoding's;
- logprobs=0 asks for no alternatives: top_logprobs stays None;
- seed keys are taken modulo 2**64 (not 2**63 - 1);
- a mixed batch (rejection-sampled row beside a tree-walk row) joins rows of different accept lengths;
- a rejection-sampled chain's residual/bonus draw uses RESIDUAL's uniform at the step's first position (rng.py);
- the drafter catch-up runs only on a verify step that follows a step without one.

Everything on the tiny random checkpoint of tests/spec_decoder_helpers.py or on hand-built tensors; no downloads.
"""

from __future__ import annotations

import pytest
import torch

from spec_decoder_helpers import STATIC, _engine, _requests, _spec_generate, ckpt  # noqa: F401 - ckpt: fixture
from tlt.services.rollout.engine.sequence import Sequence, seed_for
from tlt.services.rollout.spec.accept import AcceptResult
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.decoder import SpecDecoder, _join, _rejection
from tlt.services.rollout.spec.rng import RESIDUAL, counter_uniforms, key_tensor
from tlt.services.rollout.spec.tree import DraftTree
from tlt.services.rollout.types import GenerationRequest, SamplingParams


def _with(params: SamplingParams, reqs: list[GenerationRequest]) -> list[GenerationRequest]:
    return [GenerationRequest(r.request_id, r.prompt_token_ids, params, r.n) for r in reqs]


def _drive(eng, dec, reqs):
    """Run `reqs` through the engine's own step with `dec` attached. Returns (per-step records, completions), a
    record per StepOutput: (StepOutput, tokens that step's verify emitted for the sequence, or None if plain)."""
    eng.spec_decoder = dec
    eng.scheduler.on_release = dec.release
    emitted: dict[tuple[str, int], int] = {}
    decode = dec.decode

    def recording(seqs):
        em = decode(seqs)
        if em is not None:
            emitted.update({(s.request_id, s.sample_index): len(e.token_ids) for s, e in zip(seqs, em)})
        return em

    dec.decode = recording
    for r in reqs:
        eng.add_request(r)
    records, done = [], []
    while eng.has_unfinished():
        emitted.clear()
        steps, finished = eng.step()
        records += [(s, emitted.get((s.request_id, s.sample_index))) for s in steps]
        done += finished
    return records, done


@pytest.mark.parametrize("stop_at", [None, 12])
def test_verify_steps_stream_logprobs_and_alternatives_token_by_token(ckpt, stop_at):  # noqa: F811
    """Pins G-8 (a step's new_top_logprobs cut to its last token) and G-20 (a step's new_logprobs sliced by the
    verify's emitted count, not the kept one: the step a stop cuts inside an accepted run carried logprobs of earlier
    tokens). Every StepOutput's new_logprobs / new_top_logprobs has one entry per new token, and joined over the steps
    they are plain greedy decoding's (speculation off): what openai_convert.StreamLogprobs streams."""
    base = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=3)
    if stop_at is not None:  # a stop token the random model repeats: met inside accepted runs
        full = _engine(ckpt).generate(_with(base, _requests(1, 1, 17)))[0].token_ids
        base = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, logprobs=3,
                              stop_token_ids=(full[stop_at],))
    reqs = _with(base, _requests(3, 2, 17))
    plain = {(c.request_id, c.sample_index): c for c in _engine(ckpt).generate(reqs)}
    eng = _engine(ckpt, blocks=256)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **dict(STATIC, static_arm="8_1_9")), eng.runner, eng.block_manager)
    records, done = _drive(eng, dec, reqs)
    assert {(c.request_id, c.sample_index) for c in done} == set(plain)
    # the cases asserted on happen: verify steps that kept several tokens, and a last step a stop cut short
    assert any(n is not None and len(s.new_token_ids) > 1 for s, n in records)
    assert any(s.finished and n is not None and n > len(s.new_token_ids) for s, n in records)
    streams: dict[tuple[str, int], tuple[list, list, list]] = {}
    for s, _ in records:
        assert len(s.new_logprobs) == len(s.new_top_logprobs) == len(s.new_token_ids), s
        ids, lps, tops = streams.setdefault((s.request_id, s.sample_index), ([], [], []))
        ids += s.new_token_ids
        lps += s.new_logprobs
        tops += s.new_top_logprobs
    for key, (ids, lps, tops) in streams.items():
        ref = plain[key]
        assert ids == ref.token_ids
        assert lps == pytest.approx(ref.logprobs, abs=1e-4)
        assert [list(t) for t in tops] == [list(t) for t in ref.top_logprobs]
        for a, b in zip(tops, ref.top_logprobs):
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


def test_logprobs_0_returns_no_alternatives(ckpt):  # noqa: F811
    """Pins G-23 (Sequence.top_logprobs made for logprobs=0): logprobs=0 asks for the chosen tokens' logprobs only,
    so the completion and its steps carry top_logprobs None (not a list of empty dicts); logprobs=None asks for
    neither."""
    eng = _engine(ckpt)
    out = {}
    for k in (0, None):
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=k)
        eng.add_request(GenerationRequest(f"k{k}", _requests(1, 1)[0].prompt_token_ids, params))
    steps = []
    while eng.has_unfinished():
        s, d = eng.step()
        steps += s
        out.update({c.request_id: c for c in d})
    assert len(out["k0"].logprobs) == 5 and out["k0"].top_logprobs is None
    assert out["kNone"].logprobs is None and out["kNone"].top_logprobs is None
    assert all(s.new_top_logprobs is None for s in steps)


def test_seed_keys_are_taken_modulo_2_64():
    """Pins G-25 (seed_for modulo 2**63 - 1): that gave each negative seed s the key, so the samples, of the
    positive seed s + 2**63 - 1 (both valid int64 seeds). Keys are 64-bit and distinct for distinct int64 seeds."""
    m = 2**63 - 1
    for s in (-1, -5, -7919, -(2**40), -(2**62)):
        for i in (0, 1, 3):
            assert seed_for(s, i) != seed_for(s + m, i), (s, i)
            a = Sequence("r", i, (1,), SamplingParams(temperature=1.0), 4, s, frozenset()).rng_key
            b = Sequence("r", i, (1,), SamplingParams(temperature=1.0), 4, s + m, frozenset()).rng_key
            assert a != b and 0 <= a < 2**64 and 0 <= b < 2**64
    assert seed_for(-1, 0) == (-1_000_003 + 1) % 2**64  # hand-computed: (seed * 1000003 + index * 7919 + 1) mod 2**64


def test_a_mixed_batch_joins_rows_of_different_accept_lengths():
    """Pins G-56 (`_join` as wide as its first part): a rejection-sampled row that accepted less than the tree-walk
    row beside it (the first part narrower than the second) raised in the verify step, and every later step of the
    engine raised too. The join pads each row to the widest with -1."""
    rej = AcceptResult(torch.tensor([0]), torch.tensor([[5]]), torch.tensor([[0]]))
    walk = AcceptResult(torch.tensor([2]), torch.tensor([[7, 8, 9]]), torch.tensor([[0, 2, 3]]))
    lp = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    res, logprobs = _join([(torch.tensor([1]), rej, lp[:1]), (torch.tensor([0]), walk, lp[1:])], 2)
    assert res.accept_len.tolist() == [2, 0]
    assert res.tokens.tolist() == [[7, 8, 9], [5, -1, -1]]
    assert res.path.tolist() == [[0, 2, 3], [0, -1, -1]]
    torch.testing.assert_close(logprobs, torch.stack([lp[1], lp[0]]))


def test_a_rejected_chains_residual_draw_uses_the_steps_first_position():
    """Pins G-57 (the residual drawn with RESIDUAL's uniform at first + depth): rng.py's RESIDUAL is "the residual or
    bonus draw of a rejection-sampled chain step starting at position t". At first + depth, the draw depended on the
    arm's depth, and with the adaptive bandit changing depth between steps two steps of one sequence could draw with
    the same uniform (a step at c, depth 4, and one at c + 1, depth 3, both used c + 4): correlated samples. Here the
    first draft is always rejected (q gives it 0) and the residual is q = 1/2, 1/2 on tokens 1, 2: the token is 1 iff
    RESIDUAL's uniform at the first position is below 1/2, at every depth."""
    v = 4
    key = 12345
    keys = key_tensor([key])

    def u(pos: int) -> float:
        return float(counter_uniforms(keys, torch.tensor([[pos]]), RESIDUAL)[0, 0])

    # a first position whose uniform is clearly on one side of 1/2 while first + 1 .. first + 4 has one on the other
    first = next(f for f in range(1, 500) if abs(u(f) - 0.5) > 0.1
                 and any((u(f + d) < 0.5) != (u(f) < 0.5) and abs(u(f + d) - 0.5) > 0.1 for d in range(1, 5)))
    want = 1 if u(first) < 0.5 else 2
    row = torch.tensor([-1e4, 0.0, 0.0, -1e4])  # q = (0, 1/2, 1/2, 0) at every node
    filters = tuple(torch.tensor([x]) for x in (1.0, 0, 1.0, 0.0))  # temperature, top_k, top_p, min_p
    for depth in range(1, 5):
        n = depth + 1
        tree = DraftTree(tokens=torch.tensor([[3] + [0] * depth]), parents=torch.arange(-1, depth)[None],
                         depth=torch.arange(n)[None], score=torch.zeros(1, n),
                         draft_probs=torch.nn.functional.one_hot(torch.zeros(1, depth, dtype=torch.long), v).float(),
                         sampled=torch.ones(1, dtype=torch.bool))
        res, _ = _rejection(row.expand(1, n, v).clone(), tree, filters, keys, torch.tensor([[first]]))
        assert res.accept_len.tolist() == [0] and res.tokens[0, 0].item() == want, (depth, first)


def test_the_drafter_catches_up_only_after_a_step_without_a_verify(ckpt):  # noqa: F811
    """Pins G-59 (`_behind` never cleared after a verify step): every verify step then ran a catch-up, counted in
    stats()["catch_ups"] ("verify steps that first caught the drafter up (after steps without SD)", on /metrics) and
    charged to the plain-arm steps' rewards each time. The count is that of verify steps whose engine step before
    was not one (the first included)."""
    eng = _engine(ckpt, blocks=256)
    dec = SpecDecoder(SpecConfig(drafter="ngram", **STATIC), eng.runner, eng.block_manager)
    kinds: list[bool] = []  # per engine step that ran a batch: a verify step?
    wants, decode = dec.wants, dec.decode

    def rec_wants(batch):
        kinds.append(False)
        return wants(batch)

    def rec_decode(seqs):
        em = decode(seqs)
        kinds[-1] = em is not None
        return em

    dec.wants, dec.decode = rec_wants, rec_decode
    reqs = _requests(3, 2, 30)
    plain = _engine(ckpt).generate(reqs)
    assert [c.token_ids for c in _spec_generate(eng, dec, reqs)] == [c.token_ids for c in plain]
    st = dec.stats()
    want = sum(1 for i, v in enumerate(kinds) if v and (i == 0 or not kinds[i - 1]))
    assert st["verify_steps"] == sum(kinds) > want > 0, (st, kinds)
    assert st["catch_ups"] == want, (st, kinds)


def test_plain_steps_buffer_no_drafter_pairs_for_sequences_they_finished(ckpt):  # noqa: F811
    """Pins G-61 (observe_plain buffering the pairs of sequences the step finished): those were released already
    (scheduler.finish -> SpecDecoder.release), so their pairs stayed in EagleSource.pending for good, up to
    max_pending feature rows per finished sequence: a leak over a rollout. After a generate that finished its
    sequences in plain steps (6 sequences, threshold 2: SD off, the plain steps buffered), nothing is left."""
    from tlt.model.drafter import Drafter, DrafterConfig

    eng = _engine(ckpt, blocks=256)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_model_config(eng.model_config), eng.model.embed, eng.model.lm_head)
    cfg = SpecConfig(drafter="learned", drafter_path="(in memory)", **dict(STATIC, threshold=2))
    dec = SpecDecoder(cfg, eng.runner, eng.block_manager, drafter)
    reqs = _requests(3, 2, 12)
    assert [c.token_ids for c in _spec_generate(eng, dec, reqs)] == [c.token_ids for c in _engine(ckpt).generate(reqs)]
    assert dec.stats()["plain_steps"] > 0
    assert not dec.source.pending and not dec.source.rows and not dec.source.fed_pos, list(dec.source.pending)
