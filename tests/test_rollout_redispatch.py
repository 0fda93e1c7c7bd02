"""A replica that dies costs only its own unfinished samples: the pool re-dispatches them, the request goes on.

A real rollout server (real replica processes with the native engine on a tiny random checkpoint, real grpc.aio
and uvicorn on 127.0.0.1); the tests SIGKILL a replica by the pid the server reports (a process this test
started) while a BatchGenerate is in flight. Nothing is faked. Checked:

- every prompt of the batch still gets its n completions, each (prompt, sample) once, and no error; the samples
  of the dead replica's requests that had not finished came from another replica;
- a seeded batch gives the same completions as an undisturbed run (each re-issued sample keeps its index, so its
  per-sample seed);
- with no other replica alive the request waits for the restarted one; `redispatch_limit` bounds how often, and
  0 keeps the old failure (UNAVAILABLE);
- a stream that already sent tokens is not re-dispatched (they cannot be taken back): it fails as before;
- a client that goes away after its request was re-dispatched aborts it on the replica it went to;
- rollout_generated_tokens_total counts the tokens a re-dispatched sample regenerates (real work) too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections import Counter

import grpc
import httpx
import pytest
from rollout_helpers import ENGINE_TEST_SETTINGS, ServerThread, stream_then_kill, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2

PROMPTS = ["1+2=", "7*3=", "12-5=", "4+4="]
N = 4
# seed 3 on this checkpoint: sample 0 of "1+2=" stops first (eos after 31 tokens, on its replica's first request),
# samples 1 and 2 of it run to max_tokens, so a replica killed once its first completion arrived still holds
# unfinished samples of the same request (for ~90 more steps: a kill takes milliseconds to land)
SEEDED = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=120, seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("redispatch-model"))


def _run(engine, request) -> dict[int, list[int]]:
    engine.add_request(request)
    outs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for c in engine.step()[1]:
            outs[c.sample_index] = c.token_ids
    return outs


def test_the_engine_runs_a_subset_of_samples_each_as_it_runs_in_the_whole_request(model_dir):
    """What a re-dispatch sends: the unfinished samples alone (`sample_indices`), each with its own index and so
    its per-sample seed; in-process native engine, no server."""
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    engine = LLMEngine(model_dir, EngineConfig(**ENGINE_TEST_SETTINGS))
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    whole = _run(engine, GenerationRequest("whole", (5, 6, 7), params, n=5))
    part = _run(engine, GenerationRequest("part", (5, 6, 7), params, n=5, sample_indices=(1, 4)))
    assert part == {1: whole[1], 4: whole[4]}
    assert len({tuple(t) for t in whole.values()}) == 5  # the samples do differ: equal ones would prove nothing
    for bad in ((5,), (1, 1), (-1,)):
        with pytest.raises(ValueError, match="sample_indices"):
            engine.add_request(GenerationRequest(f"bad{bad}", (5, 6, 7), params, n=5, sample_indices=bad))
    # the batch API too: it collected every index of range(n) and raised KeyError after all the work was done
    got = engine.generate([GenerationRequest("gen", (5, 6, 7), params, n=5, sample_indices=(4, 1))])
    assert [(c.sample_index, c.token_ids) for c in got] == [(4, whole[4]), (1, whole[1])]
    with pytest.raises(ValueError, match="sample_indices"):  # checked whole: the good request is not left running
        engine.generate([GenerationRequest("ok", (5, 6, 7), params, n=2),
                         GenerationRequest("bad", (5, 6, 7), params, n=2, sample_indices=(2,))])
    assert not engine.has_unfinished()


def _wait(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _kill_after_first(s: ServerThread, c: RolloutClient, params: rollout_pb2.SamplingParams
                      ) -> tuple[list[rollout_pb2.Completion], int]:
    """Run the batch; SIGKILL the replica that produced its first completion (it still decodes the others of that
    request). Returns every completion and the killed replica's id."""
    stream = c.batch_generate(PROMPTS, n=N, params=params)
    first = next(stream)
    os.kill(s.server.replica_pids()[first.replica_id], signal.SIGKILL)
    return [first, *stream], first.replica_id


def _assert_each_once(outs: list[rollout_pb2.Completion]) -> None:
    got = Counter((o.prompt_index, o.sample_index) for o in outs)
    assert got == Counter((p, i) for p in range(len(PROMPTS)) for i in range(N)), got


