"""Tool calling in /v1/chat/completions: `tools` in the prompt, calls parsed from the text, history replay.

Real parts: the Hermes parser (a pure function, on hand-written texts); the response builders of
openai_convert with the real tiny tokenizer and real `CompletionOutput` / `StepOutput` objects, read back by
the real `openai` SDK (its response models and its own stream accumulator, `ChatCompletionStreamState`); the
real server (uvicorn on 127.0.0.1, one replica running the native engine) driven by the `openai` client, on a
tiny checkpoint whose chat template is a small Hermes-style one written here (the shipped tiny template does
not render tools, and stays as it is: tests/test_rollout_http.py checks it is refused with tools).

What is not exercised end to end here, and why: a random tiny model does not write a `<tool_call>` block, and no
request field can make it (logit_bias is refused, and constrained decoding is not offered), so a response that
holds tool calls never comes from the engine here (tests/test_rollout_scripted_tools.py does that, with the native
engine's next-token choice scripted). The text -> tool_calls step is covered by the parser tests
and by the builders fed `CompletionOutput`s / `StepOutput`s holding tool-call text, i.e. the very functions the
server calls (`conv.chat_choice`, `conv.ChatChoiceStream`); the server tests cover everything around them
(rendering, replay, refusals, the streaming path with tools on).
"""

from __future__ import annotations

import json
import random
import re

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from rollout_helpers import ADD, TOOLS, WEATHER, ServerThread

NAMES = frozenset({"get_weather", "add"})


def call_block(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---- the parser, a pure function ------------------------------------------------------------------


def parse(text: str, **kw):
    from tlt.services.rollout.tool_calls import parse_hermes

    return parse_hermes(text, NAMES, **kw)


def test_one_call():
    p = parse(call_block("get_weather", {"city": "Paris"}))
    assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", '{"city":"Paris"}')]
    assert p.content is None


def test_two_calls_and_content_before_them():
    text = "Let me check both.\n" + call_block("get_weather", {"city": "Oslo"}) + "\n" + call_block("add", {"a": 1})
    p = parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("get_weather", {"city": "Oslo"}),
                                                                     ("add", {"a": 1})]
    assert p.content == "Let me check both."


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = "x " + call_block("add", {"a": 1}) + call_block("add", {"a": 2})
    p = parse(text, parallel=False)
    assert [json.loads(c.arguments) for c in p.calls] == [{"a": 1}]
    assert p.content == "x"  # the dropped call is not turned into text either


def test_malformed_json_stays_text_and_the_good_call_is_still_parsed():
    bad = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}\n</tool_call>"  # one brace short
    p = parse(bad)
    assert p.calls == () and p.content == bad  # nothing parsed: the text is returned as generated
    p = parse(bad + "\n" + call_block("add", {"a": 2}))
    assert [json.loads(c.arguments) for c in p.calls] == [{"a": 2}]
    assert p.content == bad


@pytest.mark.parametrize("args", ['{"a": NaN}', '{"a": -Infinity}', '"{\\"a\\": Infinity}"'])
def test_arguments_python_reads_but_json_does_not_are_no_call(args):
    # json.loads took NaN and Infinity, and arguments went out as '{"a":NaN}', which JSON.parse and most SDKs refuse
    text = '<tool_call>\n{"name": "add", "arguments": ' + args + '}\n</tool_call>'
    p = parse(text)
    assert p.calls == () and p.content == text


@pytest.mark.parametrize("body", [
    {"name": "rm_rf", "arguments": {}},            # not among the request's tools
    {"arguments": {"city": "Paris"}},              # no name
    {"name": "add", "arguments": [1, 2]},          # arguments not an object
    {"name": "add", "arguments": "not json"},      # a string that holds no JSON object
    {"name": "add"},                               # no arguments
    {"name": "add", "arguments": "[" * 100_000},   # nested past Python's recursion limit (a 500 if raised)
    ["add", {"a": 1}],                             # not an object
])
def test_a_block_that_is_no_call_to_a_known_tool_stays_text(body):
    text = "<tool_call>" + json.dumps(body) + "</tool_call>"
    p = parse(text)
    assert p.calls == () and p.content == text


