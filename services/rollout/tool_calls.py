"""Tool calls in generated text: the Hermes format -> OpenAI `tool_calls`.

Qwen2.5, Qwen3 and the Hermes models write a call as a block in their text:

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_hermes(text, names)` finds the blocks and returns the calls with the
rest of the text as `content`. A pure function of the text (call ids are
drawn by the response builder), so that the non-streaming and streaming
responses give the same calls for the same text.

What counts as a call (the rest stays in `content`, as text, as vLLM's hermes
parser leaves it; the model's tokens are the training data either way):
- a block holding one JSON object with a string `name` among the request's
  tools and `arguments` that is a JSON object, or a string holding one (some
  models double-encode it: decoded, so the client gets `arguments` as the
  object's JSON, never a JSON string inside a JSON string);
- the last block may lack `</tool_call>` when the sample stopped on its own
  (a client's stop string `</tool_call>` is cut from the text); in a sample
  cut by max_tokens (`truncated`) an unfinished block means the calls may be
  incomplete: nothing is parsed and the text is all content.
`content` is the text outside the parsed blocks with trailing whitespace
stripped (None when nothing is left): leading text is kept as generated, so
that a stream's content deltas, sent before the first block, add up to it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PARSERS = ("hermes", "none")  # [rollout] tool_call_parser
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # compact JSON of an object


@dataclass(frozen=True)
class ParsedText:
    content: str | None
    calls: tuple[ParsedCall, ...]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: Python reads them, strict parsers (JSON.parse) refuse


def _strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


def _call(body: str, names: frozenset[str]) -> ParsedCall | None:
    """The call one block's body holds, or None when it is not a well-formed call to one of `names` (in strict
    JSON: `arguments` go out as JSON every client can parse)."""
    try:
        obj = _strict_json(body)
    except (ValueError, RecursionError):  # RecursionError: a model that wrote `[[[[...` a long way
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments")
    if isinstance(args, str):  # double-encoded: '"arguments": "{\"city\": \"Paris\"}"'
        try:
            args = _strict_json(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":")))


def parse_hermes(text: str, names: frozenset[str], parallel: bool = True, truncated: bool = False) -> ParsedText:
    """The calls in `text` to tools named in `names`, and the text left around them as content.

    parallel=False keeps only the first call (the later well-formed blocks are dropped, from content too: as
    vLLM does, the client asked for one call). truncated: the sample was cut (max_tokens, abort); an unfinished
    last block then makes the whole text content, with no calls."""
    blocks = list(_BLOCK.finditer(text))
    if truncated and blocks and not blocks[-1].group(0).endswith(TOOL_CALL_END):
        return ParsedText(text, ())
    calls: list[ParsedCall] = []
    kept: list[str] = []
    pos = 0
    for b in blocks:
        call = _call(b.group(1).strip(), names)
        if call is None:
            continue
        kept.append(text[pos:b.start()])
        pos = b.end()
        if parallel or not calls:
            calls.append(call)
    if not calls:
        return ParsedText(text, ())
    content = ("".join(kept) + text[pos:]).rstrip()
    return ParsedText(content or None, tuple(calls))


def partial_start(text: str) -> int:
    """Length of the longest end of `text` that could begin a `<tool_call>` (a stream holds it back)."""
    for k in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return k
    return 0
