"""Engine outputs -> OpenAI choices: logprob objects, versions, and incremental text for streams.

    CompletionOutput -> CompletionChoice / ChatChoice          (non-streaming)
    StepOutput* -> TextStream.push -> text delta (SSE chunk)    (streaming)
    CompletionOutput -> TextStream.finish -> the rest of the text
    chat: StepOutput* / CompletionOutput -> ChatChoiceStream -> ChatChunkChoice*

Tool calls (a chat request with tools, tool_choice not "none", `[rollout]
tool_call_parser` "hermes"): each choice's finished text goes through
`tool_calls.parse_hermes` on its own; its calls become `tool_calls` (ids drawn
here) and finish_reason "tool_calls". A stream sends content until a
`<tool_call>` starts (holding back an end that may begin one, and trailing
whitespace, which the parsed content drops) and the calls at the finish, one
chunk each.

Streaming text: each sample's tokens are decoded incrementally after every
step, in a window after the prompt's last tokens, as the engine decodes them
(engine/detok.py), and only the stable prefix is sent: a trailing U+FFFD (a
multi-byte character cut in half) is held back, as is a byte-fallback run of
`<0x..>` pieces until text ends it (it decodes whole), and so are the last
`len(longest stop string) - 1` characters (the start of a stop string not
completed yet), and with a tokenizer that cleans up spaces the last few that
its cleanup may still rewrite. The step that
finishes a sample is not pushed (its tokens may complete a stop string, and
text after one): on finish the engine's own final text is authoritative and
the stream sends what remains of it. So text the engine cuts at a stop string
is never sent.

Each token's text and bytes, and where it starts in the text (`text_offset`), come from token_text.py.
"""

from __future__ import annotations

import math
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tlt.services.rollout.engine.detok import CLEANUP_HOLDBACK, IncrementalText
from tlt.services.rollout.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCall,
    TltVersions,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprobEntry,
)
from tlt.services.rollout.token_text import TextOffsets, token_text, token_text_and_bytes
from tlt.services.rollout.tool_calls import TOOL_CALL_START, ParsedText, parse_hermes, partial_start
from tlt.services.rollout.types import CompletionOutput, FinishReason, StepOutput, Versions


def tlt_versions(v: Versions) -> TltVersions:
    pmin = v.policy_min
    return TltVersions(policy=int(v.policy), drafter=int(v.drafter), policy_min=None if pmin is None else int(pmin))


def response_versions(outputs: list[CompletionOutput]) -> TltVersions | None:
    """The response-level stamp over all choices (each choice also carries its own): newest
    policy and drafter, and `policy_min` = the oldest policy when the choices span several."""
    if not outputs:
        return None
    newest = max(c.versions.policy for c in outputs)
    oldest = min(c.versions.policy if c.versions.policy_min is None else c.versions.policy_min for c in outputs)
    drafter = max(c.versions.drafter for c in outputs)
    return TltVersions(policy=newest, drafter=drafter, policy_min=oldest if oldest != newest else None)


LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a (near) zero-probability token


def _lp(x: float) -> float:
    """A logprob fit for JSON: -inf (a token outside top_p/top_k/min_p, or an underflow at a tiny temperature)
    and NaN would make the JSON encoder fail the whole response; they leave as LOGPROB_FLOOR."""
    x = float(x)
    return x if math.isfinite(x) else LOGPROB_FLOOR