def test_a_batch_whose_replica_dies_mid_flight_gets_every_completion_once(model_dir):
    with ServerThread(model_dir, replicas=2) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        outs, killed = _kill_after_first(s, c, SEEDED)
        _assert_each_once(outs)
        survivor = 1 - killed
        first = outs[0]
        mended = [o for o in outs if o.prompt_index == first.prompt_index and o.replica_id == survivor]
        assert mended, "no sample of the dead replica's request was re-dispatched (it finished before the kill?)"
        assert all(o.replica_id == survivor for o in outs if o.replica_id != killed)
        pool = s.server.pool
        assert pool.redispatches >= 1
        _wait(lambda: pool.pending_sequences == 0, "sequences still counted outstanding", 10)
        assert pool.replicas[survivor].outstanding == 0 and not pool._pending
        # what an operator sees: the death and the re-dispatches on /metrics (a counter each, not only the log)
        text = httpx.get(f"http://127.0.0.1:{s.server.http_port}/metrics", timeout=10).text
        assert f'rollout_replica_deaths_total{{replica="{killed}"}} 1.0' in text, text
        assert f"rollout_redispatched_requests_total {float(pool.redispatches)}" in text, text
        again = httpx.get(f"http://127.0.0.1:{s.server.http_port}/metrics", timeout=10).text  # not counted twice
        assert f'rollout_replica_deaths_total{{replica="{killed}"}} 1.0' in again
        # generated tokens: every completion's, and what the dead replica had generated of the samples it lost
        # (the survivor generated them again: the engines did that work twice); only completions were counted
        (generated,) = re.findall(r"^rollout_generated_tokens_total (\S+)$", again, re.M)
        assert float(generated) > sum(len(o.token_ids) for o in outs)
        assert float(generated) == pool.generated_tokens


def test_a_seeded_batch_gives_the_same_completions_whether_or_not_a_replica_died(model_dir):
    with ServerThread(model_dir, replicas=2) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        undisturbed = {(o.prompt_index, o.sample_index): list(o.token_ids)
                       for o in c.batch_generate(PROMPTS, n=N, params=SEEDED)}
        outs, killed = _kill_after_first(s, c, SEEDED)
        _assert_each_once(outs)
        assert {o.replica_id for o in outs} == {0, 1}
        assert {(o.prompt_index, o.sample_index): list(o.token_ids) for o in outs} == undisturbed


def test_with_redispatch_limit_0_a_dead_replicas_request_fails_as_before(model_dir):
    with ServerThread(model_dir, replicas=2, redispatch_limit=0) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c:
        with pytest.raises(grpc.RpcError) as err:
            _kill_after_first(s, c, SEEDED)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "died" in err.value.details(), err.value
        assert s.server.pool.redispatches == 0
        # a Generate alike: UNAVAILABLE (what a caller retries on), not INTERNAL or UNKNOWN
        pool, result = s.server.pool, {}

        def generate() -> None:
            try:
                result["outs"] = c.generate("1+2=", n=2, params=LONG)
            except grpc.RpcError as e:
                result["error"] = e

        t = threading.Thread(target=generate, daemon=True)
        t.start()
        _wait(lambda: any(r.outstanding for r in pool.replicas), "the Generate never reached a replica", 30)
        busy = next(i for i, r in enumerate(pool.replicas) if r.outstanding)
        os.kill(s.server.replica_pids()[busy], signal.SIGKILL)
        t.join(60)
        err = result.get("error")
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, result
        assert "died" in err.details(), err.details()


def _batch_in_thread(c: RolloutClient, params: rollout_pb2.SamplingParams) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["outs"] = list(c.batch_generate(PROMPTS[:2], n=N, params=params))
        except grpc.RpcError as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


LONG = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True, seed=5)


def test_with_no_other_replica_alive_the_request_waits_for_the_restarted_one(model_dir):
    with ServerThread(model_dir, replicas=1, max_restarts=1) as s, RolloutClient(s.grpc_address, timeout_s=120) as c:
        pool = s.server.pool
        t, result = _batch_in_thread(c, LONG)
        _wait(lambda: pool.replicas[0].outstanding > 0, "the batch never reached the replica", 30)
        os.kill(s.server.replica_pids()[0], signal.SIGKILL)
        t.join(120)
        assert "error" not in result, result.get("error")
        outs = result["outs"]
        got = Counter((o.prompt_index, o.sample_index) for o in outs)
        assert got == Counter((p, i) for p in range(2) for i in range(N)), got
        assert all(len(o.token_ids) == LONG.max_tokens for o in outs)
        assert pool.restarts == {0: 1} and pool.redispatches == 2  # both prompts' requests, once each