def test_arguments_given_as_a_json_string_are_decoded():
    """Some models double-encode: `"arguments": "{\\"city\\": \\"Paris\\"}"`. The client gets the object's JSON
    (what `json.loads(call.function.arguments)` should give), not a JSON string holding JSON."""
    p = parse("<tool_call>" + json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})})
              + "</tool_call>")
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("get_weather", {"city": "Paris"})]


def test_unterminated_block():
    """A sample that stopped on its own with its last block open (a client's stop string `</tool_call>` is cut
    from the text) still made that call; one cut by max_tokens inside a block is returned as raw text."""
    text = "ok\n<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 1}}) + "\n"
    p = parse(text)
    assert [(c.name, c.arguments) for c in p.calls] == [("add", '{"a":1}')] and p.content == "ok"
    p = parse(text, truncated=True)
    assert p.calls == () and p.content == text
    cut = parse(call_block("add", {"a": 1}) + "\n<tool_call>\n{\"name\": \"ad", truncated=True)
    assert cut.calls == () and cut.content.startswith("<tool_call>")
    p = parse(text[:-9])  # stopped on its own inside the JSON: no call, the text as generated
    assert p.calls == () and p.content == text[:-9]


def test_non_ascii_arguments_and_text_after_the_calls():
    p = parse(call_block("get_weather", {"city": "Zürich"}) + "\nDone.")
    assert p.calls[0].arguments == '{"city":"Zürich"}'
    assert p.content == "\nDone."  # text outside the blocks is kept; leading whitespace as generated


# ---- the response builders, as the server calls them ----------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from tlt.model.tokenizer import test_tokenizer

    return test_tokenizer()


def output(tok, text: str, finish: str = "stop", logprobs: bool = False):
    from tlt.services.rollout.types import CompletionOutput, FinishReason, Versions

    ids = tok.encode(text)
    return CompletionOutput(request_id="r", sample_index=0, prompt_token_ids=[1], token_ids=ids,
                            text=tok.decode(ids, skip_special_tokens=True), finish_reason=FinishReason(finish),
                            versions=Versions(policy=3), logprobs=[-0.5] * len(ids) if logprobs else None)


def as_sdk_response(choices) -> ChatCompletion:
    """What the SDK makes of a response holding these choices (dumped as the server dumps it)."""
    from tlt.services.rollout.openai_schema import ChatCompletionResponse

    body = ChatCompletionResponse(id="chatcmpl-1", created=0, model="m", choices=choices)
    return ChatCompletion.model_validate(json.loads(json.dumps(body.model_dump(exclude_none=True))))


TOOL_TEXT = ("I will look both up.\n" + call_block("get_weather", {"city": "Paris"}) + "\n"
             + call_block("add", {"a": 2, "b": 3}))


def test_chat_choice_holds_the_parsed_calls(tok):
    from tlt.services.rollout import openai_convert as conv

    tools = conv.ToolParsing(NAMES, parallel=True)
    c = output(tok, TOOL_TEXT, logprobs=True)
    r = as_sdk_response([conv.chat_choice(tok, 0, c, True, 0, tools)])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look both up."
    calls = choice.message.tool_calls
    assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "add", {"a": 2, "b": 3})]
    assert all(re.fullmatch(r"call_[0-9a-zA-Z]{24}", t.id) for t in calls) and calls[0].id != calls[1].id
    assert len(choice.logprobs.content) == len(c.token_ids)  # the tokens are still all there, logprobs too
    assert choice.model_extra["tlt_versions"] == {"policy": 3, "drafter": -1}
    # cut by max_tokens inside the second block: "length", the raw text, no calls
    cut = output(tok, TOOL_TEXT[:-20], finish="length")
    choice = as_sdk_response([conv.chat_choice(tok, 0, cut, False, 0, tools)]).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == cut.text
    # no parsing asked for (no tools, tool_choice "none", tool_call_parser "none"): the text as it was
    choice = as_sdk_response([conv.chat_choice(tok, 0, c, False, 0, None)]).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == c.text and choice.message.tool_calls is None