def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[float] | None, top: list[dict[int, float]] | None, k: int,
    text: str | None = None, offsets: list[int] | None = None,
) -> CompletionLogprobs:
    """The legacy completions API's logprobs. Each position's `top_logprobs` holds the `k` most likely tokens and
    the sampled one besides when it is not among them (its logprob the position's `token_logprobs` value): "The
    API will always return the logprob of the sampled token, so there may be up to logprobs+1 elements in the
    response" (OpenAI's reference for `logprobs`). The chat API has no such rule: see `chat_logprobs`.
    `text`: the choice's text, which `text_offset` indexes (`TextOffsets`); `offsets`: these tokens' offsets
    already counted (a stream's, `StreamLogprobs`)."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    text_offset = offsets if offsets is not None else TextOffsets(tokenizer).feed(token_ids, text)
    token_logprobs = [_lp(x) for x in (logprobs or [])]
    top_out = None
    if k > 0 and top is not None:
        top_out = []
        for i, alt in enumerate(top):
            entry = {token_text(tokenizer, a): _lp(lp) for a, lp in alt.items()}
            if i < len(token_ids) and i < len(token_logprobs) and token_ids[i] not in alt:
                entry.setdefault(tokens[i], token_logprobs[i])
            top_out.append(entry)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=token_logprobs,
        top_logprobs=top_out,
        text_offset=text_offset,
    )


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[float] | None, top: list[dict[int, float]] | None, k: int,
    raw: list[bytes] | None = None,
) -> ChoiceLogprobs:
    """The chat API's logprobs: each token with its logprob, and its `top_logprobs` the `k` most likely tokens only
    (OpenAI's reference: "List of the most likely tokens and their log probability, at this token position"). The
    sampled token is the entry itself, not added to its alternatives when it is not among them, unlike the legacy
    completions API's up to logprobs+1 (`completion_logprobs`). `raw`: the tokens' bytes as the text decodes
    them (`TextOffsets`; a stream's chunk has them counted with the tokens before it)."""
    if raw is None:
        (counted := TextOffsets(tokenizer)).feed(token_ids)
        raw = counted.raw
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs or [])):
        text = token_text(tokenizer, tid)
        alts = []
        if k > 0 and top is not None and i < len(top):
            for aid, alp in sorted(top[i].items(), key=lambda kv: -kv[1])[:k]:
                at, araw = token_text_and_bytes(tokenizer, aid)
                alts.append(TopLogprobEntry(token=at, logprob=_lp(alp), bytes=araw))
        content.append(TokenLogprob(token=text, logprob=_lp(lp), bytes=list(raw[i]), top_logprobs=alts))
    return ChoiceLogprobs(content=content)


def completion_choice(tokenizer: Any, index: int, c: CompletionOutput, logprobs: int | None) -> CompletionChoice:
    lp = None
    if logprobs is not None:
        lp = completion_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs, logprobs, c.text)
    return CompletionChoice(
        index=index, text=c.text, logprobs=lp, finish_reason=finish_reason(c), tlt_versions=tlt_versions(c.versions)
    )


@dataclass(frozen=True)
class ToolParsing:
    """How a chat request's completions are parsed for tool calls (None: they are not)."""

    names: frozenset[str]  # the request's tools: a call to another name stays text
    parallel: bool = True  # parallel_tool_calls; False keeps the first call only

    def parse(self, c: CompletionOutput) -> ParsedText:
        return parse_hermes(c.text, self.names, self.parallel, truncated=c.finish_reason != FinishReason.STOP)


def parsed_text(tools: ToolParsing | None, c: CompletionOutput) -> ParsedText:
    """A finished choice's text as content and calls: parsed when the request has tool parsing, else all content."""
    return tools.parse(c) if tools is not None else ParsedText(c.text, ())


def tool_parsing(req: ChatCompletionRequest, parser: str) -> ToolParsing | None:
    """How a request's completions are parsed for tool calls (`parser`: `[rollout] tool_call_parser`): not at all
    without tools, with tool_choice "none" (the tools are still in the prompt), or with the parser "none"."""
    if not req.parses_tools() or parser == "none":
        return None
    return ToolParsing(req.tool_names(), req.parallel_tool_calls)


_ID_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    """`call_` + 24 random letters and digits, the OpenAI API's shape."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def _tool_calls(parsed: ParsedText) -> list[ToolCall]:
    return [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parsed.calls]


def chat_choice(tokenizer: Any, index: int, c: CompletionOutput, logprobs: bool, top_logprobs: int,
                tools: ToolParsing | None = None) -> ChatChoice:
    lp = chat_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs, top_logprobs) if logprobs else None
    parsed = parsed_text(tools, c)
    calls = _tool_calls(parsed)
    return ChatChoice(
        index=index,
        message=ChatMessageOut(content=parsed.content, tool_calls=calls or None),
        logprobs=lp,
        finish_reason="tool_calls" if calls else finish_reason(c),
        tlt_versions=tlt_versions(c.versions),
    )


def finish_reason(c: CompletionOutput) -> str:
    return c.finish_reason.value


class TextStream:
    """Incremental text of one sample for SSE: only text that can no longer change is sent.

    Decoded as the engine decodes it (`engine/detok.IncrementalText`: in a window, cost per step independent of
    the sequence length; after the prompt's last tokens, so a SentencePiece decoder's strip of the first token's
    space falls on the prompt): the streamed text joins to the completion's.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], tool_calls: bool = False,
                 prompt: Sequence[int] = ()) -> None:
        self.decoded = IncrementalText(tokenizer, prompt)
        # the cleaned text's tail may still change: held back too
        self.holdback = max((len(s) for s in stop), default=1) - 1 + (CLEANUP_HOLDBACK if self.decoded.cleanup else 0)
        self.tool_calls = tool_calls  # send nothing from a `<tool_call>` on (and hold what may begin one)
        self.block_at = -1  # where the first `<tool_call>` starts in `text`, once seen
        self.scanned = 0  # `text` before this holds no `<tool_call>` that ends before it
        self.text = ""  # decoded so far (stable characters only), cleaned as the completion's text is
        self.sent = ""

    def push(self, new_token_ids: list[int]) -> str:
        if self.decoded.push(new_token_ids):
            self.text = self.decoded.cleaned()
        stable = self.text[: max(0, len(self.text) - self.holdback)]  # (a negative end took from the end)
        if self.tool_calls:
            if self.block_at < 0:  # each step searches only its new text (and a start the last step cut in two)
                self.block_at = self.text.find(TOOL_CALL_START, max(0, self.scanned - len(TOOL_CALL_START) + 1))
                self.scanned = len(self.text)
            if self.block_at >= 0:
                stable = stable[:self.block_at]
            stable = stable[: len(stable) - partial_start(stable)].rstrip()
        if len(stable) <= len(self.sent) or not stable.startswith(self.sent):
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.sent):
            return ""  # cannot take back what was sent; the engine's text differs only past it
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta


class StreamLogprobs:
    """A streamed choice's logprobs, each token's sent with the chunk that follows it (as OpenAI and vLLM send
    them; they all came in the last chunk before): the engine's steps' tokens wait until a text chunk goes out and
    go with it; the last chunk takes the rest from the completion, so the chunks' lists join to the non-streamed
    response's. A backend whose steps lack them (SGLang's carry no alternatives) sends them all at the end.

    With a tokenizer each token's `text_offset` is kept too, and a chunk takes only the tokens whose text has
    begun to go out (`take(limit)`): one whose text is held back (it may start a stop string, or a `<tool_call>`)
    waits, so its logprobs never go out before its text, nor an offset past the text the choice ends up returning."""

    def __init__(self, k: int, tokenizer: Any = None) -> None:
        self.k = k
        self.sent = 0  # tokens whose logprobs went out
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.tops: list[dict[int, float]] = []
        self.per_step = True
        self._offsets = TextOffsets(tokenizer) if tokenizer is not None else None
        self.offsets: list[int] = []  # text_offset of every token pushed, from the first

    def push(self, step: StepOutput) -> None:
        if self._offsets is not None:
            self.offsets += self._offsets.feed(step.new_token_ids, final=False)  # (a byte run's wait for its end)
        if step.new_logprobs is None or (self.k > 0 and step.new_top_logprobs is None):
            self.per_step = False
        if self.per_step:
            self.ids += step.new_token_ids
            self.lps += step.new_logprobs or []
            self.tops += step.new_top_logprobs or []

    def _raw(self, start: int, end: int) -> list[bytes] | None:
        return None if self._offsets is None else self._offsets.raw[start:end]

    def take(self, limit: int | None = None) -> tuple[list[int], list[float], list[dict[int, float]] | None,
                                                     list[int] | None, list[bytes] | None] | None:
        """The waiting tokens (ids, logprobs, alternatives, text offsets, bytes) for the chunk going out, those
        counted whose offset is below `limit` (the characters sent) when given; None: nothing to send now."""
        if not self.per_step or not self.ids:
            return None
        n = len(self.ids)
        if self._offsets is not None:
            counted = self.offsets[self.sent : self.sent + n]  # (not a byte run's that has not ended)
            n = len(counted) if limit is None else sum(1 for o in counted if o < limit)  # offsets never decrease
        if n == 0:
            return None
        offs = self.offsets[self.sent : self.sent + n] if self._offsets is not None else None
        out = (self.ids[:n], self.lps[:n], self.tops[:n] if self.k > 0 else None, offs,
               self._raw(self.sent, self.sent + n))
        self.sent += n
        self.ids, self.lps, self.tops = self.ids[n:], self.lps[n:], self.tops[n:]
        return out

    def rest(self, c: CompletionOutput) -> tuple[list[int], list[float] | None, list[dict[int, float]] | None,
                                                 list[int] | None, list[bytes] | None]:
        """The tokens the last chunk carries: the completion's after those already sent, with their offsets
        clamped to the completion's text (as the non-streamed response's)."""
        n = self.sent
        offs = None
        if self._offsets is not None:
            self.offsets += self._offsets.feed(c.token_ids[self._offsets.fed:])  # the last step's, never pushed
            offs = [min(o, len(c.text)) for o in self.offsets[n : len(c.token_ids)]]
        return (c.token_ids[n:], None if c.logprobs is None else c.logprobs[n:],
                None if c.top_logprobs is None else c.top_logprobs[n:], offs, self._raw(n, len(c.token_ids)))


