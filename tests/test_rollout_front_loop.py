"""The rollout front's one event loop stays free, and what it cannot serve is refused before a stream starts.

The front's loop serves every HTTP stream, /health and the trainer's gRPC calls. An audit found it frozen for
16-18 s by four 1 MB text prompts over HTTP (tokenised on the loop, then refused for their length), for 7 s by
building one response of n=64 x 300 tokens with 20 top logprobs, and for 50 s by 2,000 prompts x 200,000
stop_token_ids (checked once a prompt); a 12 MB gRPC text prompt took the front to 4.3 GB before its length was
checked. A streamed request that could not fit the KV cache got 200 and an error event; a request sent while the
only replica restarted got a 503 the SDK's retries gave up on in 1 s.

Real parts: the rollout server on 127.0.0.1 (native engine, one replica process, real HTTP and gRPC), the model's
real tokenizer, wrapped to record which thread calls it and what it is given.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx
import pytest
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2, rollout_pb2_grpc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("front-loop-model"))


class _Recorder:
    """Wraps the front's tokenizer: (method, thread name, length of the text given) of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def install(self, monkeypatch) -> None:
        import tlt.services.rollout.server as server

        original = server._front_tokenizer

        def front_tokenizer(model_dir):
            tok = original(model_dir)
            for name in ("encode", "apply_chat_template", "decode", "convert_ids_to_tokens"):
                method = getattr(tok, name)

                def wrapped(*args, _m=method, _n=name, **kw):
                    first = args[0] if args else None
                    size = len(first) if isinstance(first, str) else 0
                    self.calls.append((_n, threading.current_thread().name, size))
                    return _m(*args, **kw)

                setattr(tok, name, wrapped)
            return tok

        monkeypatch.setattr(server, "_front_tokenizer", front_tokenizer)

    def on_loop(self) -> list[tuple[str, str, int]]:
        return [c for c in self.calls if c[1] == "rollout-server"]  # ServerThread's loop thread


def test_prompts_are_tokenised_and_responses_built_off_the_event_loop(model_dir, monkeypatch):
    rec = _Recorder()
    rec.install(monkeypatch)
    with ServerThread(model_dir, replicas=1) as s:
        r = httpx.post(f"{s.base_url}/completions", timeout=60, json={
            "model": s.model_name, "prompt": ["1+2=", "3+4="], "max_tokens": 6, "n": 2, "logprobs": 3})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{s.base_url}/chat/completions", timeout=60, json={
            "model": s.model_name, "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 3})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["content"], r.text
        with RolloutClient(s.grpc_address, timeout_s=60) as c:
            assert c.generate("5+5=", params=rollout_pb2.SamplingParams(max_tokens=4))
    names = {c[0] for c in rec.calls}
    assert {"encode", "apply_chat_template"} <= names, rec.calls  # the recorder saw the work
    assert not rec.on_loop(), rec.on_loop()


