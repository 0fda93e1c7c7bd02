"""Findings of a new user's review of the OpenAI-compatible HTTP API, each pinned by a test: HEAD on the GET routes,
`param` of a refused top_logprobs, the sampled token among a completion's top logprobs, a 400 naming a non-text
content part, and rollout_generated_tokens_total for requests that end early (their unfinished samples' tokens
included).

Real parts: the rollout server (uvicorn on a free 127.0.0.1 port), one replica process running the native engine on
a tiny random Qwen2 checkpoint with the task tokenizer, httpx and the official `openai` client. Nothing is faked.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from rollout_helpers import ServerThread, tiny_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerThread(tiny_checkpoint(tmp_path_factory.mktemp("rollout_review_model")), replicas=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def test_head_answers_as_get_without_a_body(server):
    """`curl -I /health` (load balancers' and probes' check) was a 405: FastAPI routes take no HEAD for GET."""
    root = server.base_url.removesuffix("/v1")
    for path in ("/health", "/v1/models", f"/v1/models/{server.model_name}", "/metrics"):
        get, head = httpx.get(root + path), httpx.head(root + path)
        assert head.status_code == get.status_code == 200, (path, head.status_code)
        assert head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path
        if path != "/metrics":  # its body changes between two scrapes
            assert int(head.headers["content-length"]) == len(get.content), path
    assert httpx.head(f"{root}/v1/models/no-such-model").status_code == 404
    assert httpx.head(f"{server.base_url}/completions").status_code == 405  # a POST route stays POST only


def test_top_logprobs_without_logprobs_names_its_parameter(client, server):
    """The refusal came with `"param": null`: it names top_logprobs, as the SDK's BadRequestError.param shows."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "1+1="}],
                                       max_tokens=3, top_logprobs=2)
    assert e.value.param == "top_logprobs", e.value.body
    assert "top_logprobs needs logprobs: true" in e.value.message


def test_an_image_part_is_one_400_naming_the_part_s_type(client, server):
    """What the SDK sends for vision was refused with the pydantic errors of four union members; now one line that
    says only text parts are served, naming `messages.[i].content.[j].type`. Text parts still work."""
    parts = [{"type": "text", "text": "what is in"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                        "iVBORw0KGgo="}}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=3)
    assert e.value.param == "messages.[1].content.[1].type", e.value.body
    assert e.value.body["message"] == ("messages[1].content[1]: only text content parts (type 'text') are supported; "
                                       "got type 'image_url'")
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60, json={
        "model": server.model_name, "max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.[0].content.[0].text", r.text
    ok = client.chat.completions.create(model=server.model_name, max_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]}])
    assert ok.choices[0].finish_reason in ("stop", "length")


def _check_holds_sampled(lp, k: int) -> int:
    """Every position's top_logprobs holds its sampled token, at its token_logprobs value, and at most k+1
    entries; returns how many positions sampled a token outside the top k."""
    outside = 0
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok in top and top[tok] == pytest.approx(chosen, abs=1e-5), (tok, chosen, top)
        assert k <= len(top) <= k + 1, top
        if len(top) == k + 1:
            outside += 1
            assert min(v for t, v in top.items() if t != tok) >= chosen, top  # the k others are the likelier ones
    return outside


def test_completion_top_logprobs_always_hold_the_sampled_token(client, server):
    """OpenAI's legacy completions: "The API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements". A token sampled outside the top k was missing from its position's list. The
    random model's distribution is flat: at temperature 1 most tokens are sampled outside the top 1."""
    kw = dict(model=server.model_name, prompt="3*4=", max_tokens=24, logprobs=1, temperature=1.0, seed=17,
              extra_body={"ignore_eos": True})
    lp = client.completions.create(**kw).choices[0].logprobs
    assert len(lp.tokens) == 24
    assert _check_holds_sampled(lp, 1) > 0, "no token sampled outside the top 1: the test checks nothing"
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    # each chunk carries its tokens' logprobs (they all came in the last one before); joined: the same lists
    assert sum(c.logprobs is not None for c in chunks) > 1
    joined = [x for c in chunks if c.logprobs is not None for x in c.logprobs.top_logprobs]
    assert joined == lp.top_logprobs
    assert [o for c in chunks if c.logprobs is not None for o in c.logprobs.text_offset] == lp.text_offset