def test_a_request_is_redispatched_at_most_redispatch_limit_times(model_dir):
    with ServerThread(model_dir, replicas=1, max_restarts=2, redispatch_limit=1) as s, \
            RolloutClient(s.grpc_address, timeout_s=120) as c:
        pool = s.server.pool
        t, result = _batch_in_thread(c, LONG)
        _wait(lambda: pool.replicas[0].outstanding > 0, "the batch never reached the replica", 30)
        first = s.server.replica_pids()[0]
        os.kill(first, signal.SIGKILL)
        _wait(lambda: pool.redispatches >= 1 and pool.replicas[0].outstanding > 0, "not re-dispatched to the restart")
        os.kill(s.server.replica_pids()[0], signal.SIGKILL)
        t.join(60)
        err = result.get("error")
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, result
        assert "re-dispatched 1 time" in err.details() and "died" in err.details(), err.details()


def test_a_stream_that_already_sent_tokens_fails_as_before_instead_of_repeating_them(model_dir):
    with ServerThread(model_dir, replicas=2) as s:
        pool = s.server.pool
        body = {"model": s.model_name, "prompt": "1+2=", "max_tokens": 240, "n": 8, "ignore_eos": True,
                "temperature": 1.0, "stream": True}
        held: list[int] = []

        def holder_of_the_stream() -> int:
            held.append(next(r.replica_id for r in pool.replicas if r.outstanding > 0))
            return held[0]

        rest = stream_then_kill(s, body, holder_of_the_stream)
        holder = held[0]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        assert f"replica {holder} died" in rest[-2], rest[-2]
        assert pool.redispatches == 0
        _wait(lambda: pool.pending_sequences == 0, "sequences still counted outstanding", 10)


def test_a_client_gone_after_its_request_was_redispatched_aborts_it_on_the_new_replica(model_dir):
    with ServerThread(model_dir, replicas=2) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        pool = s.server.pool
        params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=240, ignore_eos=True)
        call = c.batch_generate(["1+2="], n=48, params=params)  # one request, on one replica
        _wait(lambda: any(rep.outstanding > 0 for rep in pool.replicas), "the request never reached a replica", 30)
        holder = next(rep.replica_id for rep in pool.replicas if rep.outstanding > 0)
        os.kill(s.server.replica_pids()[holder], signal.SIGKILL)
        other = pool.replicas[1 - holder]
        _wait(lambda: pool.redispatches == 1 and other.outstanding == 48, "not re-dispatched", 30)
        call.cancel()
        t0 = time.monotonic()
        # 48 sequences x 240 tokens take the replica seconds; an abort that reached it drops them at once
        _wait(lambda: other.outstanding == 0, "the re-dispatched request was not aborted on its new replica", 1.5)
        assert time.monotonic() - t0 < 1.5
        assert pool.pending_sequences == 0 and not pool._pending
        assert c.status().replicas[1 - holder].running == 0