def test_a_text_prompt_far_past_the_context_is_refused_without_tokenising_it_whole(model_dir, monkeypatch):
    rec = _Recorder()
    rec.install(monkeypatch)
    text = "12+34=46 and " * 60_000  # 780,000 characters; the context is 256 tokens
    with ServerThread(model_dir, replicas=1) as s:
        r = httpx.post(f"{s.base_url}/completions", timeout=60, json={"model": s.model_name, "prompt": text})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.json()["error"]["param"] == "prompt" and "context length is 256" in r.json()["error"]["message"]
        r = httpx.post(f"{s.base_url}/chat/completions", timeout=60, json={
            "model": s.model_name, "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        with grpc.insecure_channel(s.grpc_address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                rollout_pb2_grpc.RolloutStub(ch).Generate(rollout_pb2.GenerateRequest(
                    prompt=rollout_pb2.Prompt(text=text * 3)), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt 0 has at least" in e.value.details()
        # a prompt that fits is still served whole
        r = httpx.post(f"{s.base_url}/completions", timeout=60, json={"model": s.model_name, "prompt": "1+1=",
                                                                      "max_tokens": 2})
        assert r.status_code == 200, r.text
    longest = max(n for name, _, n in rec.calls if name in ("encode", "apply_chat_template"))
    assert longest < 100_000, longest  # only a probe of the text was tokenised (it was all 780,000 characters)


def test_too_many_stop_token_ids_are_one_400(model_dir):
    with ServerThread(model_dir, replicas=1) as s:
        body = {"model": s.model_name, "prompt": ["1+1="] * 4, "max_tokens": 2}
        r = httpx.post(f"{s.base_url}/completions", timeout=60, json={**body, "stop_token_ids": list(range(1025))})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        assert "at most 1024" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{s.base_url}/completions", timeout=60, json={**body, "stop_token_ids": [10**6]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text
        with RolloutClient(s.grpc_address, timeout_s=60) as c, pytest.raises(grpc.RpcError) as e:
            list(c.batch_generate(["1+1="] * 4, params=rollout_pb2.SamplingParams(max_tokens=2,
                                                                                  stop_token_ids=list(range(2000)))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in e.value.details()
        r = httpx.post(f"{s.base_url}/completions", timeout=60, json={**body, "stop_token_ids": list(range(290))})
        assert r.status_code == 200, r.text


def test_a_request_that_cannot_fit_the_kv_cache_is_a_400_before_its_stream_starts(model_dir):
    with ServerThread(model_dir, replicas=1, engine={"num_kv_blocks": 4}) as s:  # 64 tokens a sequence
        for path, extra in (("completions", {"prompt": "1+2="}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "1+2="}]})):
            for stream in (False, True):
                r = httpx.post(f"{s.base_url}/{path}", timeout=60, json={
                    "model": s.model_name, "max_tokens": 100, "stream": stream, **extra})
                assert r.status_code == 400, (path, stream, r.text)
                err = r.json()["error"]
                assert err["code"] == "kv_cache_exceeded" and err["param"] == "max_tokens", err
                assert "holds 64 tokens a sequence" in err["message"], err
        r = httpx.post(f"{s.base_url}/chat/completions", timeout=60, json={  # no max_tokens: the default's fault
            "model": s.model_name, "messages": [{"role": "user", "content": "1+2="}]})
        assert r.status_code == 400 and "the default max_tokens" in r.json()["error"]["message"], r.text
        with RolloutClient(s.grpc_address, timeout_s=60) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=100))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV cache" in e.value.details()
            assert c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=8))  # one that fits is served
            # the bound is exact: prompt + max_tokens of just the 64 tokens is served, and generates all of them
            (out,) = c.generate([10, 11, 12, 13], params=rollout_pb2.SamplingParams(max_tokens=60, ignore_eos=True))
            assert len(out.token_ids) == 60
        for max_tokens, status in ((60, 200), (61, 400)):
            r = httpx.post(f"{s.base_url}/completions", timeout=60, json={
                "model": s.model_name, "prompt": [10, 11, 12, 13], "max_tokens": max_tokens, "ignore_eos": True})
            assert r.status_code == status, (max_tokens, r.text)


def test_schema_errors_in_nested_fields_name_the_field_as_openai_does(model_dir):
    with ServerThread(model_dir, replicas=1) as s:
        def param(messages):
            r = httpx.post(f"{s.base_url}/chat/completions", timeout=60,
                           json={"model": s.model_name, "messages": messages, "max_tokens": 2})
            assert r.status_code == 400, r.text
            return r.json()["error"]

        err = param([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
        assert err["param"] == "messages.[1].role", err
        err = param([{"role": "user", "content": 5}])
        assert err["param"] == "messages.[0].content", err
        assert ".str" not in err["message"] and "list[" not in err["message"], err  # no pydantic union branches


def test_a_request_sent_while_the_only_replica_restarts_waits_for_it(model_dir):
    with ServerThread(model_dir, replicas=1, max_restarts=1) as s:
        body = {"model": s.model_name, "prompt": "1+2=", "max_tokens": 4, "temperature": 0}
        before = httpx.post(f"{s.base_url}/completions", timeout=60, json=body)
        assert before.status_code == 200, before.text
        os.kill(s.server.replica_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while s.server.pool.replicas[0].alive:  # the front saw it die
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(f"{s.base_url}/completions", timeout=180, json=body)
        assert r.status_code == 200, r.text  # was: 503 "no live engine replica" at once
        assert r.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_an_unexpected_error_inside_the_pool_ends_the_stream_instead_of_hanging_it(model_dir):
    """The streams' pumps passed on only the pool's two refusals: any other error (a bug) left the stream, HTTP
    and gRPC alike, waiting for ever for an end that never came. (The pool's generate is replaced by one that
    fails: a stand-in for a bug, as no real input is known to raise there.)"""
    async def broken(request, want_steps=False):
        raise RuntimeError("boom")
        yield  # an async generator, as ReplicaPool.generate

    with ServerThread(model_dir, replicas=1) as s:
        s.server.pool.generate = broken
        r = httpx.post(f"{s.base_url}/completions", timeout=30, json={
            "model": s.model_name, "prompt": "1+2=", "max_tokens": 4, "stream": True})
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]", r.text
        assert '"code":"internal_error"' in events[-2] and "RuntimeError: boom" in events[-2], r.text
        with RolloutClient(s.grpc_address, timeout_s=30) as c, pytest.raises(grpc.RpcError) as e:
            c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=4))
        assert e.value.code() == grpc.StatusCode.UNKNOWN, e.value


