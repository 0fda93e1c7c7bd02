"""Admission control: `max_pending_sequences` bounds the sequences the replicas hold (running or waiting).

Without it a server took every request it was sent: a burst of clients queued without bound, memory grew with the
queue and every request's latency with it, and no client was told to back off. A request that would pass the limit
now gets 429 with Retry-After over HTTP (the OpenAI SDK raises RateLimitError, and retries by itself when allowed)
and RESOURCE_EXHAUSTED over gRPC; one larger than the limit on its own gets 400 / INVALID_ARGUMENT (waiting cannot
help it). Requests admitted before are untouched, and once they finish the same request is served.

Real parts: the rollout server on 127.0.0.1 (one replica process, native engine, real grpc.aio and HTTP), the
openai SDK. The replica is SIGSTOPped (a process this test started) to hold its sequences pending while the test
looks, so the check does not race a tiny model that decodes in a second.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx
import openai
import pytest
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2

LIMIT = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("admission-model"))


def _rejected(base: str, reason: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f'rollout_rejected_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_server_at_its_limit_answers_429_and_resource_exhausted_and_serves_once_there_is_room(model_dir):
    params = rollout_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    with ServerThread(model_dir, replicas=1, max_pending_sequences=LIMIT) as s, \
            RolloutClient(s.grpc_address, timeout_s=120) as c:
        base = s.base_url.removesuffix("/v1")
        body = {"model": s.model_name, "prompt": "1+2=", "max_tokens": 4}
        alone = httpx.post(f"{s.base_url}/completions", json={**body, "n": LIMIT + 1}, timeout=60)
        assert alone.status_code == 400 and "max_pending_sequences=8" in alone.json()["error"]["message"], alone.text

        held: list = []
        first = threading.Thread(target=lambda: held.extend(c.batch_generate(["1+1=", "2+2="], n=3, params=params)))
        first.start()
        deadline = time.monotonic() + 60
        while s.server.pool.pending_sequences < 6:
            assert time.monotonic() < deadline, s.server.pool.pending_sequences
            time.sleep(0.005)
        pid = s.server.replica_pids()[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            before = _rejected(base, "overloaded")
            busy = httpx.post(f"{s.base_url}/completions", json={**body, "n": 3}, timeout=60)
            assert busy.status_code == 429, busy.text
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "overloaded" and "6 sequences pending" in busy.text
            sdk = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                sdk.completions.create(model=s.model_name, prompt=["1+2=", "3+4="], max_tokens=4, n=2)
            with pytest.raises(grpc.RpcError) as err:
                c.generate("1+2=", n=3, params=rollout_pb2.SamplingParams(max_tokens=4))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            with pytest.raises(grpc.RpcError) as err:  # the trainer's streaming call alike (it was UNKNOWN)
                list(c.batch_generate(["1+2=", "3+4="], n=2, params=rollout_pb2.SamplingParams(max_tokens=4)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "6 sequences pending" in err.value.details(), err.value.details()
            assert _rejected(base, "overloaded") == before + 4
        finally:
            os.kill(pid, signal.SIGCONT)
        first.join(120)
        assert len(held) == 6 and all(len(x.token_ids) == 200 for x in held)  # the admitted request was untouched
        assert s.server.pool.pending_sequences == 0
        ok = httpx.post(f"{s.base_url}/completions", json={**body, "n": LIMIT}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == LIMIT, ok.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_burst_of_http_requests_is_admitted_up_to_the_limit(model_dir, stream) -> None:
    """The HTTP handlers admit a request when they parse it but submit it a loop turn or more later (a streamed one
    once its body starts): a burst of 40 one-sequence requests passed max_pending_sequences = 8 together (40 of 40
    streamed, up to 23 JSON). Admission now holds each request's place until it reaches the pool: 8 admitted, 32
    told 429, never more than 8 pending."""
    import asyncio

    from tlt.services.rollout.spec.config import SpecConfig

    with ServerThread(model_dir, replicas=1, max_pending_sequences=8, spec=SpecConfig(mode="off")) as server:
        pool, peak = server.server.pool, [0]

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
                async def one() -> int:
                    body = {"model": server.model_name, "prompt": "12+7=", "max_tokens": 120, "ignore_eos": True,
                            "stream": stream}
                    async with client.stream("POST", server.base_url + "/completions", json=body) as r:
                        async for _ in r.aiter_bytes():
                            peak[0] = max(peak[0], pool.pending_sequences)
                        return r.status_code

                return list(await asyncio.gather(*(one() for _ in range(40))))

        codes = asyncio.run(burst())
    assert set(codes) == {200, 429} and codes.count(200) >= 8, codes  # more only where some of the 8 ended first
    assert peak[0] <= 8, peak


def test_a_limit_of_zero_admits_everything_and_a_limit_admits_up_to_itself() -> None:
    """`max_pending_sequences = 0` is no limit (as the config documents): no request is refused for its size or the
    server's load. With a limit, a request that fills it exactly is admitted and one sequence more is not. The
    Admission mixin on its own, with one replica holding 3 sequences."""
    from types import SimpleNamespace

    from tlt.services.rollout.admission import Admission
    from tlt.services.rollout.errors import InvalidRequestError, OverloadedError

    gate = Admission()
    gate.replicas, gate._pending, gate._reserved = [SimpleNamespace(outstanding=3)], {}, {}
    gate.max_pending_sequences = 0
    gate.admit(10**6, reserve={"a": 10**6})
    assert gate._reserved == {}  # nothing to hold a place in
    gate.max_pending_sequences = 5
    gate.admit(2)
    with pytest.raises(OverloadedError, match="3 sequences pending"):
        gate.admit(3)
    with pytest.raises(InvalidRequestError):
        gate.admit(6)
    gate.replicas[0].outstanding = 0
    gate.admit(5)  # alone, exactly the limit
