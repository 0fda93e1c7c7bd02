"""The trainer's gRPC traffic on /metrics, `param` of every refusal of an unsupported field, and `tool_choice`
without `tools`.

1. rollout_prompt_tokens_total and rollout_generated_tokens_total counted HTTP requests only: the RL trainer's whole
   rollout (gRPC BatchGenerate) was invisible. gRPC calls now add to them (each prompt once whatever n, as OpenAI's
   usage.prompt_tokens; generated tokens are counted at the pool from every engine step, so a cancelled
   BatchGenerate counts what its unfinished samples had generated too), and every call counts in
   rollout_grpc_requests_total{method, code}.
2. Refusals of fields the server does not honour (penalties, logit_bias, echo, suffix, best_of, a message's audio,
   refusal, annotations) came with `"param": null`; they name the field, as the OpenAI API does.
3. `tool_choice` with no `tools` was accepted; the OpenAI API refuses it (400, param `tool_choice`).

Real parts: the rollout server (uvicorn and grpc.aio on free 127.0.0.1 ports), one replica process running the
native engine on a tiny random Qwen2 checkpoint with the task tokenizer, `RolloutClient` (real gRPC), httpx and the
official `openai` client. Nothing is faked.
"""

from __future__ import annotations

import re
import time

import grpc
import httpx
import openai
import pytest

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2

PROMPT = "rollout_prompt_tokens_total"
GENERATED = "rollout_generated_tokens_total"
CALLS = "rollout_grpc_requests_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(tiny_checkpoint(tmp_path_factory.mktemp("rollout_metrics_params_model")), replicas=1,
                      max_n=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(server):
    with RolloutClient(server.grpc_address, timeout_s=60) as c:
        yield c


def scrape(server) -> dict[tuple, float]:
    """/metrics as {(name, (label, value), ...): value}, labels sorted."""
    out = {}
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics", timeout=30).text
    for m in re.finditer(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$", text, re.M):
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m[2] or "")))
        out[(m[1], *labels)] = float(m[3])
    return out