def test_a_tokenizer_that_cannot_list_its_vocabulary_still_encodes():
    """transformers' base class raises NotImplementedError from get_vocab (a remote-code tokenizer may not define
    it): the bound on a text's length is then not taken, and prompts are tokenised as before."""
    from tlt.services.rollout.front_prompts import encode_bounded, longest_token_chars

    class NoVocab:
        def get_vocab(self):
            raise NotImplementedError

        def encode(self, text, add_special_tokens=True):
            return list(range(len(text)))

    assert longest_token_chars(NoVocab()) == 0
    assert encode_bounded(NoVocab(), "abc", 16, 0) == [0, 1, 2]


def test_slow_prompts_do_not_hold_up_a_weight_push(model_dir, monkeypatch):
    """Prompt work runs on the front's own request threads: asyncio's default executor (6 threads on 2 CPUs)
    also assembles weight pushes, and a burst of slow prompts used to queue a push behind it."""
    import concurrent.futures

    from safetensors.torch import load_file

    import tlt.services.rollout.server as server

    release, blocked = threading.Event(), []
    original = server._front_tokenizer

    def front_tokenizer(path):
        tok = original(path)
        encode = tok.encode

        def slow_encode(text, *args, **kw):
            if isinstance(text, str) and text.startswith("SLOW"):
                blocked.append(threading.current_thread().name)
                release.wait(60)
            return encode(text, *args, **kw)

        tok.encode = slow_encode
        return tok

    monkeypatch.setattr(server, "_front_tokenizer", front_tokenizer)
    weights = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, f)))
    with ServerThread(model_dir, replicas=1) as s, concurrent.futures.ThreadPoolExecutor(12) as ex:
        try:
            posts = [ex.submit(httpx.post, f"{s.base_url}/completions", timeout=90, json={
                "model": s.model_name, "prompt": f"SLOW {i}+1=", "max_tokens": 2}) for i in range(12)]
            deadline = time.monotonic() + 30
            while len(blocked) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # every thread the prompts can take is taken by now
            assert len(blocked) >= 2, blocked
            with RolloutClient(s.grpc_address, timeout_s=30) as c:
                resp = c.update_weights(weights, "policy", version=1)  # while the prompts still wait
            assert resp.ok and not release.is_set()
        finally:
            release.set()
        assert [p.result().status_code for p in posts] == [200] * 12


def test_a_chat_stream_left_during_its_first_chunks_frees_its_admission_places(model_dir):
    """A streamed chat request reserves its n sequences at admission and gave them back only once its events
    began (`_merged`); a client gone while the role chunks went out left them reserved for 60 s (the reservation's
    expiry), and an idle server with max_pending_sequences answered 429 meanwhile. Completions streams, non-streamed
    requests and gRPC calls freed theirs within 0.3 s; now chat streams too."""
    import json
    import socket

    with ServerThread(model_dir, replicas=1, max_pending_sequences=16) as s:
        port = s.server.http_port
        body = json.dumps({"model": s.model_name, "messages": [{"role": "user", "content": "12+7"}],
                           "max_tokens": 200, "n": 4, "stream": True, "ignore_eos": True}).encode()
        for attempt in range(4):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                assert sock.recv(300).startswith(b"HTTP/1.1 200")
            deadline = time.monotonic() + 5
            while s.server.pool.pending_sequences and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.server.pool.pending_sequences == 0, (attempt, s.server.pool.pending_sequences)
        r = httpx.post(f"{s.base_url}/completions", timeout=60,
                       json={"model": s.model_name, "prompt": "3+4=", "max_tokens": 1, "n": 16})
        assert r.status_code == 200, r.text