def _generated(server) -> float:
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics").text
    (value,) = re.findall(r"^rollout_generated_tokens_total (\S+)$", text, re.M)
    return float(value)


def _settle(server) -> None:
    """The aborted request has left the replica (its abort reached the engine)."""
    pool = server.server.pool
    deadline = time.monotonic() + 30
    while pool.replicas[0].outstanding and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.replicas[0].outstanding == 0
    time.sleep(0.2)


def test_generated_tokens_count_requests_that_end_early(client, server):
    """A stream the client closed mid-way left rollout_generated_tokens_total where it was, though it had been sent
    tokens. Finished requests (plain, streamed, chat streamed) count exactly their usage, never twice."""
    start = _generated(server)
    plain = client.completions.create(model=server.model_name, prompt="2+2=", max_tokens=20, temperature=1.0,
                                      seed=3, extra_body={"ignore_eos": True})
    streamed = [c for c in client.completions.create(model=server.model_name, prompt="2+3=", max_tokens=17,
                                                     stream=True, stream_options={"include_usage": True},
                                                     temperature=1.0, seed=4) if c.usage is not None]
    chat = [c for c in client.chat.completions.create(model=server.model_name, max_tokens=13, stream=True,
                                                      messages=[{"role": "user", "content": "5+5="}], n=2,
                                                      stream_options={"include_usage": True}, temperature=1.0)
            if c.usage is not None]
    finished = plain.usage.completion_tokens + streamed[0].usage.completion_tokens + chat[0].usage.completion_tokens
    assert _generated(server) - start == finished
    body = {"model": server.model_name, "prompt": "1", "max_tokens": 230, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "stream": True}
    received = 0
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                received += 1  # a chunk of text holds one token or more
                if received == 60:
                    break  # the client goes away mid-stream
    assert received == 60
    _settle(server)
    cancelled = _generated(server) - start - finished
    assert 60 <= cancelled <= 230, cancelled


def _stop_early(server) -> tuple[int, dict]:
    """Seeded sampling is reproducible: a first run (gRPC, for the token ids) picks a stop token that ends sample 0
    after a few tokens and never comes in sample 1. Returns (its position in sample 0, the request body with it)."""
    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    prompt, seed, max_tokens = [100, 200, 30], 21, 230
    grpc_client = RolloutClient(server.grpc_address, timeout_s=60)
    try:
        params = rollout_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)
        done = {c.sample_index: list(c.token_ids) for c in grpc_client.generate(prompt, n=2, params=params)}
    finally:
        grpc_client.close()
    first, other = done[0], done[1]
    end = next(j for j in range(2, 12) if first[j] not in first[:j] and first[j] not in other)
    return end, {"model": server.model_name, "prompt": prompt, "max_tokens": max_tokens, "n": 2, "temperature": 1.0,
                 "seed": seed, "ignore_eos": True, "stop_token_ids": [first[end]]}


def _steps(server) -> int:
    """The engine steps replica 0 ran since it started."""
    return server.call(server.server.pool.snapshot())[0].stats.steps


def _leave_mid_way(server, body: dict, after_steps: int) -> int:
    """POST `body` (not streamed) and leave once the engine ran `after_steps` steps of it; returns the steps it ran
    before it left."""
    async def run() -> int:
        async with httpx.AsyncClient(timeout=60) as c:
            before = _steps(server)
            task = asyncio.ensure_future(c.post(f"{server.base_url}/completions", json=body))
            while _steps(server) - before < after_steps and not task.done():
                await asyncio.sleep(0.005)
            assert not task.done(), "the request finished before its client could leave"
            task.cancel()
            return before

    return asyncio.run(run())


def test_a_non_streamed_request_whose_client_goes_counts_its_finished_samples(server):
    """A non-streamed request aborted by its client (499) counted nothing, though some of its samples had finished.
    The client leaves while sample 1 still decodes (sample 0 stopped at its stop token)."""
    end, body = _stop_early(server)
    start = _generated(server)
    _leave_mid_way(server, body, end + 10)  # sample 0 has stopped by then
    _settle(server)
    assert end + 1 <= _generated(server) - start <= 2 * body["max_tokens"]


