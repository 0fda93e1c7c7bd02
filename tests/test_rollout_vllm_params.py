"""Clients written for vLLM send its extension parameters at their defaults (`repetition_penalty: 1.0`,
`skip_special_tokens: true`, ...): each was refused as an unknown parameter, so such a client could not talk to
this server at all. They are now taken at the values that are this server's behaviour and refused, naming the
parameter, at any other.

Three places where the API read or wrote text otherwise than vLLM (and the OpenAI API) do, each pinned against the
upstream code:

- a message's text content parts were joined with "" into the text the chat template renders; vLLM joins them with
  "\\n" (`vllm/entrypoints/chat_utils.py`, `_parse_chat_message_content_parts`: `text_prompt = "\\n".join(texts)`
  for a template that reads `content` as a string, as the task model's does);
- a `user`, `system`, `developer` or `tool` message with `content: null` was taken as an empty message; the OpenAI
  API requires content there (null is for an assistant message, whose calls may be all it says) and vLLM's
  request model refuses it (no member of its `ChatCompletionMessageParam` union takes a null content but the
  assistant's); it is now a 400 naming `messages.[i].content`;
- a stop token from `stop_token_ids` that is plain text (not a special token) left its text at the end of the
  completion's text; vLLM v1 leaves the token that ended a request out of its text unless
  include_stop_str_in_output (`vllm/v1/engine/detokenizer.py`, `BaseIncrementalDetokenizer.update`: stop_terminated
  -> the last token is not detokenized), as SGLang does (`trim_matched_stop`). The token stays in the token ids and
  logprobs (what the trainer trains on): only the text changes, streamed or not, with `text_offset` inside it.

Real parts: the rollout server (uvicorn and gRPC on 127.0.0.1), one replica process running the
native engine on a tiny random Qwen2 checkpoint with the task tokenizer, httpx and the openai SDK.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from rollout_helpers import ServerThread, tiny_checkpoint

DEFAULTS = {"repetition_penalty": 1.0, "min_tokens": 0, "skip_special_tokens": True,
            "spaces_between_special_tokens": True, "include_stop_str_in_output": False}
OTHERS = {"repetition_penalty": 1.2, "min_tokens": 3, "skip_special_tokens": False,
          "spaces_between_special_tokens": False, "include_stop_str_in_output": True}



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("vllm-params-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(model_dir, replicas=1) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _chat_ids(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_vllm_parameters_at_their_defaults_are_taken_and_change_nothing(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    plain = client.completions.create(model=server.model_name, prompt="1+2=", max_tokens=6, temperature=0)
    with_defaults = client.completions.create(model=server.model_name, prompt="1+2=", max_tokens=6, temperature=0,
                                              extra_body={**DEFAULTS, "repetition_penalty": 1})
    assert with_defaults.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "1+2="}],
                                          max_tokens=6, temperature=0, extra_body=DEFAULTS)
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_a_vllm_parameter_at_another_value_is_a_400_naming_it(server, name):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model_name, prompt="1+2=", max_tokens=2,
                                  extra_body={name: OTHERS[name]})
    assert e.value.body["param"] == name and "vLLM's default" in e.value.body["message"], e.value.body


def test_text_parts_are_joined_with_newlines_as_vllm_joins_them(server, tok):
    """Two text parts read as the one string "a\\nb" reads: the same prompt (its token count is the template's for
    the joined text) and, greedy, the same completion."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    joined = [{"role": "system", "content": "be\nbrief"}, {"role": "user", "content": "1+\n1="}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
             {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]}]
    want = len(_chat_ids(tok, joined))
    a = client.chat.completions.create(model=server.model_name, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=server.model_name, messages=joined, max_tokens=6, temperature=0)
    assert a.usage.prompt_tokens == want == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "2"}]


