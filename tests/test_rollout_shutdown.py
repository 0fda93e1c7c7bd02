"""Stopping `tlt rollout serve` (SIGTERM): requests in flight end clearly and at once, and every process exits.

Real parts: `tlt rollout serve` as a subprocess with two replica processes running the native engine on a
tiny random checkpoint, httpx and the real gRPC client on 127.0.0.1. Nothing is faked.

The requests are long (n=64 x 200 tokens, at most 4 sequences decoded at a time per replica), so they are
still decoding when the SIGTERM arrives: each must get the shutdown's error in its protocol's shape (HTTP 503
in the OpenAI error shape, an SSE error chunk then `[DONE]`, gRPC UNAVAILABLE), not a connection cut after
the HTTP server's grace period (a plain-text 500, a stream with no `[DONE]`).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import grpc
import httpx
import psutil
import pytest

from rollout_helpers import ServeProcess, assert_all_gone, tiny_checkpoint
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2

LONG = {"prompt": "1+2=", "max_tokens": 200, "ignore_eos": True, "n": 64, "temperature": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("shutdown-model"))


@pytest.fixture(scope="module")
def serving(model_dir, tmp_path_factory):
    """The running 2-replica server (at most 4 sequences decoded at a time per replica), started again only when an
    earlier test ended it: the hung-front test pauses and resumes it, the SIGTERM test ends it (one start less)."""
    started: list[ServeProcess] = []

    def get() -> ServeProcess:
        if not started or started[-1].proc.poll() is not None:
            started.append(ServeProcess(model_dir, tmp_path_factory.mktemp("serve"), replicas=2,
                                        extra=("--set", "engine.max_num_seqs=4")).__enter__())
        return started[-1]

    yield get
    for s in started:
        s.__exit__()


def test_a_call_to_a_rollout_server_that_hangs_ends_instead_of_waiting_forever(serving):
    """A hung rollout front (a deadlock, a frozen cgroup; here SIGSTOP) keeps its TCP connection open: a trainer's
    rollout call (no deadline) waited for it forever while `tlt run` saw every process alive. The client pings the
    connection while a call runs; an unanswered ping ends the call with UNAVAILABLE (pings every 1 s, 2 s to answer,
    here; 30 s / 30 s by default). The front is resumed after: the SIGTERM test below stops the same server."""
    import os
    import signal

    s = serving()
    address = f"127.0.0.1:{s.info['grpc_port']}"
    params = rollout_pb2.SamplingParams(max_tokens=4)
    with RolloutClient(address, keepalive_s=(1.0, 2.0)) as c:
        assert len(list(c.batch_generate(["1+1="], n=2, params=params))) == 2  # pings of a live server: fine
        time.sleep(3.0)  # idle: no pings (none without a call), nothing breaks
        assert len(list(c.batch_generate(["2+2="], n=2, params=params))) == 2
        os.kill(s.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(c.batch_generate(["3+3="], n=2, params=params))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert time.monotonic() - t0 < 20  # grpc's own ping timeout was 60 s
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)


def test_sigterm_fails_requests_in_flight_clearly_and_exits(model_dir, serving):
    results: dict = {}
    s = serving()
    body = {"model": model_dir.name, **LONG}
    grpc_address = f"127.0.0.1:{s.info['grpc_port']}"
    children = [p.pid for p in psutil.Process(s.proc.pid).children(recursive=True)]

    def http() -> None:
        r = httpx.post(f"{s.base_url}/completions", json=body, timeout=60)
        results["http"] = (r.status_code, r.headers.get("content-type", ""), r.text)

    def batch() -> None:
        with RolloutClient(grpc_address, timeout_s=60) as c:
            try:
                results["grpc"] = len(list(c.batch_generate(["3*4="], n=64, params=rollout_pb2.SamplingParams(
                    max_tokens=200, ignore_eos=True, temperature=1.0))))
            except grpc.RpcError as e:
                results["grpc"] = (e.code(), e.details())

    threads = [threading.Thread(target=http), threading.Thread(target=batch)]
    with httpx.stream("POST", f"{s.base_url}/completions", json={**body, "stream": True}, timeout=60) as r, \
            RolloutClient(grpc_address, timeout_s=10) as status:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: {") and "error" not in first, first
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20  # both others counted in (the stream still holds some)
        while sum(x.running + x.queued for x in status.status().replicas) <= 2 * 64:
            assert time.monotonic() < deadline, status.status()
            time.sleep(0.05)
        t_term = time.monotonic()
        s.proc.terminate()
        rest = [line for line in lines if line]
    for t in threads:
        t.join(30)
    s.proc.wait(30)
    took = time.monotonic() - t_term

    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"] and (error["type"], error["code"]) == ("server_error", "unavailable")
    status, content_type, text = results["http"]
    assert status == 503 and content_type.startswith("application/json"), (status, text[:300])
    error = json.loads(text)["error"]
    assert "shutting down" in error["message"] and error["code"] == "unavailable", error
    code, details = results["grpc"]
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details, results["grpc"]
    assert s.proc.returncode == 0
    assert_all_gone(children)  # the replicas are joined before exit; multiprocessing's resource tracker follows
    assert took < 20, f"shutdown took {took:.1f}s"


def test_sigterm_while_the_replicas_load_stops_at_once(model_dir, tmp_path):
    """A SIGTERM during startup stops the server then: no ready file (nothing to connect to), replicas gone (killed:
    a replica reads the Shutdown only once its model is loaded), and no asyncio error in the log."""
    ready, log = tmp_path / "ready.json", tmp_path / "serve.log"
    serve = ServeProcess(model_dir, tmp_path, replicas=2)
    with log.open("w") as out:
        proc = subprocess.Popen(serve.cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        children: list[int] = []
        while "replicas_starting" not in log.read_text() or len(children) < 3:  # signal handlers in place, and
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]  # the 2 replicas
            time.sleep(0.02)  # and multiprocessing's resource tracker spawned (they take seconds to load)
            children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not ready.exists(), "a ready file was written by a server told to stop while it started"
    text = log.read_text()
    assert "rollout_serving" not in text
    assert "Traceback" not in text and "never retrieved" not in text, text[-3000:]
    assert children
    assert_all_gone(children)


def test_a_signal_to_the_whole_process_group_stops_the_replicas_through_the_front(model_dir, tmp_path):
    """`tlt run` stops a service with SIGTERM to its process group, and Ctrl-C in a terminal sends SIGINT to the
    foreground group: the replicas got the signal too, died before the front began its stop, and every normal
    stop was logged as `replica_dead` (an error). They ignore both now; the front shuts them down."""
    import os
    import signal

    # one server per signal, both at once: a start is mostly one core's imports, and the machine has two
    sigs = (signal.SIGTERM, signal.SIGINT)
    serves = {sig: ServeProcess(model_dir, tmp_path / sig.name, replicas=2) for sig in sigs}
    procs: dict = {}
    try:
        for sig, serve in serves.items():
            serve.log_file.parent.mkdir()
            with serve.log_file.open("w") as out:
                procs[sig] = subprocess.Popen(serve.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        for sig, serve in serves.items():
            while not serve.ready_file.exists():
                assert procs[sig].poll() is None and time.monotonic() < deadline, serve.log_file.read_text()[-3000:]
                time.sleep(0.05)
        children = {sig: [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
                    for sig, proc in procs.items()}
        for sig, proc in procs.items():
            os.killpg(proc.pid, sig)
        for sig, proc in procs.items():
            assert proc.wait(60) == 0, (sig.name, serves[sig].log_file.read_text()[-3000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    for sig, serve in serves.items():
        text = serve.log_file.read_text()
        assert "replica_dead" not in text and "Traceback" not in text, (sig.name, text[-3000:])
        assert text.count("replica_stopped") == 2, (sig.name, text[-3000:])
        assert_all_gone(children[sig])


def test_a_front_tokenizer_that_fails_while_the_replicas_load_stops_them(random_model_dir, monkeypatch):
    """The front loads its tokenizer on a thread while the replicas load (their start overlaps the front's 3 s of
    imports). When that load fails, start() raises its error, not a later one, and stop() ends the replicas that
    were loading."""
    from rollout_helpers import ServerThread
    from tlt.services.rollout import server as server_mod

    def fails(model_dir: str) -> None:
        time.sleep(0.5)  # the replicas are spawned and loading
        raise OSError("(test) the front could not read the tokenizer")

    monkeypatch.setattr(server_mod, "_front_tokenizer", fails)
    st = ServerThread(random_model_dir, replicas=2)
    try:
        with pytest.raises(OSError, match=r"\(test\) the front could not read"):
            st.__enter__()
        pids = st.server.replica_pids()
        assert len(pids) == 2  # spawned before the tokenizer failed
    finally:
        st.__exit__(None, None, None)
    assert_all_gone(pids)


def test_a_front_tokenizer_that_fails_ends_the_start_without_waiting_for_the_replicas(tmp_path, monkeypatch):
    """start() raises the tokenizer's error at once, cancelling the replicas' start: it had waited for every replica
    to finish loading (minutes for a large model on a GPU) before it said why it could not serve. Here the replicas'
    start never ends on its own."""
    import asyncio

    from rollout_helpers import rollout_config, tiny_checkpoint
    from tlt.services.rollout import replicas as replicas_mod
    from tlt.services.rollout import server as server_mod

    cancelled: list[bool] = []

    async def loads_for_ever(self, timeout_s: float) -> None:  # noqa: ANN001
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    def fails(model_dir: str) -> None:
        raise OSError("(test) the front could not read the tokenizer")

    monkeypatch.setattr(replicas_mod.ReplicaPool, "start", loads_for_ever)
    monkeypatch.setattr(replicas_mod.ReplicaPool, "stop", lambda self: asyncio.sleep(0))
    monkeypatch.setattr(server_mod, "_front_tokenizer", fails)
    server = server_mod.RolloutServer(tiny_checkpoint(tmp_path / "m"), rollout_config(replicas=1))

    async def start_then_stop() -> None:
        try:
            await asyncio.wait_for(server.start(), 30)
        finally:
            await server.stop()

    with pytest.raises(OSError, match=r"\(test\) the front could not read"):
        asyncio.run(start_then_stop())
    assert cancelled == [True]