def test_a_non_streamed_request_whose_client_goes_counts_what_its_unfinished_samples_generated(server):
    """Only finished samples were counted: the tokens sample 1 had generated when its client left (499) were work
    the engine did, yet rollout_generated_tokens_total never saw them. Counted at the pool from every engine step,
    the counter matches the engine exactly: each step of this request but its first decoded one token of sample 1
    (which starts a step after sample 0, copying the K/V of the prompt's partial last block from it: BlockManager),
    and sample 0 stopped after end + 1 tokens."""
    end, body = _stop_early(server)
    start = _generated(server)
    before = _leave_mid_way(server, body, end + 20)
    _settle(server)  # the abort reached the engine: it runs no step of the request any more
    ran = _steps(server) - before
    assert ran >= end + 20
    assert _generated(server) - start == end + 1 + ran - 1


def _rejected(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'^rollout_rejected_total\{reason="([^"]+)"\} (\S+)$', text, re.M)}


def test_a_client_gone_while_sending_its_body_counts_as_client_closed(server):
    """starlette's ClientDisconnect, raised while the body was read, escaped to the catch-all handler: a 500
    internal_error with an 'Exception in ASGI application' traceback, for what is a client leaving (499)."""
    import socket

    before = _rejected(server)
    host, port = server.base_url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{\"model\": \"m\", ")
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while (after := _rejected(server)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {"client_closed": 1.0}


def test_text_offset_indexes_the_text_the_choice_returns(server):
    """text_offset was summed over the tokens' display strings: a character split over byte pieces (日 is three
    GPT-2 pieces) counted three, a special token its whole `<|im_end|>`, so every later offset pointed past its
    token in `text` (decoded without special tokens)."""
    import transformers

    from tlt.services.rollout.openai_convert import completion_logprobs

    tok = transformers.AutoTokenizer.from_pretrained(server.server.model_dir)
    for s in ("日本x", "a<|im_end|>b", "é€x"):
        ids = tok.encode(s)
        text = tok.decode(ids, skip_special_tokens=True)
        offsets = completion_logprobs(tok, ids, [-1.0] * len(ids), None, 0, text).text_offset
        assert len(offsets) == len(ids) and offsets == sorted(offsets) and text[offsets[-1]:] == s[-1], (s, offsets)
        # every token starts at (or inside) the character its first byte belongs to
        for i, o in enumerate(offsets):
            assert tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd") == text[:o], (s, i, offsets)
    ids = tok.encode("abc")
    assert completion_logprobs(tok, ids, [-1.0] * 3, None, 0, "a").text_offset[-1] <= 1  # a stop string cut it


def test_streamed_logprobs_come_with_their_chunks_and_join_to_the_non_streamed_ones(client, server):
    """OpenAI and vLLM send each chunk's tokens' logprobs with that chunk; here every text chunk but the last came
    with `logprobs: null` and the last carried the whole choice's. Now a text chunk carries the tokens that came
    before it (a token whose text is held back, a part of a character or of a possible stop string, goes with the
    next), and the lists joined are the non-streamed response's, completions and chat alike."""
    kw = dict(model=server.model_name, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="12+7=", logprobs=2, **kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(prompt="12+7=", logprobs=2, stream=True, **kw)
              if c.choices]
    texts = [c for c in chunks if c.text]
    assert len(texts) > 2 and all(c.logprobs is not None and c.logprobs.tokens for c in texts[1:])
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks if c.logprobs for x in getattr(c.logprobs, field)] == getattr(full.logprobs, field)
    assert "".join(c.text for c in chunks) == full.text

    messages = [{"role": "user", "content": "12+7="}]
    whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw).choices[0]
    parts = [c.choices[0] for c in client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                                                    stream=True, **kw) if c.choices]
    with_content = [c for c in parts if c.delta.content]
    assert len(with_content) > 2 and all(c.logprobs is not None for c in with_content[1:])
    joined = [t for c in parts if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in joined] == \
        [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in whole.logprobs.content]


