"""The HTTP API's SSE framing (services/rollout/http_errors.py `Sse`): one event per chunk, whatever the text holds.

Real parts: the framing function the streamed /v1 endpoints send every chunk through; no server (what it frames is
the generated text, which a tiny random model cannot be made to produce on demand).
"""

from __future__ import annotations

import json

from tlt.services.rollout.http_errors import Sse


def test_line_separators_in_generated_text_stay_inside_their_event():
    """Generated text may hold U+2028, U+2029 or U+0085, which many clients' line splitters (Python's
    str.splitlines, JavaScript's readline helpers) take for line breaks: sent raw, one chunk's `data:` line came
    apart into two lines and the client failed to parse the first half. They leave escaped, the frame is plain
    ASCII, one `data:` line and the blank line ending the event, and it decodes back to the same text."""
    text = "a\u2028b\u2029c\u0085d\re\nf é"
    frame = Sse.data({"choices": [{"text": text}]})
    assert frame.isascii(), frame
    assert frame.endswith(b"\n\n") and frame.startswith(b"data: ")
    line = frame.decode()[: -2]
    assert line.splitlines() == [line]  # no splitter of any kind sees a break inside the event
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_a_chunk_carries_only_its_set_keys_and_the_nullable_ones():
    """A streamed chat chunk carries what it sets (a content delta: `content` alone) plus the keys the OpenAI API
    always sends (`logprobs`, `finish_reason`: null until the end), as the API does. Dumped with every unset field,
    each delta said `"role": null, "tool_calls": null` (a client merging deltas into its message wiped the role, one
    reading tool_calls found a null where it expected none) and every chunk had `"usage": null` without
    include_usage."""
    from tlt.services.rollout.openai_schema import ChatChunkChoice, ChatCompletionChunk, ChatDelta

    chunk = ChatCompletionChunk(id="c1", created=1, model="m",
                                choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="hi"))])
    got = json.loads(Sse.data(chunk).decode().removeprefix("data: "))
    assert got == {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]}
    assert json.loads(Sse.data(chunk, nulls=("usage",)).decode().removeprefix("data: "))["usage"] is None
