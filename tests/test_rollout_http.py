"""The OpenAI-compatible HTTP API, driven by the official `openai` client, unchanged.

Real parts: the rollout server (uvicorn on a free 127.0.0.1 port), one real
replica process running the native engine on a tiny random Qwen2 checkpoint
with the task tokenizer, the `openai` client. Nothing is faked.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
import transformers

from rollout_helpers import ServerThread, tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("rollout_http_model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(model_dir, replicas=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_name]
    assert client.models.retrieve(server.model_name).id == server.model_name  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


def test_completion_greedy_matches_transformers(client, server, model_dir):
    """40 tokens: past the 10-step hysteresis the default adaptive speculative decoding runs, losslessly."""
    prompt = "12+7=19\n19*3="
    r = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 40
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(prompt)
    assert r.usage.prompt_tokens == len(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, min_new_tokens=40)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert r.choices[0].text == expected
    assert r.model_extra["tlt_versions"] == {"policy": 0, "drafter": -1}


def test_chat_completion_uses_chat_template(client, server, model_dir):
    messages = [{"role": "user", "content": "3+4="}]
    r = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8, temperature=0)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8


def test_streaming_completion_equals_non_streaming(client, server):
    kw = dict(model=server.model_name, prompt="5*5=", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streaming_chat_with_usage(client, server):
    stream = client.chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "1+1="}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10
    assert chunks[0].choices[0].delta.role == "assistant"
    full = client.chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "1+1="}], max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content


def test_completion_logprobs(client, server):
    r = client.completions.create(model=server.model_name, prompt="2*3=", max_tokens=6, logprobs=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy: the chosen token is the top one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client, server):
    r = client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "9-2="}],
                                       max_tokens=5, logprobs=True, top_logprobs=2, temperature=1.0, seed=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_n4_samples_and_seed(client, server):
    kw = dict(model=server.model_name, prompt="7+8=", max_tokens=10, n=4, temperature=1.0, seed=1234)
    a = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2, 3]
    assert 4 <= a.usage.completion_tokens <= 40
    b = client.completions.create(**kw)
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len({c.text for c in a.choices}) > 1  # the 4 samples are not copies of each other


def test_n4_streaming(client, server):
    stream = client.completions.create(model=server.model_name, prompt="4*4=", max_tokens=6, n=4, stream=True,
                                       temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    finished = {}
    for c in stream:
        for ch in c.choices:
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_stop_string(client, server):
    base = client.completions.create(model=server.model_name, prompt="6+6=", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 4, f"the seeded random model's greedy text is too short to cut: {base!r}"
    stop = base[2:4]
    r = client.completions.create(model=server.model_name, prompt="6+6=", max_tokens=20, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]


def test_health_and_metrics(server):
    root = server.base_url.removesuffix("/v1")
    h = httpx.get(f"{root}/health")
    assert h.status_code == 200 and h.json()["replicas_alive"] == 1
    m = httpx.get(f"{root}/metrics")
    assert m.status_code == 200
    assert 'rollout_http_requests_total{endpoint="completions",status="200"}' in m.text
    assert 'rollout_replica_alive{replica="0"} 1.0' in m.text


def _metric(text: str, name: str, **labels: str) -> list[float]:
    """Values of the samples of `name` whose labels include `labels`."""
    import re

    out = []
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            out.append(float(match.group(2)))
    return out


def test_speculative_decoding_decisions_are_metrics(client, server):
    """A long greedy request runs the default adaptive n-gram SD (past the 10-step hysteresis): its verify
    steps, accept length, arms and the bandit's per-bucket choices are on /metrics."""
    client.completions.create(model=server.model_name, prompt="5+5=", max_tokens=48, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics").text
    verify = _metric(text, "rollout_spec_verify_steps_total", replica="0")
    plain = _metric(text, "rollout_spec_plain_steps_total", replica="0")
    assert verify[0] > 0 and plain[0] > 0  # the hysteresis' plain steps came first
    assert _metric(text, "rollout_spec_mean_accept_len", replica="0")[0] >= 1.0
    assert _metric(text, "rollout_spec_last_step_seconds", replica="0")[0] > 0
    assert sum(_metric(text, "rollout_spec_arm_verify_steps_total", replica="0")) == verify[0]
    assert _metric(text, "rollout_spec_last_arm", replica="0") == [1.0]  # one arm: the last step's
    explored = sum(_metric(text, "rollout_spec_bandit_choices_total", replica="0", kind="explored"))
    exploited = sum(_metric(text, "rollout_spec_bandit_choices_total", replica="0", kind="exploited"))
    assert explored >= 1 and explored + exploited == verify[0]  # one bandit choice per verify step
    assert sum(_metric(text, "rollout_spec_bandit_chosen_total", replica="0")) == verify[0]
    assert _metric(text, "rollout_spec_bandit_median_reward", replica="0")  # tokens/s of the arms tried


def test_speculation_counts_are_counters_that_survive_a_replica_restart():
    """The step counts were gauges of each replica's running totals: a restarted replica's fell to 0, which rate()
    and increase() read as nothing happening. They are counters that each scrape brings up by what was counted
    since the last, from 0 again after a restart: totals 5, 8, then 2 (restarted) count 5 + 3 + 2."""
    from tlt.services.common.metrics import Metrics
    from tlt.services.rollout.spec_metrics import SpecMetrics

    metrics = Metrics("rollout")
    spec = SpecMetrics(metrics)
    bandit = [{"bucket": "1", "explored": 1, "exploited": 0, "arms": [{"arm": "8_1_9", "chosen": 1,
                                                                       "median_reward": None}]}]
    for verify in (5, 8, 2):
        spec.update(0, {"on": True, "verify_steps": verify, "arms": {"8_1_9": {"verify_steps": verify, "emitted": 0,
                                                                                "seq_steps": 0}}, "bandit": bandit})
    text = metrics.render().decode()
    assert _metric(text, "rollout_spec_verify_steps_total", replica="0") == [10.0]
    assert _metric(text, "rollout_spec_arm_verify_steps_total", replica="0", arm="8_1_9") == [10.0]
    assert "# TYPE rollout_spec_verify_steps_total counter" in text


def test_text_stream_equals_full_decode(model_dir):
    """Windowed incremental detokenisation sends exactly the full decode, for random token runs."""
    import random

    from tlt.services.rollout.openai_convert import TextStream

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
        final = tok.decode(ids, skip_special_tokens=True)
        ts = TextStream(tok, ("xyz",))
        out, i = "", 0
        while i < len(ids):
            k = rng.randint(1, 3)
            out += ts.push(ids[i:i + k])
            i += k
            assert final.startswith(out)  # never sends text it would have to take back
        assert len(out) <= len(final) - 2 or len(final) < 2  # stop holdback: len("xyz") - 1 chars kept back
        assert out + ts.finish(final) == final


def test_batch_of_prompts_with_n(client, server):
    """prompt as a list: choice index = prompt_index * n + sample_index (the OpenAI layout)."""
    r = client.completions.create(model=server.model_name, prompt=["1+1=", "2+2="], n=2, max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3]  # greedy: the samples of one prompt agree
    single = client.completions.create(model=server.model_name, prompt="2+2=", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by[2] == single.choices[0].text
    assert r.usage.completion_tokens == 12


def test_a_seeded_batch_of_prompts_samples_each_prompt_with_its_own_seed(client, server):
    """One seed for the whole request gave every prompt of the list the same random numbers: the same prompt twice
    came back as copies. Prompt i now draws from prompt_seed(seed, i) (engine/sequence.py); prompt 0 from the
    request's seed itself, as a single prompt does."""
    kw = dict(model=server.model_name, n=2, max_tokens=12, temperature=1.0, seed=23, extra_body={"ignore_eos": True})

    def texts(prompt) -> list[str]:  # noqa: ANN001 - a prompt or a list of them
        return [c.text for c in sorted(client.completions.create(prompt=prompt, **kw).choices, key=lambda c: c.index)]

    batch = texts(["3+4=", "3+4="])  # choice index = prompt_index * n + sample_index
    assert len(batch) == 4 and batch[:2] != batch[2:], "the same prompt twice, sampled alike"
    assert texts("3+4=") == batch[:2]
    assert texts(["3+4=", "3+4="]) == batch


def _sse_text(server, path: str, body: dict) -> tuple[str, list[str]]:
    """A streamed request's concatenated text (completions: choices[0].text; chat: delta.content) and finish reasons."""
    import json

    text, reasons = "", []
    with httpx.stream("POST", f"{server.base_url}/{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert "error" not in chunk, chunk
        for ch in chunk["choices"]:
            text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            if ch.get("finish_reason"):
                reasons.append(ch["finish_reason"])
    return text, reasons


def test_streamed_text_never_holds_the_stop_string(client, server):
    """A stream with a stop string sends exactly the non-streamed text: nothing of the stop string, nothing after
    it. (The step that completes the stop string was streamed before the engine's cut text arrived: with a 2-char
    stop its first char leaked, with a 1-char stop the whole stop string did.)"""
    kw = dict(model=server.model_name, prompt="6+6=", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(**kw).choices[0].text
    assert len(base) >= 8, f"the seeded random model's greedy text is too short to cut: {base!r}"
    for stop in {base[1:2], base[2:4], base[5:8]}:
        want = client.completions.create(stop=[stop], **kw).choices[0]
        assert want.finish_reason == "stop" and want.text == base[: base.index(stop)]
        body = {"model": server.model_name, "prompt": "6+6=", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "stop": stop, "stream": True}
        assert _sse_text(server, "completions", body) == (want.text, ["stop"]), stop
    messages = [{"role": "user", "content": "6+6="}]
    chat = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    if len(chat) >= 4:
        stop = chat[2:4]
        body = {"model": server.model_name, "messages": messages, "max_tokens": 30, "temperature": 0,
                "ignore_eos": True, "stop": [stop], "stream": True}
        assert _sse_text(server, "chat/completions", body) == (chat[: chat.index(stop)], ["stop"])


def test_non_streaming_request_aborted_when_the_client_goes(server):
    """A client that gives up on a non-streaming request (timeout, ^C) frees its sequences at once instead of
    leaving them decoding to max_tokens (32 x 250 tokens here: hundreds of steps)."""
    pool = server.server.pool

    def steps() -> int:
        return server.call(pool.snapshot())[0].stats.steps

    before = steps()
    body = {"model": server.model_name, "prompt": "1", "max_tokens": 250, "n": 32, "temperature": 1.0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 30
    while pool.replicas[0].outstanding and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.replicas[0].outstanding == 0
    time.sleep(0.3)  # an abort reaches the replica between two steps
    used = steps() - before
    assert used < 200, f"the abandoned request ran {used} engine steps (all of it: 250)"
    snap = server.call(pool.snapshot())[0]
    assert snap.stats.running == 0 and snap.stats.queued == 0 and snap.stats.kv_usage == 0.0


def test_a_client_gone_leaves_no_asyncio_error(server):
    """A non-streaming request abandoned by its client is routine (a trainer's timeout): it must not log
    "_GatheringFuture exception was never retrieved" with a traceback, as it did for each one."""
    import gc

    seen: list[dict] = []
    server.loop.call_soon_threadsafe(server.loop.set_exception_handler, lambda _loop, ctx: seen.append(ctx))
    try:
        # n = 32, as above: 8 x 250 tokens could finish inside the client's 0.5 s on a fast machine
        body = {"model": server.model_name, "prompt": "1", "max_tokens": 250, "n": 32, "temperature": 1.0,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base_url}/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 30
        while server.server.pool.replicas[0].outstanding and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        server.call(asyncio.sleep(0))  # the handler's task has ended on the loop
        gc.collect()
    finally:
        server.loop.call_soon_threadsafe(server.loop.set_exception_handler, None)
    assert not seen, [c.get("message") for c in seen]


def test_null_means_the_default(server):
    """The OpenAI API marks these fields nullable and clients send `null` for "not set": the default applies
    (it was a 400 "Input should be a valid number")."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                               "top_k", "min_p", "ignore_eos", "logprobs", "seed", "stop", "user")}
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"model": server.model_name, "prompt": "1+1=", "max_tokens": 3, "echo": None, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={"model": server.model_name, "messages": [{"role": "user", "content": "1+1="}],
                         "max_tokens": 3, "top_logprobs": None, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(f"{server.base_url}/completions", timeout=60, json={"model": None, "prompt": "1"})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]


def test_bandit_median_reward_metric_follows_the_bucket_s_current_batch_size():
    """The bandit compares arms at the batch size they run at; the median on /metrics is the one at the
    bucket's latest batch size (as in GetStatus). When an arm has no data at that size its old median
    from another size stayed on /metrics, showing it ahead of arms measured at the current size."""
    from tlt.services.common.metrics import Metrics
    from tlt.services.rollout.spec.bandit import BucketedEpsilonGreedy
    from tlt.services.rollout.spec_metrics import SpecMetrics

    bandit = BucketedEpsilonGreedy(thresholds=(1, 2), bucket_arms=[["4_1_5"], ["8_4_16", "4_1_5"]], epsilon=0.0)
    big, small = bandit.arms[1]
    bandit.record(4, big, 1600, 1.0)  # both measured at batch 4
    bandit.record(4, small, 1200, 1.0)
    metrics = Metrics("rollout")
    spec_metrics = SpecMetrics(metrics)

    def bandit_stats() -> dict:
        return {"on": True, "bandit": [
            {"bucket": b.label, "explored": b.explored, "exploited": b.exploited,
             "arms": [{"arm": a.arm, "samples": a.samples, "median_reward": a.median_reward, "chosen": a.chosen}
                      for a in b.arms]} for b in bandit.snapshot()]}

    spec_metrics.update(0, bandit_stats())
    text = metrics.render().decode()
    assert _metric(text, "rollout_spec_bandit_median_reward", bucket=">=2", arm="4_1_5") == [1200.0]
    bandit.record(3, big, 1050, 1.0)  # the batch fell to 3: only 8_4_16 has run there
    spec_metrics.update(0, bandit_stats())
    text = metrics.render().decode()
    assert _metric(text, "rollout_spec_bandit_median_reward", bucket=">=2", arm="8_4_16") == [1050.0]
    assert _metric(text, "rollout_spec_bandit_median_reward", bucket=">=2", arm="4_1_5") == []  # no data at 3


def test_chat_logprob_bytes_rebuild_the_text(client, server, model_dir):
    """OpenAI's `bytes` exist so that a client can join a token run back into text when a character is split
    over several tokens. A byte piece's `bytes` were the UTF-8 of its vocabulary string (GPT-2's 'Ã' for the
    byte 0xC3, i.e. [195, 131]): joined they gave mojibake instead of the message's text."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    specials = set(tok.all_special_tokens)
    r = client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "é中"}],
                                       max_tokens=40, temperature=1.0, seed=11, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = [t for t in r.choices[0].logprobs.content if t.token not in specials]
    # the byte-level tiny tokenizer splits most non-ASCII characters: the sample holds byte pieces
    vocab = tok.get_vocab()
    assert any(t.token in vocab and "\ufffd" in tok.decode([vocab[t.token]]) for t in content), content
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.decode("utf-8", errors="replace") == r.choices[0].message.content
    for t in content:
        for alt in t.top_logprobs:
            assert alt.bytes and all(0 <= b < 256 for b in alt.bytes)


def test_chat_history_replays_the_sdk_s_own_message(client, server, model_dir):
    """A multi-turn client appends the reply to its history, often as `message.model_dump()`, which holds the
    OpenAI assistant message's other fields as null (refusal, tool_calls, function_call, audio, annotations).
    Every such follow-up was a 400 "unknown parameter 'messages.1.refusal'". Null is accepted, and so is a
    message with tool calls (the template renders what it renders of it); `tools` are refused with a template
    that ignores them, as the shipped tiny one does (the model would never see them); a truly unknown field
    still gets its 400. tests/test_rollout_tools.py covers tools with a template that renders them."""
    user = {"role": "user", "content": "2+2="}
    first = client.chat.completions.create(model=server.model_name, messages=[user], max_tokens=4, temperature=0)
    replayed = first.choices[0].message.model_dump()
    assert "refusal" in replayed and "tool_calls" in replayed
    follow = {"role": "user", "content": "and 3+3="}
    r = client.chat.completions.create(model=server.model_name, messages=[user, replayed, follow], max_tokens=4,
                                       temperature=0)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    history = [user, {"role": "assistant", "content": first.choices[0].message.content}, follow]
    ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with_call = [user, {"role": "assistant", "content": None, "tool_calls": [call]}, follow]
    r = client.chat.completions.create(model=server.model_name, max_tokens=4, messages=with_call)
    history = [user, {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "f",
                                                                                              "arguments": {}}}]},
               follow]
    ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="this model's chat template does not render tools") as e:
        client.chat.completions.create(model=server.model_name, max_tokens=4, messages=[user], tools=[tool])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="unknown parameter 'messages.\\[0\\].colour'"):
        client.chat.completions.create(model=server.model_name, max_tokens=4,
                                       messages=[{**user, "colour": "red"}])


