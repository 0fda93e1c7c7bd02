"""`max_restarts` bounds a crash loop, not the server's lifetime: a replica that served a while counts from 0 again.

A real rollout server (one real replica process with the native engine, real grpc.aio) on 127.0.0.1; the test
SIGKILLs the replica by the pid the server reports (a process this test started). `restart_window_s` (600 s in
service) is shortened on the real pool so the test takes seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest
from rollout_helpers import ServerThread, learned_drafter, stream_then_kill, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2

WINDOW_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("restarts-model"))


def _kill_and_wait(s: ServerThread, c: RolloutClient, restarted: bool) -> None:
    """SIGKILL replica 0; then wait for a new process serving (restarted) or check none comes (not restarted)."""
    pool = s.server.pool
    dead = pool.replicas[0]
    old = s.server.replica_pids()[0]
    os.kill(old, signal.SIGKILL)
    if restarted:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if c.status().replicas[0].alive and s.server.replica_pids()[0] != old:
                break
            time.sleep(0.1)
        back = c.status().replicas[0].alive and s.server.replica_pids()[0] != old
        assert back, pool.restarts
        return

    async def seen() -> tuple[bool, bool]:  # read on the server's loop: between two of its callbacks
        return bool(dead.error), bool(pool._restart_tasks)

    # Not restarted: `_on_dead` (on the loop) decides at once, and a restart is a task it starts there. Wait until it
    # ran, then check that it started none; then watch past the back-off (1-2 s) that a restart waits before it
    # replaces the process, in case one were started another way.
    deadline = time.monotonic() + 30
    while not (noticed := s.call(seen()))[0]:
        assert time.monotonic() < deadline, "the pool never saw the replica die"
        time.sleep(0.02)
    assert not noticed[1], ("a restart was started", pool.restarts)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert pool.replicas[0] is dead and not c.status().replicas[0].alive, ("restarted", pool.restarts)
        time.sleep(0.1)


def test_a_replica_that_served_a_while_is_restarted_again(model_dir):
    with ServerThread(model_dir, replicas=1, max_restarts=1) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        s.server.pool.restart_window_s = WINDOW_S
        _kill_and_wait(s, c, restarted=True)  # restart 1 of 1
        time.sleep(WINDOW_S + 0.5)  # served a while: the next death is not part of a crash loop
        _kill_and_wait(s, c, restarted=True)
        assert s.server.pool.restarts == {0: 1}
        assert len(c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=4))[0].token_ids) == 4
        _kill_and_wait(s, c, restarted=False)  # died again at once: a crash loop, and max_restarts=1 is spent
        assert s.server.pool.restarts == {0: 1}
        # every death counts, the restarted process's too (/metrics' rollout_replica_deaths_total)
        assert s.server.pool.deaths == {0: 3}
        text = httpx.get(f"http://127.0.0.1:{s.server.http_port}/metrics", timeout=10).text
        assert 'rollout_replica_deaths_total{replica="0"} 3.0' in text, text


def _rejected_unavailable(base: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith('rollout_rejected_total{reason="unavailable"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_stream_cut_by_a_replica_death_ends_like_a_non_streaming_request(model_dir):
    """The SSE error chunk carries the same `code` as the 503 a non-streaming request gets ("unavailable"), and
    counts in rollout_rejected_total{reason="unavailable"} the same: a stream's death was neither."""
    with ServerThread(model_dir, replicas=1) as s:
        base = s.base_url.removesuffix("/v1")
        before = _rejected_unavailable(base)
        body = {"model": s.model_name, "prompt": "1+2=", "max_tokens": 200, "n": 32, "ignore_eos": True,
                "temperature": 1.0, "stream": True}
        rest = stream_then_kill(s, body, lambda: 0)
        assert rest[-1] == "data: [DONE]", rest[-3:]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "replica 0 died" in error["message"], error
        assert (error["type"], error["code"]) == ("server_error", "unavailable"), error
        assert _rejected_unavailable(base) == before + 1