def test_each_choice_is_parsed_on_its_own(tok):
    """n > 1: one sample calls a tool, the other answers in text; each choice says what its own sample did."""
    from tlt.services.rollout import openai_convert as conv

    tools = conv.ToolParsing(NAMES)
    outs = [output(tok, TOOL_TEXT), output(tok, "It is sunny.")]
    r = as_sdk_response([conv.chat_choice(tok, i, c, False, 0, tools) for i, c in enumerate(outs)])
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "stop"]
    assert [len(c.message.tool_calls or ()) for c in r.choices] == [2, 0]
    assert r.choices[1].message.content == "It is sunny."


@pytest.mark.parametrize("body, parser, parses", [
    ({"tools": TOOLS}, "hermes", True),
    ({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}, "hermes", True),
    ({"tools": TOOLS, "tool_choice": "none"}, "hermes", False),   # tools rendered, text not parsed
    ({"tools": TOOLS}, "none", False),                             # [rollout] tool_call_parser = "none"
    ({}, "hermes", False),
    ({"tools": []}, "hermes", False),
])
def test_which_requests_are_parsed_for_tool_calls(body, parser, parses):
    from tlt.services.rollout import openai_convert as conv
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.rollout.openai_schema import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **body})
    assert req.invalid() is None and req.unsupported() is None
    got = conv.tool_parsing(req, RolloutConfig(tool_call_parser=parser).tool_call_parser)
    assert (got is not None) == parses
    if got is not None:
        assert got == conv.ToolParsing(NAMES, parallel=body.get("parallel_tool_calls", True))


def stream_choice(tok, text: str, tools, finish: str = "stop", stop: tuple[str, ...] = (), seed: int = 0):
    """Drive `ChatChoiceStream` as `_chat_stream` does: the steps' tokens, 1-3 at a time, then the finished
    output; returns the SSE payloads of the choice's chunks (role chunk first, as the server sends it)."""
    from tlt.services.rollout import openai_convert as conv
    from tlt.services.rollout.openai_schema import ChatCompletionChunk as Chunk
    from tlt.services.rollout.types import StepOutput

    c = output(tok, text, finish)
    stream = conv.ChatChoiceStream(tok, 0, stop, tools)
    choices = [stream.start()]
    rng, i, sent = random.Random(seed), 0, ""
    while i < len(c.token_ids):
        k = rng.randint(1, 3)
        for ch in stream.push(StepOutput("r", 0, c.token_ids[i:i + k])):
            choices.append(ch)
            sent += ch.delta.content or ""
            assert tools is None or "<tool_call" not in sent  # with tools, no part of a block leaves as content
        i += k
    choices += stream.finish(c)
    return [json.loads(json.dumps(Chunk(id="chatcmpl-1", created=0, model="m", choices=[ch])
                                  .model_dump(exclude_none=True))) for ch in choices]


@pytest.mark.parametrize("text", [
    TOOL_TEXT,
    call_block("add", {"a": 1}),                            # a call and nothing else: content null
    "no call at all, just <tool text> and <tool_",          # held back, then sent at the finish
    "<tool_call>{\"name\": \"add\", \"arguments\": {]}</tool_call> then text",  # malformed: all text
    "a\n\n" + call_block("get_weather", {"city": "Zürich"}) + " trailing",
])
def test_streamed_tool_calls_accumulate_to_the_non_streamed_response(tok, text):
    """The SDK's own stream accumulator (what `client.chat.completions.stream(...)` uses) gives the same
    message as the non-streaming response for the same output: content, calls (ids aside: drawn per response),
    finish_reason."""
    from tlt.services.rollout import openai_convert as conv

    tools = conv.ToolParsing(NAMES, parallel=True)
    whole = as_sdk_response([conv.chat_choice(tok, 0, output(tok, text), False, 0, tools)]).choices[0]
    for seed in range(3):
        chunks = stream_choice(tok, text, tools, seed=seed)
        state = ChatCompletionStreamState(input_tools=TOOLS)
        for ch in chunks:
            state.handle_chunk(ChatCompletionChunk.model_validate(ch))
        got = state.get_final_completion().choices[0]
        assert got.finish_reason == whole.finish_reason
        assert got.message.content == whole.message.content, chunks
        key = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls or []] == key
        assert all(re.fullmatch(r"call_[0-9a-zA-Z]{24}", t.id) for t in got.message.tool_calls or [])
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == list(range(len(key)))
        assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == whole.finish_reason