def test_nullable_keys_are_sent_as_null_as_the_openai_api_sends_them(server):
    """`finish_reason` is in every streamed choice (null until the last chunk), `logprobs` in every choice (null
    when not asked for), `param` and `code` in every error: the API reference's own examples read them by key.
    They were left out when null, and `chunk["choices"][0]["finish_reason"]` raised KeyError."""
    base = {"model": server.model_name, "max_tokens": 4, "ignore_eos": True}
    for path, extra in (("completions", {"prompt": "1+1="}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "1+1="}]})):
        with httpx.stream("POST", f"{server.base_url}/{path}", json={**base, **extra, "stream": True}, timeout=60) as r:
            chunks = [json.loads(x.removeprefix("data: ")) for x in r.iter_lines() if x and x != "data: [DONE]"]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        assert choices and all("finish_reason" in c and "logprobs" in c for c in choices), (path, chunks)
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
        whole = httpx.post(f"{server.base_url}/{path}", json={**base, **extra}, timeout=60).json()
        assert whole["choices"][0]["logprobs"] is None and whole["choices"][0]["finish_reason"] == "length"
    bad = httpx.post(f"{server.base_url}/completions", json={**base, "prompt": "1", "n": 0}, timeout=60).json()
    assert "param" in bad["error"] and "code" in bad["error"], bad