def test_a_stalled_replicas_request_goes_on_on_the_other_replica(model_dir):
    """The stall watchdog kills a replica that hangs (here SIGSTOP): its request is re-dispatched like a dead
    replica's, and nothing the stopped process may still have in its pipe counts (only where a request is now).
    2 s, not 1: on a loaded 2-core machine the replica that took the request over went 1 s without a step and was
    killed too (past redispatch_limit = 1), which is the watchdog working, not this test's subject."""
    with ServerThread(model_dir, replicas=2, stall_timeout_s=2.0) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c:
        pool = s.server.pool
        t, result = _batch_in_thread(c, rollout_pb2.SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True))
        _wait(lambda: any(rep.outstanding > 0 for rep in pool.replicas), "the batch never reached a replica", 30)
        holder = next(rep.replica_id for rep in pool.replicas if rep.outstanding > 0)
        pid = s.server.replica_pids()[holder]
        os.kill(pid, signal.SIGSTOP)
        try:
            t.join(60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # reaped already: forked, its parent is the forkserver
                os.kill(pid, signal.SIGCONT)  # it was SIGKILLed by the watchdog; a SIGKILL pending lands now
        assert "error" not in result, result.get("error")
        got = Counter((o.prompt_index, o.sample_index) for o in result["outs"])
        assert got == Counter((p, i) for p in range(2) for i in range(N)), got
        assert pool.redispatches >= 1 and not pool.replicas[holder].alive
        assert "stalled" in pool.replicas[holder].error


def test_what_a_replica_counted_dead_still_sends_is_dropped(model_dir):
    """The watchdog (or an update timeout) counts a replica dead before its SIGKILL lands: its requests go on
    elsewhere at once, and whatever it still sends (steps, completions of the very samples re-dispatched) must
    reach nobody. Here the kill is held back (both replicas SIGSTOPped, the dead one's kill a no-op) and the dead
    replica is let run to its end before the other starts: each completion comes once, from the other replica, and
    the late tokens are neither counted nor taken off anyone's outstanding sequences."""
    with ServerThread(model_dir, replicas=2) as s, RolloutClient(s.grpc_address, timeout_s=120) as c:
        pool = s.server.pool
        params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
        outs: list = []
        t = threading.Thread(target=lambda: outs.extend(c.generate("1+2=", n=N, params=params)), daemon=True)
        pids = s.server.replica_pids()
        t.start()
        _wait(lambda: any(rep.outstanding == N for rep in pool.replicas), "the request never reached a replica", 30)
        dead = next(rep for rep in pool.replicas if rep.outstanding == N)
        other = pool.replicas[1 - dead.replica_id]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            dead.process.kill = lambda: None  # counted dead, its SIGKILL not landed yet

            async def count_it_dead() -> None:
                pool._kill(dead, "stalled (test): killed")

            s.call(count_it_dead())
            assert pool.redispatches == 1 and other.outstanding == N and dead.outstanding == 0
            generated = pool.generated_tokens
            since = time.monotonic()
            os.kill(pids[dead.replica_id], signal.SIGCONT)  # it runs its samples to their end and sends them
            _wait(lambda: dead.heard > since and time.monotonic() - dead.heard > 1.0, "the dead replica sent nothing")
            assert pool.generated_tokens == generated and dead.outstanding == 0 and not outs
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            os.kill(pids[dead.replica_id], signal.SIGKILL)
        t.join(120)
        assert sorted(o.sample_index for o in outs) == list(range(N)), outs
        assert {o.replica_id for o in outs} == {other.replica_id}
        _wait(lambda: pool.pending_sequences == 0 and other.outstanding == 0, "sequences still counted", 10)


def test_a_stream_redispatched_before_its_first_token_gets_no_step_of_the_dead_replica(model_dir):
    """A stream whose replica is counted dead before it sent a token goes on elsewhere; the steps the dead replica
    still sends (its kill not landed yet) must not reach it, or the client's text would mix two replicas' tokens.
    Both replicas are SIGSTOPped before the request arrives, so nothing is streamed before the re-dispatch."""
    import asyncio

    from tlt.services.rollout.types import CompletionOutput, GenerationRequest, SamplingParams, StepOutput

    with ServerThread(model_dir, replicas=2) as s:
        pool = s.server.pool
        pids = s.server.replica_pids()
        req = GenerationRequest("late-steps", (5, 6, 7), SamplingParams(temperature=1.0, max_tokens=20,
                                                                        ignore_eos=True), n=2)

        async def collect() -> list:
            return [ev async for ev in pool.generate(req, want_steps=True)]

        dead = None
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            fut = asyncio.run_coroutine_threadsafe(collect(), s.loop)
            _wait(lambda: any(rep.outstanding == 2 for rep in pool.replicas), "the request never reached a replica", 30)
            dead = next(rep for rep in pool.replicas if rep.outstanding == 2)
            other = pool.replicas[1 - dead.replica_id]
            dead.process.kill = lambda: None  # counted dead, its SIGKILL not landed yet

            async def count_it_dead() -> None:
                pool._kill(dead, "stalled (test): killed")

            s.call(count_it_dead())
            assert pool.redispatches == 1 and other.outstanding == 2
            since = time.monotonic()
            os.kill(pids[dead.replica_id], signal.SIGCONT)
            _wait(lambda: dead.heard > since and time.monotonic() - dead.heard > 1.0, "the dead replica sent nothing")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            if dead is not None:
                os.kill(pids[dead.replica_id], signal.SIGKILL)
        events = fut.result(120)
        done = {e.sample_index: e for e in events if isinstance(e, CompletionOutput)}
        assert sorted(done) == [0, 1] and {c.replica_id for c in done.values()} == {other.replica_id}
        for i, c in done.items():
            streamed = [t for e in events if isinstance(e, StepOutput) and e.sample_index == i for t in e.new_token_ids]
            assert streamed == list(c.token_ids), (i, streamed, c.token_ids)
