"""Malformed and invalid requests: each gets a 4xx in the OpenAI error format with a clear message,
and the server keeps serving (a valid request succeeds after all of them).

Real parts: the rollout server on 127.0.0.1 (uvicorn + grpc.aio), one replica process
with the native engine on a tiny random checkpoint (context 256 tokens), httpx and grpc
clients. Nothing is faked.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2

CTX = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_checkpoint(tmp_path_factory.mktemp("rollout_invalid_model"))
    with ServerThread(model, replicas=1, max_n=16, max_request_bytes=64 * 1024, max_prompts_per_batch=4) as s:
        yield s


def ok_completion(model: str, **kw):
    return {"model": model, "prompt": "1+2=", "max_tokens": 4, **kw}


def ok_chat(model: str, **kw):
    return {"model": model, "messages": [{"role": "user", "content": "1+2="}], "max_tokens": 4, **kw}


M = "{model}"  # replaced with the served model name
# (name, path, body (dict, or raw bytes), expected status, words the message must contain)
CASES = [
    ("bad_json", "completions", b'{"model": "x", "prompt": ', 400, "not valid JSON"),
    ("not_an_object", "completions", b"[1, 2, 3]", 400, "JSON object"),
    ("unknown_model", "completions", {"model": "gpt-17", "prompt": "hi"}, 404, "does not exist"),
    ("missing_prompt", "completions", {"model": M}, 400, "missing required parameter 'prompt'"),
    ("missing_model", "completions", {"prompt": "hi"}, 400, "missing required parameter 'model'"),
    ("missing_messages", "chat/completions", {"model": M}, 400, "missing required parameter 'messages'"),
    ("negative_temperature", "completions", ok_completion(M, temperature=-0.5), 400, "temperature"),
    ("nan_temperature", "completions", b'{"model": "{model}", "prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("inf_top_p", "completions", b'{"model": "{model}", "prompt": "a", "top_p": Infinity}', 400, "top_p"),
    ("top_p_zero", "completions", ok_completion(M, top_p=0.0), 400, "top_p"),
    ("top_p_above_one", "completions", ok_completion(M, top_p=1.5), 400, "top_p"),
    ("min_p_above_one", "completions", ok_completion(M, min_p=2.0), 400, "min_p"),
    ("max_tokens_zero", "completions", ok_completion(M, max_tokens=0), 400, "max_tokens"),
    ("max_tokens_negative", "completions", ok_completion(M, max_tokens=-3), 400, "max_tokens"),
    ("max_tokens_beyond_context", "completions", ok_completion(M, max_tokens=CTX), 400, "context length"),
    ("max_tokens_beyond_context_chat", "chat/completions", ok_chat(M, max_tokens=CTX), 400,
     f"max_tokens={CTX} plus the chat prompt ("),
    ("prompt_longer_than_context", "completions", ok_completion(M, prompt=list(range(10, 10 + CTX))), 400,
     "context length"),
    ("empty_prompt", "completions", ok_completion(M, prompt=""), 400, "empty"),
    ("empty_prompt_list", "completions", ok_completion(M, prompt=[]), 400, "empty"),
    ("token_id_out_of_vocab", "completions", ok_completion(M, prompt=[1, 2, 10**9]), 400, "vocabulary"),
    ("huge_n", "completions", ok_completion(M, n=100000), 400, "n=100000"),
    ("n_zero", "completions", ok_completion(M, n=0), 400, "n"),
    ("too_many_prompts", "completions", ok_completion(M, prompt=[[1]] * 4097), 400, "4097 prompts is over the limit"),
    # values the engine's sampler cannot take (they killed the replica, failing every request on it)
    ("top_k_huge", "completions", ok_completion(M, top_k=10**30), 400, "top_k"),
    # seed travels as gRPC's int64 (and int64 engine seeds): 2**63 was accepted over HTTP
    ("seed_beyond_int64", "completions", ok_completion(M, seed=2**63), 400, "seed"),
    ("seed_below_int64", "chat/completions", ok_chat(M, seed=-(2**63) - 1), 400, "seed"),
    ("seed_huge", "completions", ok_completion(M, seed=10**30), 400, "seed"),
    ("top_k_huge_negative", "chat/completions", ok_chat(M, top_k=-(10**30)), 400, "top_k"),
    ("temperature_underflows", "completions", ok_completion(M, temperature=1e-40), 400, "temperature"),
    ("temperature_underflows_chat", "chat/completions", ok_chat(M, temperature=5e-324), 400, "temperature"),
    ("temperature_string", "completions", ok_completion(M, temperature="hot"), 400, "temperature"),
    ("max_tokens_float", "completions", ok_completion(M, max_tokens=3.5), 400, "max_tokens"),
    ("stream_string", "completions", ok_completion(M, stream="yes"), 400, "stream"),
    ("prompt_dict", "completions", ok_completion(M, prompt={"text": "hi"}), 400, "prompt"),
    ("logprobs_too_large", "completions", ok_completion(M, logprobs=50), 400, "logprobs"),
    ("top_logprobs_too_large", "chat/completions", ok_chat(M, logprobs=True, top_logprobs=50), 400, "logprobs"),
    ("top_logprobs_without_logprobs", "chat/completions", ok_chat(M, top_logprobs=2), 400, "logprobs: true"),
    ("stop_wrong_type", "completions", ok_completion(M, stop=5), 400, "stop"),
    ("stop_empty_string", "completions", ok_completion(M, stop=[""]), 400, "stop"),
    ("too_many_stops", "completions", ok_completion(M, stop=[str(i) for i in range(20)]), 400, "stop"),
    ("unknown_parameter", "completions", ok_completion(M, temprature=0.5), 400, "unknown parameter 'temprature'"),
    ("unsupported_penalty", "completions", ok_completion(M, presence_penalty=1.0), 400, "not supported"),
    ("unsupported_logit_bias", "completions", ok_completion(M, logit_bias={"5": 3.0}), 400, "not supported"),
    ("bad_role", "chat/completions", {"model": M, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("empty_messages", "chat/completions", {"model": M, "messages": []}, 400, "messages"),
    ("message_content_number", "chat/completions", {"model": M, "messages": [{"role": "user", "content": 7}]}, 400,
     "content"),
    ("both_max_tokens", "chat/completions", ok_chat(M, max_completion_tokens=3), 400, "not both"),
    # stop ids the vocabulary does not hold were taken silently (they could never stop anything)
    ("stop_token_id_out_of_vocab", "completions", ok_completion(M, stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("stop_token_id_negative", "chat/completions", ok_chat(M, stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("max_completion_tokens_zero", "chat/completions", ok_chat(M, max_tokens=None, max_completion_tokens=0), 400,
     "max_completion_tokens must be"),
    ("max_completion_tokens_beyond_context", "chat/completions",
     ok_chat(M, max_tokens=None, max_completion_tokens=CTX), 400, "lower max_completion_tokens"),
    # OpenAI requires a tool message's tool_call_id (the call it answers): it was accepted without one
    ("tool_message_without_tool_call_id", "chat/completions",
     ok_chat(M, messages=[{"role": "user", "content": "2+2="}, {"role": "tool", "content": "4"}]), 400,
     "Missing parameter 'tool_call_id'"),
    ("body_too_large", "completions", ok_completion(M, prompt="x" * 100_000), 413, "over the limit"),
    # a lone UTF-16 surrogate (escaped, or raw as UTF-8 bytes: json takes both) is no Unicode text: the
    # tokenizer raised TypeError and the client got a plain-text 500
    ("lone_surrogate_escape", "completions", b'{"model": "{model}", "prompt": "a\\ud800b", "max_tokens": 2}', 400,
     "not valid Unicode"),
    ("lone_surrogate_raw_chat", "chat/completions",
     b'{"model": "{model}", "messages": [{"role": "user", "content": "a\xed\xa0\x80b"}], "max_tokens": 2}', 400,
     "not valid Unicode"),
    # json recurses per nesting level: a RecursionError, answered as a plain-text 500
    ("deeply_nested", "completions", b'{"model": "{model}", "prompt": "hi", "user": ' + b"[" * 20000 + b"]" * 20000 + b"}",
     400, "nested too deeply"),
]


def _send(server, path: str, body):
    url = f"{server.base_url}/{path}"
    if isinstance(body, bytes):
        raw = body.replace(b"{model}", server.model_name.encode())
    else:
        raw = json.dumps(body).replace("{model}", server.model_name).encode()
    return httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("name,path,body,status,words", CASES, ids=[c[0] for c in CASES])
def test_invalid_http_request(server, name, path, body, status, words):
    r = _send(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err["message"]
    assert err["type"] in ("invalid_request_error", "not_found_error")


@pytest.mark.parametrize("tool", [{"role": "tool", "content": "4"},
                                  {"role": "tool", "content": "4", "tool_call_id": None}])
def test_tool_message_without_tool_call_id_names_the_parameter(server, tool):
    """A `tool` message answers a call, named by its `tool_call_id`: OpenAI refuses one without it (or with null),
    naming the message's field in `param`, in its own wording. The server accepted it."""
    messages = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "calc"}, tool]
    r = _send(server, "chat/completions", ok_chat(M, messages=messages))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.[2].tool_call_id" and err["type"] == "invalid_request_error", err
    assert err["message"] == "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'."
    ok = [*messages[:2], {**tool, "tool_call_id": "call_1"}]
    assert _send(server, "chat/completions", ok_chat(M, messages=ok)).status_code == 200