def test_random_texts_stream_to_the_non_streamed_message(tok):
    """Texts stitched from the pieces that matter (block tags whole and split, JSON of calls good and bad,
    whitespace, words), streamed in random token runs: the streamed message always equals the non-streamed
    one, and no complete `<tool_call>` is ever sent as content."""
    from tlt.services.rollout import openai_convert as conv

    good = [json.dumps({"name": "add", "arguments": {"a": 1}}), json.dumps({"name": "get_weather",
                                                                            "arguments": {"city": "Zürich"}})]
    blocks = [call_block("add", {"a": 1}), "<tool_call>" + good[1] + "</tool_call>", "<tool_call>" + good[0]]
    pieces = ["<tool_call>", "</tool_call>", "<tool", "_call>", "<", "\n", " ", "ok", "é", "{", *good, *blocks]
    rng = random.Random(1)
    tools = conv.ToolParsing(NAMES)
    for trial in range(100):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.5:  # the usual shape: some text, then the calls
            text += rng.choice(["", "\n", " \n\n"]) + rng.choice(blocks)
        finish = rng.choice(["stop", "stop", "length"])
        whole = as_sdk_response([conv.chat_choice(tok, 0, output(tok, text, finish), False, 0, tools)]).choices[0]
        chunks = stream_choice(tok, text, tools, finish=finish, seed=trial)  # checks what the steps send
        state = ChatCompletionStreamState()
        for ch in chunks:
            state.handle_chunk(ChatCompletionChunk.model_validate(ch))
        got = state.current_completion_snapshot.choices[0]
        assert (got.message.content, got.finish_reason) == (whole.message.content, whole.finish_reason), text
        assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls or []] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls or []], text


def test_a_client_stop_string_at_the_block_end_still_makes_the_call(tok):
    """Agent loops often pass stop=["</tool_call>"] to get one call per turn: the engine cuts the stop string from
    the text, which then ends in an open block. A sample that stopped there made its call, streamed or not."""
    from tlt.services.rollout import openai_convert as conv

    text = "Sure.\n<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}}) + "\n"
    tools = conv.ToolParsing(NAMES)
    whole = as_sdk_response([conv.chat_choice(tok, 0, output(tok, text), False, 0, tools)]).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for ch in stream_choice(tok, text, tools, stop=("</tool_call>",)):
        state.handle_chunk(ChatCompletionChunk.model_validate(ch))
    got = state.get_final_completion().choices[0]
    assert got.message.content == "Sure." and got.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in got.message.tool_calls] == [("add", '{"a":1,"b":2}')]


def test_streamed_choice_without_tools_is_unchanged(tok):
    """With no tool parsing, a `<tool_call>` in the text is ordinary text and streams as it comes."""
    chunks = stream_choice(tok, TOOL_TEXT, None)
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    assert text == output(tok, TOOL_TEXT).text and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("tool_calls" in ch["choices"][0]["delta"] for ch in chunks)


# ---- the real server, with a Hermes-style chat template -------------------------------------------

@pytest.fixture(scope="module")
def server(hermes_model_dir):
    # the tiny tokenizer, trained on arithmetic, spends about a token per character of the tools' JSON
    with ServerThread(hermes_model_dir, replicas=1, engine={"max_model_len": 1024}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def prompt_ids(hermes_tok, messages, tools=None) -> list[int]:
    return hermes_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]


USER = {"role": "user", "content": "Weather in Paris?"}