@pytest.mark.parametrize("i, role", [(0, "system"), (1, "user"), (0, "developer"), (3, "tool")])
def test_null_content_is_a_400_naming_the_message_but_for_an_assistant(server, i, role):
    messages = [dict(m) for m in HISTORY]
    messages[i].update(role=role, content=None)
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={"model": server.model_name, "max_tokens": 2, "messages": messages})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"messages.[{i}].content" and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(f"messages[{i}]: ") and "null" in err["message"], err
    # an assistant message may have null content (with or without calls), as in vLLM and the SDK's types
    ok = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": None},
          {"role": "user", "content": "2+2="}]
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={"model": server.model_name, "max_tokens": 2, "messages": ok})
    assert r.status_code == 200, r.text


def _sampled(server, tok, prompt: list[int], seed: int) -> tuple[list[int], int]:
    """Seeded sampling is reproducible: a gRPC run (for its token ids) picks a plain-text token (not a special one)
    that ends the sample a few tokens in. Returns (the sample's token ids, the token's position)."""
    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    with RolloutClient(server.grpc_address, timeout_s=60) as c:
        params = rollout_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)
        (done,) = c.generate(prompt, params=params)
    ids = list(done.token_ids)
    special = set(tok.all_special_ids)
    return ids, next(j for j in range(2, 20) if ids[j] not in ids[:j] and ids[j] not in special)


def _grpc_stopped(server, prompt: list[int], seed: int, stop: int):
    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    with RolloutClient(server.grpc_address, timeout_s=60) as c:
        params = rollout_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True, logprobs=0,
                                            stop_token_ids=[stop])
        (done,) = c.generate(prompt, params=params)
    return done


def _streamed(server, path: str, body: dict) -> tuple[str, list]:
    """The joined text of a streamed choice and its chunks' logprobs."""
    text, lps = "", []
    with httpx.stream("POST", f"{server.base_url}/{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                text += ch["text"] if path == "completions" else (ch["delta"].get("content") or "")
                if ch.get("logprobs"):
                    lps.append(ch["logprobs"])
    return text, lps


def test_a_plain_text_stop_token_s_text_is_left_out_as_vllm_leaves_it(server, tok):
    """Completions, streamed or not: the text ends before the stop token, whose id and logprob stay (token ids are
    what the trainer trains on); its text_offset is the text's end. gRPC's text is the engine's, the same."""
    prompt, seed = [100, 200, 30], 21
    ids, k = _sampled(server, tok, prompt, seed)
    stop = ids[k]
    assert tok.decode([stop], skip_special_tokens=True), "a token with text"
    want = tok.decode(ids[:k], skip_special_tokens=True)
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "stop_token_ids": [stop], "logprobs": 1}
    r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == want, (choice["text"], want, tok.decode([stop]))
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == k + 1  # the stop token's logprob stays
    assert lp["text_offset"][-1] == len(want) and all(o <= len(want) for o in lp["text_offset"])
    text, chunks = _streamed(server, "completions", body)
    assert text == want
    assert sum((c["tokens"] for c in chunks), []) == lp["tokens"]
    assert sum((c["text_offset"] for c in chunks), []) == lp["text_offset"]
    done = _grpc_stopped(server, prompt, seed, stop)  # the trainer's path: every token id and logprob, as before
    assert list(done.token_ids) == ids[: k + 1] and len(done.logprobs) == k + 1
    assert done.text == want


def test_a_plain_text_stop_token_s_text_is_left_out_of_a_chat_message(server, tok):
    messages = [{"role": "user", "content": "12+7="}]
    prompt = _chat_ids(tok, messages)
    seed = 5
    ids, k = _sampled(server, tok, prompt, seed)
    want = tok.decode(ids[:k], skip_special_tokens=True)
    body = {"model": server.model_name, "messages": messages, "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "stop_token_ids": [ids[k]], "logprobs": True}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == want
    assert len(choice["logprobs"]["content"]) == k + 1
    text, chunks = _streamed(server, "chat/completions", body)
    assert text == want
    assert [t["token"] for c in chunks for t in c["content"]] == [t["token"] for t in choice["logprobs"]["content"]]