def test_tool_message_replayed_with_its_tool_call_id(client, server, model_dir):
    """A conversation replayed by the OpenAI SDK holds a `tool` message with its `tool_call_id` (and maybe a
    `name`). It was a 400 "unknown parameter 'messages.2.tool_call_id'". The message goes to the chat template
    like any other role, its `tool_call_id` and `name` with it (as vLLM does), so the prompt is the template's
    rendering of exactly these messages. A `tool_call_id` on another role means nothing and is refused by name."""
    messages = [
        {"role": "user", "content": "2+2=", "name": "alice"},
        {"role": "assistant", "content": "I will ask the calculator."},
        {"role": "tool", "tool_call_id": "call_1", "name": "calc", "content": "4"},
        {"role": "user", "content": "so 2+2="},
    ]
    r = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=4, temperature=0)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert "<|im_start|>tool\n4<|im_end|>" in tok.decode(ids)  # the tool message is in the prompt, as its role
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]: tool_call_id is only for role 'tool'"):
        client.chat.completions.create(model=server.model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": "1", "tool_call_id": "call_1"}])


@pytest.mark.parametrize("path, extra", [("completions", {"prompt": "1+1="}),
                                         ("chat/completions", {"messages": [{"role": "user", "content": "1+1="}]})])
def test_stream_options_without_stream_is_a_400(server, path, extra):
    """As the OpenAI API answers: `stream_options` without `stream: true` is a 400 naming the parameter (it was
    accepted and ignored). `stream_options: null` is "not set" and still fine."""
    base = {"model": server.model_name, "max_tokens": 2, **extra}
    for stream in ({}, {"stream": False}, {"stream": None}):
        r = httpx.post(f"{server.base_url}/{path}", timeout=60,
                       json={**base, **stream, "stream_options": {"include_usage": True}})
        assert r.status_code == 400, (stream, r.text)
        err = r.json()["error"]
        assert err["param"] == "stream_options" and err["type"] == "invalid_request_error", err
        assert "only allowed when 'stream' is enabled" in err["message"], err
    r = httpx.post(f"{server.base_url}/{path}", timeout=60, json={**base, "stream": False, "stream_options": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, extra, param", [
    ("chat/completions", {"messages": [{"role": "user", "content": "1+1="}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("completions", {"prompt": "1+1=", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "1+1=", "temperature": -1}, "temperature"),
])
def test_a_sampling_value_out_of_range_names_its_parameter(server, path, extra, param):
    """The engine's range checks reached the client without `param`, and a chat request's top_logprobs=21 was
    called "logprobs", a field it had not sent."""
    r = httpx.post(f"{server.base_url}/{path}", timeout=60, json={"model": server.model_name, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_a_streamed_batch_of_prompts_with_n_numbers_its_choices_as_the_non_streamed_one(server):
    """A stream of several prompts with n > 1 numbers each choice prompt_index * n + sample_index, as the
    non-streamed response does: each index gets its own prompt's text and one finish_reason, none two samples'.
    usage.prompt_tokens counts every prompt of the list (once each, whatever n), as OpenAI counts them."""
    base = {"model": server.model_name, "prompt": ["1+1=", "2+2="], "n": 2, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    whole = httpx.post(f"{server.base_url}/completions", json=base, timeout=60).json()
    want = {c["index"]: c["text"] for c in whole["choices"]}
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    with httpx.stream("POST", f"{server.base_url}/completions", json={**base, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line and line != "data: [DONE]":
                for ch in json.loads(line.removeprefix("data: "))["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                    if ch["finish_reason"]:
                        reasons.setdefault(ch["index"], []).append(ch["finish_reason"])
    assert texts == want and sorted(want) == [0, 1, 2, 3]
    assert reasons == {i: ["length"] for i in range(4)}
    singles = [httpx.post(f"{server.base_url}/completions", json={**base, "prompt": p, "n": 1}, timeout=60).json()
               for p in base["prompt"]]
    assert whole["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles) > 0