def test_tools_reach_the_prompt(client, server, hermes_tok):
    """The tools are rendered by the model's template (prompt_tokens = HF's `apply_chat_template(tools=...)`
    of the same inputs, more than without them); tool_choice "none" renders them too (vLLM's default: the
    model sees its tools, its text is just not parsed)."""
    kw = dict(model=server.model_name, messages=[USER], max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**kw)
    assert plain.usage.prompt_tokens == len(prompt_ids(hermes_tok, [USER]))
    with_tools = prompt_ids(hermes_tok, [USER], TOOLS)
    assert "<tools>" in hermes_tok.decode(with_tools) and '"name": "get_weather"' in hermes_tok.decode(with_tools)
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {"parallel_tool_calls": False}):
        r = client.chat.completions.create(tools=TOOLS, **choice, **kw)
        assert r.usage.prompt_tokens == len(with_tools) > plain.usage.prompt_tokens, choice
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


def test_streaming_with_tools_gives_the_non_streamed_text(client, server):
    """The streaming path with tool parsing on (content held back around a possible `<tool_call>`), read by the
    SDK's `chat.completions.stream` helper: the same message as the non-streaming request, n=2 included."""
    kw = dict(model=server.model_name, messages=[USER], max_tokens=24, temperature=0, tools=TOOLS, n=2,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    with client.chat.completions.stream(**kw) as s:
        for _ in s:
            pass
        final = s.current_completion_snapshot  # get_final_completion() refuses a "length" finish with tools
    assert [c.message.content for c in final.choices] == [c.message.content for c in whole.choices]
    assert [c.finish_reason for c in final.choices] == ["length", "length"]


def sdk_message_with_a_call(tok, streamed: bool):
    """The assistant message the SDK makes of this server's response holding a call (built by the server's own
    response builders from a completion that wrote one): the response's message, or the one the SDK's stream
    accumulator puts together from the streamed chunks (it adds `index`, `parsed_arguments`, `parsed`)."""
    from tlt.services.rollout import openai_convert as conv

    text, tools = "Checking.\n" + call_block("get_weather", {"city": "Paris"}), conv.ToolParsing(NAMES, True)
    if not streamed:
        return as_sdk_response([conv.chat_choice(tok, 0, output(tok, text), False, 0, tools)]).choices[0].message
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for ch in stream_choice(tok, text, tools):
        state.handle_chunk(ChatCompletionChunk.model_validate(ch))
    return state.get_final_completion().choices[0].message


@pytest.mark.parametrize("dump, streamed", [("model_dump", False), ("to_dict", False), ("model_dump", True)])
def test_multi_turn_replay_of_an_sdk_message_with_tool_calls(client, server, hermes_tok, dump, streamed):
    """An agent loop appends the SDK's response message (`model_dump()` or `to_dict()`, of a response or of a
    stream) and the tool's result, then asks again: accepted, and rendered as the template renders the HF form
    of the history (the call's `arguments` as a mapping, not the JSON string the OpenAI API carries)."""
    msg = sdk_message_with_a_call(hermes_tok, streamed)
    call = msg.tool_calls[0]
    history = [USER, getattr(msg, dump)(), {"role": "tool", "tool_call_id": call.id, "content": "22C, sunny"}]
    r = client.chat.completions.create(model=server.model_name, messages=history, tools=TOOLS, max_tokens=4,
                                       temperature=0)
    hf_history = [USER, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "22C, sunny"}]
    ids = prompt_ids(hermes_tok, hf_history, TOOLS)
    text = hermes_tok.decode(ids)
    assert 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n22C, sunny\n</tool_response>" in text
    as_string = [*hf_history[:1], json.loads(json.dumps(hf_history[1])), hf_history[2]]
    as_string[1]["tool_calls"][0]["function"]["arguments"] = call.function.arguments
    assert len(prompt_ids(hermes_tok, as_string, TOOLS)) != len(ids)  # the count tells the two renderings apart
    assert r.usage.prompt_tokens == len(ids)


