"""Hostile input against a real rollout server: fuzzed OpenAI requests, raw gRPC garbage, bad weight pushes.

One real `RolloutServer` on 127.0.0.1 (a real replica process with the native
engine, real uvicorn, real grpc.aio; nothing faked) takes:

- HTTP: hypothesis-generated request bodies, schema-driven: well-formed ones
  with edge values (temperature 0 / 1e-6, top_p and min_p 0 / 1e-9 / 1, huge
  top_k, seeds up to 2^63-1, stops, n, streaming) and junk ones (the OpenAI
  request models' field names with values of every JSON type, extremes,
  NaN/Infinity, unknown keys), random bytes, bodies over the size limit, prompts far beyond
  the context. Every answer is 200 or a 4xx in OpenAI's error format — never
  a 5xx — and the server serves the same greedy text afterwards.
- gRPC: random bytes sent through a raw channel (no serializer) to every
  Rollout method; answers are a deliberate status (grpc.aio itself answers an
  undecodable message with UNKNOWN "DecodeError ..."; any other UNKNOWN would be
  an unhandled error in a handler and fails the test), and the server keeps serving.
- UpdateWeights: corrupted, truncated, wrong-shape, wrong-dtype, bad-checksum,
  unknown-name, oversized, out-of-folder shm path, out-of-order streams.
  Each answers ok=false with a reason, versions stay unchanged, generation is
  unchanged, and rollout_rejected_total{reason} counts them.
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.common.weights import iter_chunks, pack_state_dict
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import common_pb2, rollout_pb2

GREEDY = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=8)
PROBE = "3+4="
MAX_WEIGHT_BYTES = 8 << 20  # the tiny model is ~1 MB; a bigger push is refused before it is read on


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("hostile-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(model_dir, max_weight_bytes=MAX_WEIGHT_BYTES, max_request_bytes=64 << 10) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with RolloutClient(server.grpc_address, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(client):
    """Greedy tokens before any hostile input; every test checks they are unchanged after."""
    return list(client.generate(PROBE, params=GREEDY)[0].token_ids)


def rejected_by_reason(server) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{server.server.http_port}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^rollout_rejected_total\{reason="([^"]*)"\} ([0-9.e+]+)$', text, re.M)}


def rejected(server, reason: str) -> float:
    return rejected_by_reason(server).get(reason, 0.0)


def still_same(server, client, baseline) -> None:
    assert httpx.get(f"http://127.0.0.1:{server.server.http_port}/health", timeout=30).status_code == 200
    assert list(client.generate(PROBE, params=GREEDY)[0].token_ids) == baseline


# ---- HTTP ---------------------------------------------------------------------------------------

_ints = st.integers(-3, 4) | st.sampled_from([0, 255, 256, 10**6, -(2**63), 2**63, 10**30])
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1.0, -1.0, 1e308])
_text = st.text(max_size=40) | st.sampled_from(["", "\x00", "\ud7ff\ufffd", "1+1=", "<|im_start|>"])
_scalar = st.none() | st.booleans() | _ints | _floats | _text
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=8)
_token_lists = st.lists(_ints, max_size=6) | st.lists(st.lists(_ints, max_size=4), max_size=3)
_COMMON = ["temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "presence_penalty",
           "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "ignore_eos", "stop_token_ids"]


def _bodies(model: str, kind: str) -> st.SearchStrategy[dict]:
    fields = _COMMON + (["prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix"] if kind == "completions"
                        else ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                              "response_format", "tools", "tool_choice"])
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bogus"])},
                                    optional={"content": _text | _json, "name": _text, "extra": _json})
    special = {"prompt": _text | _token_lists | _json, "messages": st.lists(message, max_size=3) | _json,
               "model": st.just(model) | _text}
    value_for = {f: special.get(f, _json) for f in fields}
    junk = st.fixed_dictionaries({"model": special["model"]}, optional={**value_for, "unknown_field": _json})
    # well-formed bodies with edge values (sampling corners, stops, seeds): these reach the engine
    unit = st.sampled_from([0.0, 1e-9, 0.5, 1.0])
    sane = {"temperature": st.sampled_from([0.0, 1e-6, 0.7, 2.0]), "top_p": unit, "min_p": unit,
            "top_k": st.sampled_from([0, 1, 5, 10**6]), "n": st.integers(1, 3), "max_tokens": st.integers(1, 16),
            "stream": st.booleans(), "seed": st.integers(0, 2**63 - 1), "ignore_eos": st.booleans(),
            "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "stop_token_ids": st.lists(
                st.integers(0, 50), max_size=3)}
    if kind == "completions":
        sane.update(logprobs=st.integers(0, 5), echo=st.booleans())
        first = {"model": st.just(model), "prompt": st.text(min_size=1, max_size=30) | st.lists(
            st.integers(1, 100), min_size=1, max_size=8)}
    else:
        sane.update(logprobs=st.booleans(), top_logprobs=st.integers(0, 5))
        first = {"model": st.just(model), "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}),
            min_size=1, max_size=3)}
    return st.fixed_dictionaries(first, optional=sane) | junk


def _check_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.json()["choices"] is not None
    else:
        assert r.status_code in (400, 404, 413), r.status_code
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"]


@pytest.mark.parametrize("kind", ["completions", "chat/completions"])
def test_fuzzed_openai_requests_get_200_or_a_clean_4xx(server, client, baseline, kind):
    url = f"{server.base_url}/{kind}"
    seen: dict[int, int] = {}
    with httpx.Client(timeout=120) as http:

        @settings(max_examples=60, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(body=_bodies(server.model_name, kind.split("/")[0]))
        def one(body: dict) -> None:
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
                body["max_tokens"] = 64  # bounded work per example; oversize is covered below
            raw = json.dumps(body, allow_nan=True)  # NaN / Infinity literals on purpose
            r = http.post(url, content=raw, headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            _check_answer(r)

        one()
    assert seen.get(400, 0) > 0 and seen.get(200, 0) > 0  # it reached both the validation and the engine
    print(f"fuzz /v1/{kind}: HTTP statuses {dict(sorted(seen.items()))}")
    still_same(server, client, baseline)


def test_garbage_oversized_and_overlong_http_bodies(server, client, baseline):
    base = server.base_url
    model = server.model_name
    cases = [
        (b"\xff\xfe\x00garbage", 400), (b"", 400), (b"[1,2,3]", 400), (b'{"model": ', 400),
        (b"x" * (65 << 10), 413),  # over max_request_bytes
        (json.dumps({"model": model, "prompt": "1+" * 20000}).encode(), 400),  # far beyond the context
        (json.dumps({"model": model, "prompt": list(range(5000))}).encode(), 400),
        (json.dumps({"model": model, "prompt": [10**9]}).encode(), 400),  # outside the vocabulary
        (json.dumps({"model": model, "prompt": "1+1=", "max_tokens": 10**6}).encode(), 400),
        (json.dumps({"model": model, "prompt": "1+1=", "n": 10**4}).encode(), 400),
        (json.dumps({"model": model, "messages": [{"role": "user", "content": "9" * 30000}]}).encode(), 400),
    ]
    before = sum(rejected_by_reason(server).values())
    for body, status in cases:
        path = "chat/completions" if b"messages" in body else "completions"
        r = httpx.post(f"{base}/{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (body[:80], r.status_code, r.text[:300])
        assert r.json()["error"]["message"]
    after = rejected_by_reason(server)
    assert sum(after.values()) - before == len(cases), after
    still_same(server, client, baseline)


# ---- raw gRPC -------------------------------------------------------------------------------------

_METHODS = {"Generate": "unary_unary", "GetStatus": "unary_unary", "BatchGenerate": "unary_stream",
            "UpdateWeights": "stream_unary", "GetWeights": "unary_stream"}


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(min_size=1, max_size=2048), method=st.sampled_from(sorted(_METHODS)))
def _garbage_round(channel: grpc.Channel, token: str, codes: dict, payload: bytes, method: str) -> None:
    kind = _METHODS[method]
    call = getattr(channel, kind)(f"/tlt.v1.Rollout/{method}", request_serializer=None, response_deserializer=None)
    md = (("authorization", f"Bearer {token}"),)
    try:
        if kind == "unary_unary":
            call(payload, timeout=60, metadata=md)
        elif kind == "unary_stream":
            for _ in call(payload, timeout=60, metadata=md):
                pass
        else:
            call(iter([payload, payload[::-1]]), timeout=60, metadata=md)
        codes["OK"] = codes.get("OK", 0) + 1  # random bytes can be a valid message (protobuf is lenient)
    except grpc.RpcError as e:
        codes[e.code().name] = codes.get(e.code().name, 0) + 1
        if e.code() == grpc.StatusCode.UNKNOWN:  # grpc.aio answers an undecodable message so, before our code runs
            assert "DecodeError" in (e.details() or ""), e.details()  # anything else: an unhandled handler error
        assert e.code() != grpc.StatusCode.UNAVAILABLE, e.details()


def test_raw_grpc_garbage_on_every_method(server, client, baseline):
    import os

    codes: dict[str, int] = {}
    with grpc.insecure_channel(server.grpc_address) as channel:
        _garbage_round(channel, os.environ["TLT_AUTH_TOKEN"], codes)
    assert sum(v for k, v in codes.items() if k != "OK") > 0, codes
    print(f"raw gRPC garbage: {dict(sorted(codes.items()))}")
    still_same(server, client, baseline)


# ---- weight pushes ---------------------------------------------------------------------------------


def _policy(model_dir) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(model_dir / "model.safetensors"))


def test_bad_weight_pushes_are_refused_whole(server, client, baseline, model_dir, tmp_path):
    weights = _policy(model_dir)
    versions = client.status().versions
    v = versions.policy + 1
    good_m, good_p = pack_state_dict(weights, common_pb2.WEIGHT_KIND_POLICY, v)

    def chunks(m, p, size=1 << 18):
        return list(iter_chunks(m, p, size))

    flipped = bytearray(good_p)
    flipped[len(flipped) // 2] ^= 0xFF
    bad_sum = type(good_m)()
    bad_sum.CopyFrom(good_m)
    bad_sum.sha256 = "0" * 64
    shapes = {**weights, "lm_head.weight": weights["lm_head.weight"][:-1]}
    dtypes = {**weights, "lm_head.weight": weights["lm_head.weight"].to(torch.float16)}
    unknown = {**weights, "model.layers.99.mlp.up_proj.weight": torch.zeros(4, 4)}
    big = {"lm_head.weight": torch.zeros(MAX_WEIGHT_BYTES // 4 + 1024)}
    no_kind = type(good_m)()
    no_kind.CopyFrom(good_m)
    no_kind.kind = common_pb2.WEIGHT_KIND_UNSPECIFIED
    shm = type(good_m)()
    shm.CopyFrom(good_m)
    shm.shm_path = "/etc/passwd"
    cases = {
        "corrupted": chunks(good_m, flipped),
        "truncated": chunks(good_m, good_p)[:-1],
        "bad_checksum": chunks(bad_sum, good_p),
        "wrong_shape": chunks(*pack_state_dict(shapes, common_pb2.WEIGHT_KIND_POLICY, v)),
        "wrong_dtype": chunks(*pack_state_dict(dtypes, common_pb2.WEIGHT_KIND_POLICY, v)),
        "unknown_name": chunks(*pack_state_dict(unknown, common_pb2.WEIGHT_KIND_POLICY, v)),
        "oversized": chunks(*pack_state_dict(big, common_pb2.WEIGHT_KIND_POLICY, v), 1 << 20),
        "shm_outside": [rollout_pb2.WeightChunk(manifest=shm)],
        "data_first": [rollout_pb2.WeightChunk(data=b"x")] + chunks(good_m, good_p),
        "two_manifests": [rollout_pb2.WeightChunk(manifest=good_m)] + chunks(good_m, good_p),
        "empty_stream": [],
        "no_kind": chunks(no_kind, good_p),
        # a small manifest, then more data than max_weight_bytes: refused once past it, not buffered to the end
        "overlong": chunks(good_m, good_p) + [rollout_pb2.WeightChunk(data=bytes(1 << 20))] * (MAX_WEIGHT_BYTES >> 20),
        "drafter_into_policy_names": chunks(*pack_state_dict(weights, common_pb2.WEIGHT_KIND_DRAFTER, v)),
    }
    before = sum(rejected(server, r) for r in ("weights_invalid", "weights_too_large", "weights_rejected"))
    answers = {}
    for name, stream in cases.items():
        resp = client.push_chunks(iter(stream))
        answers[name] = resp.error
        assert not resp.ok, name
        assert resp.error, name
        now = client.status().versions
        assert (now.policy, now.drafter) == (versions.policy, versions.drafter), name
    after = sum(rejected(server, r) for r in ("weights_invalid", "weights_too_large", "weights_rejected"))
    assert after - before == len(cases), answers
    assert answers["no_kind"] == "manifest kind must be POLICY or DRAFTER", answers  # its reason, not a later one
    assert answers["overlong"] == f"weight stream is over max_weight_bytes={MAX_WEIGHT_BYTES}", answers
    still_same(server, client, baseline)
    assert client.update_weights(weights, "policy", v).ok  # the same stream, intact, is applied
    assert client.status().versions.policy == v
    still_same(server, client, baseline)
