"""Tool calls written by the model, end to end through the real server, read by the real `openai` SDK.

What is scripted: only the engine's next-token choice. The replica runs `tests/scripted_engine.py:ScriptedEngine`,
the native `LLMEngine` whose logits, after the model's real forward, are raised at the next token of a text chosen
by the prompt (a key in the user's message or the tool's result -> a reply; `REPLIES`), tokenized by the
checkpoint's tokenizer and followed by EOS. So the random tiny model "writes" `<tool_call>` blocks.

What is real: everything else. The server (uvicorn on 127.0.0.1, a spawned replica process), the chat template
rendering the tools and the replayed history (a Hermes-style template, `rollout_helpers.hermes_checkpoint`), the
engine's scheduling, forward, sampler (greedy argmax, logprobs), stop checks, StepOutputs and CompletionOutputs,
the Hermes parser on the generated text, the non-streaming and streaming response builders, usage, and the SDK's
own response models and stream accumulator (`client.chat.completions.stream`).
"""

from __future__ import annotations

import json

import openai
import pytest

from rollout_helpers import TOOLS, ServerThread
from scripted_engine import SCRIPT_ENV



def call_block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# prompt key -> what the scripted model writes when its prompt holds the key (the key found last wins)
ONE, TWO, GOOD, BAD, RESULT = ("Weather in Paris, please.", "Oslo weather and two plus three.",
                               "A well-formed call, please.", "A broken call, please.", "22C, sunny")
ONE_TEXT = "I will look it up.\n" + call_block("get_weather", {"city": "Paris"})
TWO_TEXT = "Both, then.\n" + call_block("get_weather", {"city": "Oslo"}) + "\n" + call_block("add", {"a": 2, "b": 3})
GOOD_TEXT = call_block("add", {"a": 1})
BAD_TEXT = "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 1}})[:-1] + "\n</tool_call>"  # a } short
FINAL_TEXT = "It is 22C and sunny in Paris."
REPLIES = {ONE: ONE_TEXT, TWO: TWO_TEXT, GOOD: GOOD_TEXT, BAD: BAD_TEXT, RESULT: FINAL_TEXT}


@pytest.fixture(scope="module")
def server(hermes_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SCRIPT_ENV, json.dumps(list(REPLIES.items())))  # inherited by the spawned replica
        # the tiny tokenizer spends about a token per character of the tools' JSON
        with ServerThread(hermes_model_dir, replicas=1, backend="scripted_engine:ScriptedEngine",
                          engine={"max_model_len": 1024}) as s:
            yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def scripted_tokens(hermes_tok, text: str) -> int:
    return len(hermes_tok.encode(text, add_special_tokens=False)) + 1  # + the EOS that ends the script


def prompt_ids(hermes_tok, messages, tools=None) -> list[int]:
    return hermes_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]


def chat(client, server, messages, stream: bool, **kw):
    """A completion of `messages` with TOOLS: the response, or what the SDK's stream helper accumulates (usage
    included); with the content the stream sent, for a streamed one."""
    kw = dict(model=server.model_name, messages=messages, tools=TOOLS, temperature=0, max_tokens=300, **kw)
    if not stream:
        return client.chat.completions.create(**kw), None
    with client.chat.completions.stream(stream_options={"include_usage": True}, **kw) as s:
        sent = "".join(e.delta for e in s if e.type == "content.delta")
        return s.get_final_completion(), sent