def bad_request(server, **body) -> dict:
    base = {"model": server.model_name, "max_tokens": 2, "messages": [USER]}
    r = httpx.post(f"{server.base_url}/chat/completions", json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def replay(arguments) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER, ADD, {"type": "function", "function": {"name": "has space"}}]}, "tools.[2].function.name",
     "^[a-zA-Z0-9_-]{1,64}$"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.[0].function.name", "name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.[0].function.name", "name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.[0].function.name",
     "name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.[0].type", "function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools.[1].function.parameters", "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": "red"}}]}, "tools.[0].function.colour",
     "unknown"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "constrained decoding"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice",
     "constrained decoding"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'none' or 'auto'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": TOOLS, "messages": replay("[1, 2]")}, "messages.[1].tool_calls.[0].function.arguments",
     "JSON object"),
    ({"tools": TOOLS, "messages": replay("{not json")}, "messages.[1].tool_calls.[0].function.arguments",
     "JSON object"),
    ({"tools": TOOLS, "messages": replay("[" * 100_000)}, "messages.[1].tool_calls.[0].function.arguments",
     "JSON object"),
    ({"tools": TOOLS, "messages": [{**USER, "tool_calls": replay("{}")[1]["tool_calls"]}]},
     "messages.[0].tool_calls", "assistant"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"function_call": "auto"}, "function_call", "deprecated"),
    ({"messages": [USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.[1].function_call", "deprecated"),
])
def test_tool_requests_refused_name_their_parameter(server, body, param, words):
    """Each refusal is a 400 naming the parameter (as the API's own errors do), never a silent ignore: a
    `tool_choice` that asks for a call ("required", a named function) needs constrained decoding, which this
    server does not do; the deprecated `functions` / `function_call` API is not served."""
    err = bad_request(server, **body)
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert words in err["message"], err


@pytest.mark.parametrize("text", [TOOL_TEXT[:-20], "ok\n<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 1}})])
def test_a_sample_aborted_inside_a_block_makes_no_call(tok, text):
    """A sample ended early with finish_reason "abort" (the SGLang backend's for a cancelled or failed request) is
    cut as one max_tokens cuts: its unfinished last block may hold half the calls or half the arguments, so the
    text is all content and no call is made, finish_reason "abort"."""
    from tlt.services.rollout import openai_convert as conv

    cut = output(tok, text, finish="abort")
    choice = conv.chat_choice(tok, 0, cut, False, 0, conv.ToolParsing(NAMES))  # (the SDK's model has no "abort")
    assert choice.finish_reason == "abort" and choice.message.tool_calls is None
    assert choice.message.content == cut.text


def test_a_block_nested_past_the_recursion_limit_stays_text():
    """A model that writes `[[[[...` a long way inside a block (or inside a double-encoded `arguments` string):
    the JSON decoder's RecursionError is no call, as malformed JSON is, not an error that fails the response."""
    deep = "[" * 100_000
    for body in (deep, json.dumps({"name": "add", "arguments": deep})):
        text = "<tool_call>" + body + "</tool_call>"
        p = parse(text)
        assert p.calls == () and p.content == text
    p = parse(call_block("add", {"a": 1}) + "<tool_call>" + deep + "</tool_call>")
    assert [(c.name, c.arguments) for c in p.calls] == [("add", '{"a":1}')]
    assert p.content == "<tool_call>" + deep + "</tool_call>"


def test_a_stream_holds_back_only_an_end_that_could_begin_a_block():
    """A streamed choice with tools holds back the end of its text that may be the start of `<tool_call>` (the
    next chunk decides), and nothing else: "Hello" and "a<x" go out whole at once, "a <" holds back its "<" and
    "see <tool" its "<tool"; a whole "<tool_call>" is no partial start (the parser's)."""
    from tlt.services.rollout.tool_calls import partial_start

    assert [partial_start(t) for t in ("", "Hello", "a<x", "a <", "see <tool", "<tool_call", "call>", "<tool_call>")
            ] == [0, 0, 0, 1, 5, 10, 0, 0]