@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_tool_call_id_on_another_role_names_the_parameter(server, role):
    """`tool_call_id` belongs to a `tool` message only; on another role the 400 came back with param null, so a
    client could not tell which message of a long history was wrong."""
    messages = [{"role": "user", "content": "2+2="}, {"role": role, "content": "4", "tool_call_id": "call_1"}]
    r = _send(server, "chat/completions", ok_chat(M, messages=messages))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.[1].tool_call_id" and err["type"] == "invalid_request_error", err
    assert err["message"] == "messages[1]: tool_call_id is only for role 'tool'", err


def test_int64_extreme_seeds_are_accepted(server):
    """The seed check refuses only what int64 cannot hold: its two ends still generate."""
    for seed in (2**63 - 1, -(2**63)):
        r = _send(server, "completions", ok_completion(M, seed=seed, temperature=1.0))
        assert r.status_code == 200, r.text


def test_unknown_route_and_method(server):
    root = server.base_url.removesuffix("/v1")
    r = httpx.get(f"{root}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{server.base_url}/completions")
    assert r.status_code == 405 and "error" in r.json()


@pytest.mark.parametrize("name, param", [("too_many_stops", "stop"), ("stop_token_id_out_of_vocab", "stop_token_ids"),
                                         ("stop_token_id_negative", "stop_token_ids"),
                                         ("max_completion_tokens_zero", "max_completion_tokens"),
                                         ("max_completion_tokens_beyond_context", "max_completion_tokens")])
