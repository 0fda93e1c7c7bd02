"""openai_convert's response builders on their own: the response-level weight versions over several choices, and
what a stream sends once the engine's final text is in.

Real parts: the real tiny task tokenizer and real `CompletionOutput` objects, fed to the very functions the HTTP
handlers call (tests/test_rollout_http.py drives them through a server)."""

from __future__ import annotations

import pytest

from tlt.services.rollout import openai_convert as conv
from tlt.services.rollout.openai_schema import TltVersions
from tlt.services.rollout.types import CompletionOutput, FinishReason, StepOutput, Versions


def _out(versions: Versions, text: str = "") -> CompletionOutput:
    return CompletionOutput(request_id="r", sample_index=0, prompt_token_ids=[1], token_ids=[2], text=text,
                            finish_reason=FinishReason.LENGTH, versions=versions)


def test_the_response_stamp_is_the_newest_policy_and_drafter_and_the_oldest_policy():
    """n > 1 whose choices span a weight swap: the response's tlt_versions names the newest policy and the newest
    drafter any choice saw, and policy_min the oldest policy (a choice's own policy_min counted); choices of one
    policy have no policy_min."""
    outs = [_out(Versions(policy=4, drafter=2)), _out(Versions(policy=5, drafter=3, policy_min=4)),
            _out(Versions(policy=5, drafter=1))]
    assert conv.response_versions(outs) == TltVersions(policy=5, drafter=3, policy_min=4)
    assert conv.response_versions(outs[1:2]) == TltVersions(policy=5, drafter=3, policy_min=4)
    assert conv.response_versions([outs[2], _out(Versions(policy=5, drafter=-1))]) == TltVersions(policy=5, drafter=1)
    assert conv.response_versions([]) is None


@pytest.fixture(scope="module")
def tok():
    from tlt.model.tokenizer import test_tokenizer

    return test_tokenizer()


def test_a_stream_never_sends_again_what_it_sent(tok):
    """The final text is authoritative, but what went out cannot be taken back: when it does not begin with the
    text already sent, the stream's last chunk adds nothing (the client's joined text stays a prefix of the final
    one, not a repeat of it)."""
    ts = conv.TextStream(tok, ())
    sent = ts.push(tok.encode("12+34=46"))
    assert sent and ts.sent == sent
    assert ts.finish(sent + "7") == "7"
    assert ts.finish("99") == "" and ts.sent == sent + "7"


@pytest.mark.parametrize("chat", [False, True])
def test_a_backend_whose_steps_carry_no_alternatives_streams_them_all_at_the_end(tok, chat):
    """SGLang's steps carry logprobs but no alternatives: taking its steps' logprobs anyway sent chunks whose
    `top_logprobs` were empty while their tokens were counted as sent, so the last chunk's alternatives started at
    the wrong token and the stream's lists were shorter than its tokens. Now every token and its alternatives go
    out in the last chunk, and the chunks join to the non-streamed choice's logprobs."""
    ids = tok.encode("12+34=46. 5+6=11. 7+8=15.")
    lps = [-0.25 * (i + 1) for i in range(len(ids))]
    tops = [{t: lp, (t + 1) % len(tok): lp - 1.0} for t, lp in zip(ids, lps)]
    text = tok.decode(ids)
    c = CompletionOutput(request_id="r", sample_index=0, prompt_token_ids=[1], token_ids=ids, text=text,
                         finish_reason=FinishReason.LENGTH, versions=Versions(), logprobs=lps, top_logprobs=tops)
    steps = [StepOutput("r", 0, ids[i:i + 2], lps[i:i + 2]) for i in range(0, len(ids) - 2, 2)]
    if chat:
        stream = conv.ChatChoiceStream(tok, 0, (), None, logprobs=True, top_logprobs=2)
        chunks = [ch for s in steps for ch in stream.push(s)] + stream.finish(c)
        assert "".join(ch.delta.content or "" for ch in chunks) == text
        got = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
        assert got == conv.chat_logprobs(tok, ids, lps, tops, 2).content
        assert [len(e.top_logprobs) for e in got] == [2] * len(ids)
        return
    stream = conv.CompletionChoiceStream(tok, (), 2)
    parts = [stream.push(s) for s in steps] + [stream.finish(c)]
    assert "".join(t for t, _ in parts) == text
    whole = conv.completion_logprobs(tok, ids, lps, tops, 2, text)
    assert [lp for _, lp in parts if lp][0].tokens == whole.tokens  # all in the last chunk
    assert [t for _, lp in parts if lp for t in lp.top_logprobs] == whole.top_logprobs