def grew(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, *sorted(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_batch_generate_counts_its_tokens_and_the_call(server, grpc_client):
    """A BatchGenerate of 3 prompts x 3 and a Generate of 1 prompt x 2: the prompt counter grows by each prompt's
    length once (not once per sample), the generated counter by every completion's length, and each call counts
    once under its method with code OK. A refused call, of either method, counts under its code, and once in
    rejected_total."""
    prompts = ["1+2=", "12+7=", [5, 6, 7, 8, 9, 10, 11]]
    params = rollout_pb2.SamplingParams(temperature=1.0, seed=7, max_tokens=12)
    before = scrape(server)
    outs = list(grpc_client.batch_generate(prompts, n=3, params=params))
    single = grpc_client.generate("3+4=", n=2, params=params)
    assert len(outs) == 9 and len(single) == 2
    per_prompt = {o.prompt_index: len(o.prompt_token_ids) for o in outs}
    assert sorted(per_prompt) == [0, 1, 2] and per_prompt[2] == 7
    with pytest.raises(grpc.RpcError) as e:
        grpc_client.generate("3+4=", n=9, params=params)  # over max_n
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:  # the trainer's streaming call alike
        list(grpc_client.batch_generate(["3+4="], n=9, params=params))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(server)
    assert grew(before, after, PROMPT) == sum(per_prompt.values()) + len(single[0].prompt_token_ids)
    assert grew(before, after, GENERATED) == sum(len(o.token_ids) for o in [*outs, *single]) > 0
    assert grew(before, after, CALLS, method="BatchGenerate", code="OK") == 1
    assert grew(before, after, CALLS, method="Generate", code="OK") == 1
    assert grew(before, after, CALLS, method="Generate", code="INVALID_ARGUMENT") == 1
    assert grew(before, after, CALLS, method="BatchGenerate", code="INVALID_ARGUMENT") == 1
    assert grew(before, after, "rollout_rejected_total", reason="invalid_request") == 2


def test_a_cancelled_batch_generate_counts_what_it_generated(server, grpc_client):
    """Seeded sampling is reproducible: a first run picks a stop token that ends sample 0 after a few tokens and
    never comes in sample 1; the caller cancels the second run once sample 0 has arrived. The generated counter
    grows by what the engine generated: sample 0's tokens and the one token of sample 1 each engine step of the
    call but its first decoded until its abort reached the engine (only sample 0's were counted before; sample 1
    starts a step after sample 0, copying the K/V of the prompt's partial last block from it: BlockManager); the
    call counts as CANCELLED."""
    prompt, max_tokens = [100, 200, 30], 230
    params = rollout_pb2.SamplingParams(temperature=1.0, seed=21, max_tokens=max_tokens, ignore_eos=True)
    first, other = (list(c.token_ids) for c in grpc_client.generate(prompt, n=2, params=params))
    end = next(j for j in range(2, 12) if first[j] not in first[:j] and first[j] not in other)
    params.stop_token_ids.append(first[end])
    pool = server.server.pool
    steps = server.call(pool.snapshot())[0].stats.steps
    before = scrape(server)
    call = grpc_client.batch_generate([prompt], n=2, params=params)
    got = next(call)
    call.cancel()
    assert got.sample_index == 0 and len(got.token_ids) == end + 1
    deadline = time.monotonic() + 10
    while not grew(before, after := scrape(server), CALLS, method="BatchGenerate", code="CANCELLED"):
        assert time.monotonic() < deadline, "the cancelled call was never counted"
        time.sleep(0.05)
    while pool.replicas[0].outstanding:  # until the abort reached the engine: it runs no step of the call any more
        assert time.monotonic() < deadline, "the cancelled call was never aborted"
        time.sleep(0.05)
    ran = server.call(pool.snapshot())[0].stats.steps - steps
    after = scrape(server)
    assert ran >= end + 1
    assert grew(before, after, GENERATED) == end + 1 + ran - 1
    assert grew(before, after, PROMPT) == len(prompt)
    assert grew(before, after, CALLS, method="BatchGenerate", code="OK") == 0


def test_a_batch_generate_past_its_deadline_counts_as_deadline_exceeded_and_stops_generating(server, grpc_client):
    """A trainer's call that outlives its deadline is not one its client cancelled: it counts under
    code="DEADLINE_EXCEEDED" (counted as CANCELLED, an operator looking for calls timing out found none), and its
    sequences are aborted at the engine, not decoded to max_tokens for nobody."""
    params = rollout_pb2.SamplingParams(temperature=1.0, seed=5, max_tokens=240, ignore_eos=True)
    req = rollout_pb2.BatchGenerateRequest(n=4, params=params, prompts=[rollout_pb2.Prompt(text="1+2=")])
    pool = server.server.pool
    before = scrape(server)
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_client.stub.BatchGenerate(req, timeout=0.3))  # 4 x 240 tokens take seconds here
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while not grew(before, after := scrape(server), CALLS, method="BatchGenerate", code="DEADLINE_EXCEEDED"):
        assert time.monotonic() < deadline, "the call was never counted as DEADLINE_EXCEEDED"
        time.sleep(0.05)
    while pool.replicas[0].outstanding:  # until the abort reached the engine
        assert time.monotonic() < deadline, "the expired call's sequences were never aborted"
        time.sleep(0.05)
    after = scrape(server)
    assert grew(before, after, CALLS, method="BatchGenerate", code="CANCELLED") == 0
    assert grew(before, after, CALLS, method="BatchGenerate", code="OK") == 0
    assert grew(before, after, GENERATED) < 4 * 240  # aborted, not decoded to the end


def test_a_call_that_fails_inside_the_server_counts_as_unknown(server, grpc_client, monkeypatch):
    """An exception no handler maps (a bug, a replica's pipe broken mid-query) reaches the client as UNKNOWN and
    counts under code="UNKNOWN"; counted as OK, a failing server looked healthy on its dashboards. (The real pool's
    snapshot is replaced by one that raises, for this one call: no request makes the real server fail so.)"""
    async def broken():
        raise RuntimeError("the replica's pipe broke")

    before = scrape(server)
    monkeypatch.setattr(server.server.pool, "snapshot", broken)
    with pytest.raises(grpc.RpcError) as e:
        grpc_client.status()
    monkeypatch.undo()
    assert e.value.code() == grpc.StatusCode.UNKNOWN
    after = scrape(server)
    assert grew(before, after, CALLS, method="GetStatus", code="UNKNOWN") == 1
    assert grew(before, after, CALLS, method="GetStatus", code="OK") == 0

def test_the_counters_help_says_what_they_count(server):
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics", timeout=30).text
    assert re.search(rf"^# HELP {PROMPT} .*HTTP and gRPC.*each prompt once whatever n", text, re.M)
    assert re.search(rf"^# HELP {GENERATED} .*HTTP and gRPC.*at each engine step.*re-dispatched", text, re.M)


USER = {"role": "user", "content": "1+2="}
ASSISTANT = {"role": "assistant", "content": "3"}


@pytest.mark.parametrize("api, fields, param", [
    ("completions", {"presence_penalty": 1.0}, "presence_penalty"),
    ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("completions", {"logit_bias": {"5": 3.0}}, "logit_bias"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "!"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("chat", {"presence_penalty": -1.0}, "presence_penalty"),
    ("chat", {"frequency_penalty": 1.5}, "frequency_penalty"),
    ("chat", {"logit_bias": {"7": -100}}, "logit_bias"),
    ("chat", {"messages": [USER, {**ASSISTANT, "audio": {"id": "audio_1"}}, USER]}, "messages.[1].audio"),
    ("chat", {"messages": [USER, {**ASSISTANT, "refusal": "no"}, USER]}, "messages.[1].refusal"),
    ("chat", {"messages": [USER, USER, {**ASSISTANT, "annotations": [{"type": "url_citation"}]}]},
     "messages.[2].annotations"),
])
def test_an_unsupported_field_is_named_in_param(client, server, api, fields, param):
    """The SDK's BadRequestError.param names the field (it was None); the message keeps its wording."""
    with pytest.raises(openai.BadRequestError) as e:
        if api == "completions":
            client.completions.create(model=server.model_name, prompt="1+2=", max_tokens=2, **fields)
        else:
            client.chat.completions.create(model=server.model_name, max_tokens=2, **{"messages": [USER], **fields})
    assert e.value.param == param, e.value.body
    assert "is not supported" in e.value.message or "are not supported" in e.value.message, e.value.message
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra", [{"tool_choice": "auto"}, {"tool_choice": "none"},
                                   {"tool_choice": "auto", "tools": []}, {"tool_choice": "required"}])
def test_tool_choice_without_tools_is_refused_as_openai_does(client, server, extra):
    """Accepted before (a plain chat, the choice ignored); the OpenAI API answers 400 with this message and param."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_name, messages=[USER], max_tokens=2, **extra)
    assert e.value.param == "tool_choice", e.value.body
    assert e.value.body["message"] == ("Invalid value for 'tool_choice': 'tool_choice' is only allowed when "
                                       "'tools' are specified.")
    # the same chat without the choice is served
    r = client.chat.completions.create(model=server.model_name, messages=[USER], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