def test_streamed_text_offsets_stay_inside_a_text_cut_by_a_stop_string(server):
    """A chunk took the logprobs of every token so far, also of tokens whose text was held back as the possible
    start of a stop string; when the stop string completed, their streamed offsets pointed past the returned text
    (the non-streamed response clamps them). A chunk now takes only tokens whose text has begun to go out.
    The server's own choice stream (`CompletionChoiceStream`) and tokenizer, one character per token."""
    import transformers

    from tlt.services.rollout import openai_convert as conv
    from tlt.services.rollout.types import CompletionOutput, FinishReason, StepOutput, Versions

    tok = transformers.AutoTokenizer.from_pretrained(server.server.model_dir)
    ids = [tok.convert_tokens_to_ids(ch) for ch in "abcdefXYZ"]
    assert tok.decode(ids) == "abcdefXYZ"
    stream, chunks = conv.CompletionChoiceStream(tok, ("XYZ",), 0), []
    for i, t in enumerate(ids):  # the step that completes the stop string is the finished one
        text, lp = stream.push(StepOutput("r", 0, [t], [-1.0], finished=i == len(ids) - 1))
        chunks.append((text, lp))
    done = CompletionOutput("r", 0, [1], ids, "abcdef", FinishReason.STOP, Versions(), logprobs=[-1.0] * len(ids))
    chunks.append(stream.finish(done))
    offsets = [o for _, lp in chunks if lp is not None for o in lp.text_offset]
    whole = conv.completion_logprobs(tok, ids, done.logprobs, None, 0, done.text).text_offset
    assert "".join(text for text, _ in chunks) == "abcdef"
    assert offsets == whole == [0, 1, 2, 3, 4, 5, 6, 6, 6]


def _byte_piece(tok, b: int) -> int:  # noqa: ANN001
    """The task tokenizer's token for the single byte `b` (GPT-2's byte alphabet)."""
    from tlt.services.rollout.token_text import BYTE_LEVEL

    return tok.convert_tokens_to_ids(next(ch for ch, v in BYTE_LEVEL.items() if v == b))


def _chunk_spans(chunks: list[tuple[str, list[int] | None]]) -> list[tuple[int, int, list[int] | None]]:
    """Each text chunk's [start, end) in the joined text with the text offsets of the logprobs it carries."""
    spans, pos = [], 0
    for text, offsets in chunks:
        if text:
            spans.append((pos, pos + len(text), offsets))
        pos += len(text)
    return spans


def test_text_offset_after_a_broken_character_points_at_the_next_token_s_text():
    """A token after a lead byte (0xE1 opens a 3-byte character) was placed inside that character even when its
    own first byte starts a new one: the text reads U+FFFD then the token's, yet its offset was the U+FFFD's. A
    stream then sent its logprobs with the chunk before its text, and the chunk with its text had none."""
    from tlt.model.tokenizer import test_tokenizer
    from tlt.services.rollout import openai_convert as conv
    from tlt.services.rollout.types import CompletionOutput, FinishReason, StepOutput, Versions

    tok = test_tokenizer()
    lead, cont = _byte_piece(tok, 0xE1), _byte_piece(tok, 0x80)
    n, l, x = (tok.convert_tokens_to_ids(ch) for ch in "nlx")
    for ids, want in (([lead, n, l], [0, 1, 2]),  # "\ufffdnl"
                      ([x, lead, n, lead, l], [0, 1, 2, 3, 4]),  # "x\ufffdn\ufffdl"
                      ([lead, cont, n], [0, 0, 1]),  # "\ufffdn": 0xE1 0x80 is one broken character
                      ([x, *tok.encode("日"), n], [0, 1, 1, 1, 2])):  # a whole character's pieces point at it
        text = tok.decode(ids)
        assert conv.completion_logprobs(tok, ids, [-1.0] * len(ids), None, 0, text).text_offset == want, (text, ids)

    # streamed, one token a step; the stop string holds back one character, so a chunk can end at the U+FFFD
    ids = [x, lead, n, l, x, lead, n, x, x]
    text = tok.decode(ids)
    assert text == "x\ufffdnlx\ufffdnxx"
    stream, chunks = conv.CompletionChoiceStream(tok, ("zz",), 0), []
    for i, t in enumerate(ids):
        delta, lp = stream.push(StepOutput("r", 0, [t], [-1.0], finished=i == len(ids) - 1))
        chunks.append((delta, lp and lp.text_offset))
    delta, lp = stream.finish(CompletionOutput("r", 0, [1], ids, text, FinishReason.LENGTH, Versions(),
                                               logprobs=[-1.0] * len(ids)))
    chunks.append((delta, lp and lp.text_offset))
    assert "".join(t for t, _ in chunks) == text
    for start, end, offsets in _chunk_spans(chunks):  # each chunk carries the tokens whose text begins in it
        assert offsets and all(start <= o < end for o in offsets), (start, end, offsets, chunks)