class CompletionChoiceStream:
    """One completions choice of a stream: (text delta, logprobs) per engine step, then the last ones."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], logprobs: int | None, prompt: Sequence[int] = ()) -> None:
        self.tokenizer, self.k = tokenizer, logprobs
        self.text = TextStream(tokenizer, stop, prompt=prompt)
        self.logprobs = StreamLogprobs(logprobs, tokenizer) if logprobs is not None else None

    def push(self, step: StepOutput) -> tuple[str, CompletionLogprobs | None]:
        """The text that can go out after this step ("" : none yet) and the logprobs of the tokens it carries."""
        if step.finished:  # its tokens may end in a stop string: the CompletionOutput's cut text follows
            return "", None
        if self.logprobs is not None:
            self.logprobs.push(step)
        delta = self.text.push(step.new_token_ids)
        if not delta or self.logprobs is None or (ready := self.logprobs.take(len(self.text.sent))) is None:
            return delta, None
        *rows, offsets, _ = ready
        return delta, completion_logprobs(self.tokenizer, *rows, self.k, offsets=offsets)  # type: ignore[arg-type]

    def finish(self, c: CompletionOutput) -> tuple[str, CompletionLogprobs | None]:
        """The rest of the (cut) text and the logprobs of the tokens not sent yet."""
        lp = None
        if self.logprobs is not None:
            *rows, offsets, _ = self.logprobs.rest(c)
            lp = completion_logprobs(self.tokenizer, *rows, self.k, c.text, offsets)  # type: ignore[arg-type]
        return self.text.finish(c.text), lp


class ChatChoiceStream:
    """One chat choice of a stream: its chunks as the engine's steps arrive, then its last ones.

    Without tool parsing: content deltas, then the rest of the text with finish_reason. With it: content until a
    block starts (TextStream holds it back), then at the finish the rest of the parsed content, one chunk per
    call (`delta.tool_calls = [{index, id, type, function}]`) and a last chunk with finish_reason "tool_calls"."""

    def __init__(self, tokenizer: Any, index: int, stop: tuple[str, ...], tools: ToolParsing | None,
                 logprobs: bool = False, top_logprobs: int = 0, prompt: Sequence[int] = ()) -> None:
        self.tokenizer, self.index, self.tools = tokenizer, index, tools
        self.text = TextStream(tokenizer, stop, tool_calls=tools is not None, prompt=prompt)
        self.logprobs = StreamLogprobs(top_logprobs, tokenizer) if logprobs else None

    def start(self) -> ChatChunkChoice:
        """The role chunk every choice opens with; its content "" (as the OpenAI API sends it) is left out with
        tools, where the message may turn out to be calls only (content null, as a non-streamed one has it)."""
        return ChatChunkChoice(index=self.index, delta=ChatDelta(role="assistant",
                                                                 content=None if self.tools is not None else ""))

    def push(self, step: StepOutput) -> list[ChatChunkChoice]:
        if step.finished:  # its tokens may end in a stop string: the CompletionOutput's cut text follows
            return []
        if self.logprobs is not None:
            self.logprobs.push(step)
        delta = self.text.push(step.new_token_ids)
        if not delta:
            return []
        lp = None
        if self.logprobs is not None and (ready := self.logprobs.take(len(self.text.sent))) is not None:
            lp = chat_logprobs(self.tokenizer, *ready[:3], self.logprobs.k, ready[4])
        return [ChatChunkChoice(index=self.index, delta=ChatDelta(content=delta), logprobs=lp)]

    def finish(self, c: CompletionOutput) -> list[ChatChunkChoice]:
        lp = None
        if self.logprobs is not None:
            ids, lps, tops, _, raw = self.logprobs.rest(c)
            lp = chat_logprobs(self.tokenizer, ids, lps, tops, self.logprobs.k, raw)
        last = dict(index=self.index, logprobs=lp, tlt_versions=tlt_versions(c.versions))
        parsed = parsed_text(self.tools, c)
        if not parsed.calls:
            return [ChatChunkChoice(delta=ChatDelta(content=self.text.finish(c.text)), finish_reason=finish_reason(c),
                                    **last)]
        out = []
        if rest := self.text.finish(parsed.content or ""):
            out.append(ChatChunkChoice(index=self.index, delta=ChatDelta(content=rest)))
        for k, call in enumerate(_tool_calls(parsed)):
            out.append(ChatChunkChoice(index=self.index, delta=ChatDelta(tool_calls=[
                ToolCallDelta(index=k, **call.model_dump())])))
        return [*out, ChatChunkChoice(delta=ChatDelta(), finish_reason="tool_calls", **last)]