def test_the_error_names_the_parameter_as_the_request_gave_it(server, name, param):
    (path, body) = next((c[1], c[2]) for c in CASES if c[0] == name)
    assert _send(server, path, body).json()["error"]["param"] == param


def test_invalid_grpc_requests(server):
    client = RolloutClient(server.grpc_address, timeout_s=30)
    bad = [
        (["1+2="], 0, rollout_pb2.SamplingParams(temperature=-1.0), "temperature"),
        (["1+2="], 1000, rollout_pb2.SamplingParams(max_tokens=4), "n must be"),
        ([""], 1, rollout_pb2.SamplingParams(max_tokens=4), "empty"),
        (["1+2="], 1, rollout_pb2.SamplingParams(max_tokens=CTX), "context length"),
        ([list(range(10, 10 + CTX))], 1, rollout_pb2.SamplingParams(max_tokens=1), "context length"),
        ([], 1, rollout_pb2.SamplingParams(max_tokens=4), "no prompts"),
        (["1"], 1, rollout_pb2.SamplingParams(max_tokens=-2), "max_tokens"),
        (["1"], 1, rollout_pb2.SamplingParams(max_tokens=4, temperature=1e-40), "temperature"),
        (["1"], 1, rollout_pb2.SamplingParams(max_tokens=4, stop_token_ids=[10**9]), "stop_token_ids"),
    ]
    for prompts, n, params, words in bad:
        with pytest.raises(grpc.RpcError) as e:
            list(client.batch_generate(prompts, n=n, params=params))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in e.value.details()
    client.close()