def test_streamed_chat_logprobs_wait_for_the_text_held_back():
    """A chat chunk took the logprobs of every token so far, also of tokens whose text was held back (the possible
    start of a stop string, or of a `<tool_call>`): their logprobs went out before their text, or with no text at
    all. A chat chunk now takes the tokens whose text has begun to go out, as a completions chunk does."""
    from tlt.model.tokenizer import test_tokenizer
    from tlt.services.rollout import openai_convert as conv
    from tlt.services.rollout.types import CompletionOutput, FinishReason, StepOutput, Versions

    tok = test_tokenizer()
    for stop, tools, ids, text in (
        (("XYZ",), None, [tok.convert_tokens_to_ids(ch) for ch in "abcXYabcXYZ"], "abcXYabc"),
        ((), conv.ToolParsing(frozenset({"f"})), tok.encode("ab <tool_call") + tok.encode("x"), "ab <tool_callx"),
    ):
        stream, chunks, pos = conv.ChatChoiceStream(tok, 0, stop, tools, logprobs=True), [], 0
        for i, t in enumerate(ids):
            chunks += stream.push(StepOutput("r", 0, [t], [-1.0], finished=i == len(ids) - 1))
        reason = FinishReason.STOP if stop else FinishReason.LENGTH
        chunks += stream.finish(CompletionOutput("r", 0, [1], ids, text, reason, Versions(),
                                                 logprobs=[-1.0] * len(ids)))
        sent = got = ""
        for c in chunks[:-1]:  # every token whose logprob goes out has begun to go out (in that chunk or before)
            sent += c.delta.content or ""
            for t in c.logprobs.content if c.logprobs else ():
                assert len(got) < len(sent), (stop, got, t.token, sent)
                got += t.token
            assert text.startswith(got), (stop, got)
        assert got, "no chunk before the last carried logprobs: the test checks nothing"
        assert [t for c in chunks if c.logprobs for t in c.logprobs.content] == \
            conv.chat_logprobs(tok, ids, [-1.0] * len(ids), None, 0).content


def _requests_counted(server) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics").text
    pattern = r'^rollout_http_requests_total\{endpoint="([^"]+)",status="([^"]+)"\} (\S+)$'
    return {(m[0], m[1]): float(m[2]) for m in re.findall(pattern, text, re.M)}