def test_a_stalled_replica_is_killed_and_restarted_and_its_requests_fail_clearly(model_dir):
    """A replica that hangs (a deadlock, a GPU hang; here SIGSTOP) used to hold its requests forever: no error,
    /health ok, an RL step stalled with nothing in any log. A replica with work that sends nothing for
    `stall_timeout_s` is now killed and restarted like one that died, and its requests fail with UNAVAILABLE
    (redispatch_limit=0: with re-dispatch they would wait for the restart, tests/test_rollout_redispatch.py)."""
    import grpc

    with ServerThread(model_dir, replicas=1, max_restarts=1, stall_timeout_s=1.5, redispatch_limit=0) as s, \
            RolloutClient(s.grpc_address, timeout_s=30) as c:
        params = rollout_pb2.SamplingParams(max_tokens=4)
        assert len(list(c.batch_generate(["1+1="], n=2, params=params))) == 2  # idle time before is not a stall
        time.sleep(2.0)
        old = s.server.replica_pids()[0]
        os.kill(old, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(c.batch_generate(["2+2="], n=2, params=params))
        took = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "stalled" in err.value.details(), err.value
        assert took < 15, took
        deadline = time.monotonic() + 120
        while not (c.status().replicas[0].alive and s.server.replica_pids()[0] != old):
            assert time.monotonic() < deadline, s.server.pool.restarts
            time.sleep(0.1)
        assert len(list(c.batch_generate(["3+3="], n=2, params=params))) == 2
        assert s.server.pool.restarts == {0: 1}


def test_a_long_chunked_prefill_is_progress_not_a_stall(tmp_path):
    """The steps of a chunked prefill emit nothing until the first token, so a replica prefilling a long prompt sent
    nothing for as long, and the stall watchdog killed a replica that was working (and the next one the request was
    re-dispatched to). A replica now says it steps (an empty StepEvents) at least every PROGRESS_EVERY_S."""
    import asyncio

    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    from tlt.services.rollout.engine.testing import random_checkpoint

    async def prefill_then_decode(pool) -> list:
        # 438 prefill steps of 16 tokens, no token out: > 1.5 s even on a fast AVX-512 core (3,500 took 1.47 s there)
        prompt = tuple(5 + (i * 7) % 200 for i in range(7000))
        return [c async for c in pool.generate(GenerationRequest("long", prompt, SamplingParams(max_tokens=2)))]

    model = random_checkpoint(tmp_path / "m", max_position_embeddings=8192)  # 12 layers: ~5-30 ms a chunk
    with ServerThread(model, replicas=1, max_restarts=0, redispatch_limit=0, stall_timeout_s=1.5,
                      engine={"max_model_len": 8192, "max_num_batched_tokens": 16, "num_kv_blocks": 512}) as s:
        t0 = time.monotonic()
        outs = s.call(prefill_then_decode(s.server.pool), timeout=120)
        assert len(outs) == 1 and s.server.pool.deaths == {} and time.monotonic() - t0 > 1.5  # outlasts the stall timeout


def test_a_push_a_replica_does_not_answer_in_time_never_lands_later(model_dir):
    """A replica that does not answer a weight push within `update_timeout_s` (here SIGSTOPped) is in an unknown
    state: it may apply the push a moment later. The push is reported failed and the pool keeps serving version 0,
    so a replica that applied it late would serve version 1 under a status that says 0, and the trainer would see
    completions of a policy it believes was never pushed. Such a replica is now killed and restarted with the
    weights the pool serves replayed: afterwards every completion carries the version the status reports."""
    import safetensors.torch

    from tlt.services.rollout.client import WeightPushError

    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    changed = {"model.norm.weight": original["model.norm.weight"] * 1.25}
    params = rollout_pb2.SamplingParams(max_tokens=4)
    with ServerThread(model_dir, replicas=1, max_restarts=1, update_timeout_s=1.0) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c:
        old = s.server.replica_pids()[0]
        os.kill(old, signal.SIGSTOP)
        try:
            with pytest.raises(WeightPushError, match="replica 0") as err:
                c.update_weights(changed, "policy", 1)
            assert "restart" in str(err.value), err.value
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed for the restart and reaped (by the forkserver)
                os.kill(old, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not (c.status().replicas[0].alive and s.server.replica_pids()[0] != old):
            assert time.monotonic() < deadline, "the replica that missed the push was not restarted"
            time.sleep(0.1)
        assert c.status().versions.policy == 0
        outs = list(c.batch_generate(["1+2=", "3+4="], n=2, params=params))
        assert {o.versions.policy for o in outs} == {0}
        assert c.update_weights(changed, "policy", 1).ok  # the same push, again: it lands now
        assert {o.versions.policy for o in c.batch_generate(["1+2="], n=2, params=params)} == {1}


def test_a_replica_whose_process_lingers_after_it_died_is_killed_before_its_replacement_starts(model_dir):
    """A replica that reported itself dead (Fatal) but whose process does not exit (a GPU teardown that hangs; here
    SIGSTOP) held its memory while its replacement started beside it. Now it is given `exit_grace_s` to exit and
    then killed, and its replacement starts only once it is gone."""
    with ServerThread(model_dir, replicas=1, max_restarts=1) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        pool = s.server.pool
        pool.exit_grace_s = 1.0
        dead = pool.replicas[0]
        os.kill(dead.process.pid, signal.SIGSTOP)
        s.loop.call_soon_threadsafe(pool._on_dead, dead, "engine failed: (test) the replica reported Fatal")
        deadline = time.monotonic() + 120
        while pool.replicas[0] is dead:
            assert time.monotonic() < deadline, "no replacement was started"
            time.sleep(0.05)
        alive_beside = dead.process.is_alive()
        if alive_beside:
            os.kill(dead.process.pid, signal.SIGKILL)
        assert not alive_beside, "the replacement started while the dead replica's process still ran"
        while not c.status().replicas[0].alive:
            assert time.monotonic() < deadline, "the replacement did not come up"
            time.sleep(0.1)


def test_a_push_one_replica_missed_holds_and_its_restart_gets_every_push_replayed(model_dir, tmp_path):
    """Two replicas, one SIGSTOPped while a policy push arrives: it misses `update_timeout_s`, is killed and counts as
    one that died meanwhile, so the push holds on the other (it is no failure: the trainer goes on with v1), and the
    replacement serves only once the latest policy AND drafter pushes were replayed to it. Untested before: a pool
    that called the killed replica a failed one refused the push, and one that replayed only the policy never got the
    replica back (its drafter version differs from the pool's, so every restart failed its check)."""
    import safetensors.torch

    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    spec, drafter = learned_drafter(model_dir, tmp_path)
    changed = {"model.norm.weight": original["model.norm.weight"] * 1.25}
    with ServerThread(model_dir, replicas=2, max_restarts=1, update_timeout_s=1.0, spec=spec) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c:
        assert c.update_weights(drafter, "drafter", 1).ok
        old = s.server.replica_pids()[1]
        os.kill(old, signal.SIGSTOP)
        try:
            resp = c.update_weights(changed, "policy", 1)
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed for the restart and reaped (by the forkserver)
                os.kill(old, signal.SIGCONT)
        assert resp.ok and resp.version == 1, resp
        deadline = time.monotonic() + 120
        while not (c.status().replicas[1].alive and s.server.replica_pids()[1] != old):
            assert time.monotonic() < deadline, "the replica that missed the push did not come back"
            time.sleep(0.1)
        assert [(r.versions.policy, r.versions.drafter) for r in c.status().replicas] == [(1, 1), (1, 1)]