def test_server_still_serves_after_invalid_requests(server):
    for name, path, body, _, _ in CASES:  # hammer it once more with every bad request
        _send(server, path, body)
    r = _send(server, "completions", ok_completion(server.model_name, max_tokens=5, temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    r = _send(server, "chat/completions", ok_chat(server.model_name, stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert all(s.alive for s in server.call(server.server.pool.snapshot()))


def test_chat_template_error_is_a_400(tmp_path):
    """A chat template that refuses the conversation (`raise_exception`, as many models' templates do for a
    system message not first or roles that do not alternate) is the client's error: a 400 in the OpenAI format,
    not a plain-text 500."""
    model = tiny_checkpoint(tmp_path / "model")
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{%- for m in messages %}{%- if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    cfg_path.write_text(json.dumps(cfg))
    with ServerThread(model, replicas=1) as s:
        bad = {"model": s.model_name, "max_tokens": 2,
               "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}
        r = httpx.post(f"{s.base_url}/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "System message must be first" in err["message"] and err["param"] == "messages"
        ok = {**bad, "messages": bad["messages"][::-1]}
        assert httpx.post(f"{s.base_url}/chat/completions", json=ok, timeout=30).status_code == 200


def test_an_unforeseen_server_error_is_a_500_in_the_error_shape(tmp_path):
    """A checkpoint whose chat template fails with something other than a template error (here a division by
    zero) is no fault of the client's: a 500, but in the OpenAI error shape (an SDK parses it), not plain text;
    the server goes on serving."""
    model = tiny_checkpoint(tmp_path / "model")
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ("{%- for m in messages %}{%- if m['role'] == 'system' %}{{ 1 / 0 }}{%- endif %}"
                            "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    cfg_path.write_text(json.dumps(cfg))
    with ServerThread(model, replicas=1) as s:
        bad = {"model": s.model_name, "max_tokens": 2, "messages": [{"role": "system", "content": "b"}]}
        r = httpx.post(f"{s.base_url}/chat/completions", json=bad, timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error" and "ZeroDivisionError" in err["message"]
        ok = {**bad, "messages": [{"role": "user", "content": "a"}]}
        assert httpx.post(f"{s.base_url}/chat/completions", json=ok, timeout=30).status_code == 200


def test_the_context_and_vocabulary_bounds_are_exact(server):
    """The bounds are exact, over HTTP and gRPC alike: a prompt plus max_tokens of exactly the context is served, a
    prompt of the whole context (no room for a token) is refused as over it, and the id equal to the vocabulary
    size is outside it (the ids are 0 .. vocab - 1), as a prompt's or a stop id. n may be max_n itself (16 here),
    not more; id 0 is in the vocabulary. A gRPC request without max_tokens generates up to the context."""
    vocab = server.server.pool.info.vocab_size
    fits = list(range(10, 10 + CTX - 3))
    r = _send(server, "completions", ok_completion(M, prompt=fits, max_tokens=3, temperature=0, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = _send(server, "completions", ok_completion(M, n=16, max_tokens=1))
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text
    r = _send(server, "completions", ok_completion(M, n=17, max_tokens=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    full = list(range(10, 10 + CTX))
    for body in (ok_completion(M, prompt=full, max_tokens=None), ok_completion(M, prompt=[1, 2, vocab])):
        r = _send(server, "completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        if body["prompt"] is full:
            assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["message"] == f"prompt has token ids outside the vocabulary [0, {vocab})"
    r = _send(server, "completions", ok_completion(M, stop_token_ids=[vocab - 1, vocab]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    client = RolloutClient(server.grpc_address, timeout_s=30)
    (c,) = client.batch_generate([fits], params=rollout_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(c.token_ids) == 3
    (c,) = client.batch_generate([fits], params=rollout_pb2.SamplingParams(ignore_eos=True))  # max_tokens unset (0):
    assert len(c.token_ids) == 3 and c.finish_reason == rollout_pb2.FINISH_REASON_LENGTH  # up to the context
    # n = max_n over gRPC too, on a prompt of the vocabulary's first and last ids (id 0 is a token like any other)
    outs = list(client.batch_generate([[0, vocab - 1]], n=16, params=rollout_pb2.SamplingParams(max_tokens=1)))
    assert sorted(c.sample_index for c in outs) == list(range(16))
    with pytest.raises(grpc.RpcError) as e:
        list(client.batch_generate([[0, 1]], n=17, params=rollout_pb2.SamplingParams(max_tokens=1)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "between 1 and 16, got 17" in e.value.details()
    for prompt, stop, words in ((full, [], f"has {CTX} tokens; the context length is {CTX}"),
                                ([1, 2, vocab], [], "vocabulary"), ([1, 2], [vocab], "stop_token_ids")):
        with pytest.raises(grpc.RpcError) as e:
            list(client.batch_generate([prompt], params=rollout_pb2.SamplingParams(stop_token_ids=stop)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    client.close()


def test_a_batch_of_max_prompts_per_batch_prompts_is_served_and_one_more_refused(server):
    """`max_prompts_per_batch` (4 here) bounds a request's prompts over HTTP (a list prompt) and gRPC alike: that
    many are served, one more is a 400 naming `prompt` / INVALID_ARGUMENT, before anything is generated."""
    r = _send(server, "completions", ok_completion(M, prompt=["1+2="] * 4, max_tokens=1))
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    r = _send(server, "completions", ok_completion(M, prompt=[[5, 6]] * 5, max_tokens=1))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "5 prompts is over the limit of 4" in r.json()["error"]["message"]
    client = RolloutClient(server.grpc_address, timeout_s=30)
    assert len(list(client.batch_generate(["1+2="] * 4, params=rollout_pb2.SamplingParams(max_tokens=1)))) == 4
    with pytest.raises(grpc.RpcError) as e:
        list(client.batch_generate(["1+2="] * 5, params=rollout_pb2.SamplingParams(max_tokens=1)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5 prompts is over the limit of 4" in e.value.details()
    client.close()


def test_a_body_of_max_request_bytes_is_read_and_one_byte_more_is_a_413(server):
    """`max_request_bytes` (64 KiB here) is the largest body taken: a request of exactly that size (white space
    pads the JSON) is served, one byte more is a 413 before it is parsed."""
    raw = json.dumps(ok_completion(server.model_name, max_tokens=1)).encode()
    for size, status in ((64 * 1024, 200), (64 * 1024 + 1, 413)):
        body = raw + b" " * (size - len(raw))
        r = httpx.post(f"{server.base_url}/completions", content=body, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == status, (size, r.text)
    assert r.json()["error"]["code"] == "too_large"


def test_a_request_with_several_schema_errors_names_the_first_in_param(server):
    """Every problem is in the message (up to five), and `param` names the first of them, in the request model's
    field order, as a client fixing its request reads them top down."""
    r = _send(server, "completions", ok_completion(M, temperature="hot", top_p="x", n="two"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "temperature", err
    assert all(f in err["message"] for f in ("temperature", "top_p", "n")), err


def test_a_request_the_engine_refuses_leaves_nothing_counted_on_its_replica(server):
    """The fronts check what they can before a request reaches a replica, but an engine may still refuse one (the
    SGLang backend: a prompt + max_tokens that leaves no room for its reserved draft slots, or a KV cache still
    released): its caller gets InvalidRequestError and the replica's count drops by every sequence of it. Before,
    nothing checked the count after a refusal of n > 1; a pool that dropped one of the n kept n - 1 outstanding for
    ever (admission then refused requests that would fit, load balancing steered away from an idle replica). Here
    the native engine refuses a prompt id outside its vocabulary, sent to the real pool past the fronts' checks."""
    from tlt.services.rollout.errors import InvalidRequestError
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    pool = server.server.pool

    async def refused() -> str:
        req = GenerationRequest("refused-n3", (10**6,), SamplingParams(max_tokens=4), n=3)
        with pytest.raises(InvalidRequestError) as err:
            async for _ in pool.generate(req):
                pass
        return str(err.value)

    assert "prompt token ids" in server.call(refused())
    assert [r.outstanding for r in pool.replicas] == [0] * len(pool.replicas) and pool.pending_sequences == 0


def test_a_request_the_engine_refuses_mid_call_is_invalid_argument_over_grpc(server, monkeypatch):
    """A request past the fronts' checks that the engine refuses (InvalidRequestError: the SGLang backend's reserved
    draft slots, a KV cache still released) is the client's error on both generation RPCs: INVALID_ARGUMENT with
    the engine's reason (over HTTP a 400); as UNKNOWN, INTERNAL or a 500 a client would take it for a broken server.
    (The pool's copy of the vocabulary size is raised by 10, for this test only, so that the fronts let an id the
    engine does not have through: no real request gets past them otherwise.)"""
    import dataclasses

    pool = server.server.pool
    vocab = pool.info.vocab_size
    monkeypatch.setattr(pool, "_info", dataclasses.replace(pool.info, vocab_size=vocab + 10))
    with RolloutClient(server.grpc_address, timeout_s=30) as client:
        calls = (lambda: list(client.batch_generate([[1, 2], [1, vocab]], params=rollout_pb2.SamplingParams(
                     max_tokens=2))),
                 lambda: client.generate([1, vocab], n=2, params=rollout_pb2.SamplingParams(max_tokens=2)))
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert "prompt token ids" in e.value.details(), e.value.details()
        r = _send(server, "completions", ok_completion(server.model_name, prompt=[1, vocab], max_tokens=2))
        assert r.status_code == 400 and "prompt token ids" in r.json()["error"]["message"], r.text  # HTTP: a 400
        monkeypatch.undo()
        assert len(client.generate([1, vocab - 1], n=2, params=rollout_pb2.SamplingParams(max_tokens=2))) == 2