@pytest.mark.parametrize("path, endpoint, prompt", [
    ("/v1/completions", "completions", {"prompt": "1+1="}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "1+1="}]}),
])
def test_a_stream_whose_client_leaves_counts_once_as_client_closed(server, path, endpoint, prompt):
    """A streamed request whose client went away mid-stream was never counted in rollout_http_requests_total (its
    count came after the stream's last chunk, which never came), where a non-streamed one counts as 499."""
    import socket

    before, rejected = _requests_counted(server), _rejected(server)
    body = json.dumps({"model": server.model_name, "max_tokens": 200, "ignore_eos": True, "stream": True, **prompt})
    host, port = server.base_url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        got = b""
        while b"data: " not in got:  # the stream has begun
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    deadline = time.monotonic() + 15
    while (after := _requests_counted(server)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # nothing else to count: exactly one line moves
    after = _requests_counted(server)
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {(endpoint, "499"): 1.0}
    moved = {k: v - rejected.get(k, 0) for k, v in _rejected(server).items() if v != rejected.get(k, 0)}
    assert moved == {"client_closed": 1.0}


@pytest.mark.parametrize("path, prompt", [
    ("/completions", {"prompt": "1+1="}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "1+1="}]}),
])
def test_include_usage_puts_a_null_usage_in_every_other_chunk(server, path, prompt):
    """OpenAI: with stream_options.include_usage, "all other chunks will also include a usage field, but with a null
    value"; ours left the key out, and `chunk["usage"]` raised KeyError. Without the option no chunk has the key."""
    body = {"model": server.model_name, "max_tokens": 3, "stream": True, **prompt}
    for include in (True, False):
        chunks = []
        with httpx.stream("POST", server.base_url + path, timeout=60,
                          json={**body, "stream_options": {"include_usage": include}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        *others, last = chunks
        assert others and last["choices"] == [] if include else last["choices"], last
        if include:
            assert all("usage" in c and c["usage"] is None for c in others), others
            assert last["usage"]["completion_tokens"] == 3
        else:
            assert not any("usage" in c for c in chunks)


def test_a_chat_prompt_past_the_context_names_messages(server):
    """The 400 for a chat prompt longer than the context named `param: "prompt"`, a field chat requests do not have;
    OpenAI names `messages`."""
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60, json={
        "model": server.model_name, "messages": [{"role": "user", "content": "1+" * 2000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(f"{server.base_url}/completions", timeout=60, json={"model": server.model_name, "prompt": "1+" * 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_number_too_long_to_read_is_a_400_not_a_500(server):
    """json.loads raises a plain ValueError for an integer of over 4,300 digits: it escaped as a 500 internal_error."""
    body = '{"model": "%s", "prompt": "1+1=", "max_tokens": %s}' % (server.model_name, "1" * 5000)
    r = httpx.post(f"{server.base_url}/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


@pytest.mark.parametrize("path, extra", [("completions", {"prompt": "1+1=", "logprobs": 5}),
                                         ("chat/completions", {"messages": [{"role": "user", "content": "1+1="}],
                                                               "logprobs": True, "top_logprobs": 5})])
def test_alternatives_outside_top_k_have_the_floor_logprob(server, path, extra):
    """With top_k=2 every alternative past the second has probability 0 (logprob -inf), which JSON cannot hold:
    they leave as -9999.0, as OpenAI reports a zero-probability token, and the response is a 200, not a 500."""
    r = httpx.post(f"{server.base_url}/{path}", timeout=60, json={
        "model": server.model_name, "max_tokens": 3, "temperature": 1.0, "seed": 5, "top_k": 2, "ignore_eos": True,
        **extra})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    if path == "completions":
        tops = [sorted(top.values(), reverse=True) for top in lp["top_logprobs"]]
    else:
        tops = [[alt["logprob"] for alt in t["top_logprobs"]] for t in lp["content"]]
    assert len(tops) == 3
    for values in tops:
        assert len(values) == 5 and values[2:] == [-9999.0] * 3 and all(-9999.0 < v <= 0 for v in values[:2])



@pytest.mark.parametrize("path, extra", [("completions", {"prompt": "1+1=", "logprobs": 0}),
                                         ("chat/completions", {"messages": [{"role": "user", "content": "1+1="}],
                                                               "logprobs": True})])
def test_the_choices_of_n_samples_come_in_index_order(server, path, extra):
    """n > 1 samples finish in any order (here each stops at the first of a third of the vocabulary it draws); the
    response lists its choices by index, as the OpenAI API does, so `choices[i]` is sample i, and its usage
    counts every choice's tokens."""
    vocab = server.server.pool.info.vocab_size
    r = httpx.post(f"{server.base_url}/{path}", timeout=60, json={
        "model": server.model_name, "n": 6, "max_tokens": 24, "temperature": 1.0, "seed": 3,
        "stop_token_ids": list(range(3, vocab, 3))[:1024], **extra}).json()
    assert [c["index"] for c in r["choices"]] == list(range(6)), r
    lengths = [len(c["logprobs"]["tokens" if path == "completions" else "content"]) for c in r["choices"]]
    assert lengths != sorted(lengths), lengths  # they finished out of index order: else this test could not fail
    assert r["usage"]["completion_tokens"] == sum(lengths), r["usage"]