def calls(message) -> list[tuple[str, str, dict]]:
    return [(t.type, t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or ()]


def test_the_model_writes_text_and_a_call(client, server, hermes_tok):
    """Non-streaming: the text before the block is the content, the block is the call, finish_reason
    "tool_calls"; usage and logprobs count every scripted token. Without tools the same generation is all text."""
    r, _ = chat(client, server, [user(ONE)], False, logprobs=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "I will look it up."
    assert calls(c.message) == [("function", "get_weather", {"city": "Paris"})]
    assert c.message.tool_calls[0].id.startswith("call_")
    assert r.usage.completion_tokens == scripted_tokens(hermes_tok, ONE_TEXT) == len(c.logprobs.content)
    assert r.usage.prompt_tokens == len(prompt_ids(hermes_tok, [user(ONE)], TOOLS))
    plain = client.chat.completions.create(model=server.model_name, messages=[user(ONE)], temperature=0,
                                           max_tokens=300)
    assert plain.choices[0].message.content == ONE_TEXT and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.tool_calls is None


def test_streamed_call_is_the_non_streamed_message(client, server, hermes_tok):
    """`client.chat.completions.stream(...)`: the accumulated message and finish reason are the non-streamed
    ones, usage too; no part of the block was ever sent as content."""
    whole, _ = chat(client, server, [user(ONE)], False)
    final, sent = chat(client, server, [user(ONE)], True)
    c, w = final.choices[0], whole.choices[0]
    assert c.finish_reason == w.finish_reason == "tool_calls"
    assert c.message.content == w.message.content == "I will look it up."
    assert calls(c.message) == calls(w.message) == [("function", "get_weather", {"city": "Paris"})]
    assert "<tool" not in sent and sent.rstrip() == "I will look it up."
    assert final.usage.completion_tokens == whole.usage.completion_tokens == scripted_tokens(hermes_tok, ONE_TEXT)


@pytest.mark.parametrize("stream", [False, True])
def test_two_calls_and_parallel_tool_calls_false(client, server, stream):
    """Two blocks in one completion are two calls, in order; `parallel_tool_calls=False` keeps the first."""
    both = [("function", "get_weather", {"city": "Oslo"}), ("function", "add", {"a": 2, "b": 3})]
    r, _ = chat(client, server, [user(TWO)], stream)
    assert calls(r.choices[0].message) == both and r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Both, then."
    assert len({t.id for t in r.choices[0].message.tool_calls}) == 2
    if stream:  # the stream numbers its calls
        assert [t.index for t in r.choices[0].message.tool_calls] == [0, 1]
    r, _ = chat(client, server, [user(TWO)], stream, parallel_tool_calls=False)
    assert calls(r.choices[0].message) == both[:1] and r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Both, then."


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_block_stays_content(client, server, hermes_tok, stream):
    """A block one brace short is no call: the whole text is the content, finish_reason "stop". The same
    block well-formed (the control, same server and path) is a call."""
    r, _ = chat(client, server, [user(GOOD)], stream)
    assert calls(r.choices[0].message) == [("function", "add", {"a": 1})]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    r, sent = chat(client, server, [user(BAD)], stream)
    c = r.choices[0]
    assert c.message.content == BAD_TEXT and c.finish_reason == "stop" and c.message.tool_calls is None
    assert sent in (None, BAD_TEXT)
    assert r.usage.completion_tokens == scripted_tokens(hermes_tok, BAD_TEXT)


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_call_result_answer(client, server, hermes_tok, stream):
    """An agent's loop: the model calls a tool; the SDK's message and the tool's result are appended and the
    model asked again; it answers (its script is keyed on the result, so the answer shows the result reached
    the prompt). The second prompt is the template's rendering of that history with the tools: the call as a
    `<tool_call>` block with its arguments as a mapping, the result as a `<tool_response>`."""
    first, _ = chat(client, server, [user(ONE)], stream)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = [user(ONE), msg.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    r, _ = chat(client, server, history, False)
    c = r.choices[0]
    assert c.message.content == FINAL_TEXT and c.finish_reason == "stop" and c.message.tool_calls is None
    assert r.usage.completion_tokens == scripted_tokens(hermes_tok, FINAL_TEXT)
    hf_history = [user(ONE), {"role": "assistant", "content": "I will look it up.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    ids = prompt_ids(hermes_tok, hf_history, TOOLS)
    text = hermes_tok.decode(ids)
    assert ('I will look it up.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in text)
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in text and "<tools>" in text
    assert r.usage.prompt_tokens == len(ids)
