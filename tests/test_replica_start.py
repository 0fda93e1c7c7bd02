"""How a replica process starts (services/rollout/replica_start.py): forked from a forkserver that imported torch
and transformers once, where that gives the process a spawn would, and spawned otherwise.

Real rollout servers on 127.0.0.1 with a tiny random Qwen2 built in code, in a fresh interpreter (the
forkserver is one per process: in this one, earlier tests decided its environment); the replica's parent
process and its threads' CPU time are read from /proc (Linux)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tlt.services.rollout import replica_start
from tlt.services.rollout.replica_start import replica_context

TESTS = Path(__file__).parent


def test_only_a_cpu_native_replica_without_a_spin_count_is_forked_and_only_in_the_forkservers_environment(
        monkeypatch):
    monkeypatch.setattr(replica_start, "_forkserver_env", replica_start.current_env())  # as if it started now
    monkeypatch.setattr(replica_start, "_forkserver_state", replica_start.process_state())
    assert replica_context("native", "cpu", 1, spin_wait=True)[1]  # one thread: a spin count does nothing
    assert replica_context("native", "cpu", 4, spin_wait=False)[1]
    assert not replica_context("native", "cpu", 2, spin_wait=True)[1]  # libgomp read GOMP_SPINCOUNT in the server
    assert not replica_context("native", "cuda:0", 1, spin_wait=False)[1]
    assert not replica_context("sglang", "cpu", 1, spin_wait=False)[1]
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # read by nothing at import: still forked
    assert replica_context("native", "cpu", 1, spin_wait=False)[1]
    # what `import deepspeed` sets (a trainer in the front's process): once made every later start a spawn
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "changed")
    assert replica_context("native", "cpu", 1, spin_wait=False)[0].get_start_method() == "forkserver"
    monkeypatch.setenv("TLT_TEST_REPLICA_START", "changed")  # the forkserver started without it: spawn
    assert replica_context("native", "cpu", 1, spin_wait=False)[0].get_start_method() == "spawn"
    monkeypatch.delenv("TLT_TEST_REPLICA_START")
    assert replica_context("native", "cpu", 1, spin_wait=False)[0].get_start_method() == "forkserver"


def test_a_front_whose_stderr_or_affinity_moved_since_the_forkserver_started_spawns(monkeypatch, tmp_path):
    """A fork keeps the forkserver's CPU affinity and standard output and error, not the front's: a front that
    redirected its stderr (to a log file) or was pinned to other cores after the forkserver started must spawn, or
    its replicas log to the old file and run on the old cores."""
    state = replica_start.process_state()
    monkeypatch.setattr(replica_start, "_forkserver_env", replica_start.current_env())
    monkeypatch.setattr(replica_start, "_forkserver_state", state)
    assert replica_context("native", "cpu", 1, spin_wait=False)[1]
    saved = os.dup(2)
    try:
        with open(tmp_path / "front.err", "w") as err:
            os.dup2(err.fileno(), 2)  # the front's stderr now goes to a file the forkserver never had
            moved = replica_start.process_state()
            forked = replica_context("native", "cpu", 1, spin_wait=False)[1]
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert moved[2] != state[2] and moved[:2] == state[:2], (moved, state)
    assert not forked, "a front whose stderr moved forked a replica that writes to the old one"
    monkeypatch.setattr(replica_start, "_forkserver_state", ((-1,), *state[1:]))  # other cores than the front's
    assert not replica_context("native", "cpu", 1, spin_wait=False)[1]


def test_warm_starts_the_forkserver_and_leaves_a_spawn_context_alone():
    """`warm` runs the forkserver's first start (its preload imports torch: seconds) off the front's event loop; had
    it not started it, the first replica's start would, on the loop. In a fresh interpreter: nothing runs one yet."""
    code = ("import multiprocessing as mp\n"
            "from multiprocessing import forkserver\n"
            "from tlt.services.rollout.replica_start import warm\n"
            "warm(mp.get_context('spawn'))\n"
            "print(forkserver._forkserver._forkserver_pid is not None)\n"
            "warm(mp.get_context('forkserver'))\n"
            "print(forkserver._forkserver._forkserver_pid is not None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True"], out.stdout


def _parent(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its closing parenthesis
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cpu_ns(pid: int) -> dict[int, int]:
    """CPU time in ns of each thread of process `pid`: /proc/PID/task/TID/schedstat, else utime + stime of its
    stat (clock ticks: a thread that ran for less than a tick between two of them may show none)."""
    out = {}
    schedstat, tick_ns = Path("/proc/self/schedstat").exists(), 10**9 // os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if schedstat:
                out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            else:
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[11]) + int(fields[12])) * tick_ns
        except OSError:  # a thread that ended meanwhile
            continue
    return out


def _serve_threads(model_dir: Path, threads: int) -> dict:
    """A 1-replica server with `threads` torch threads per replica and spin_wait off: whether the replica is the
    front's child (a spawned replica imported torch and transformers itself, 8 s of a core here per replica and
    per restart; a forked one is a child of the forkserver), its pid, how many threads its parent runs, greedy and seeded-sampled token ids, and how many of
    the replica's threads ran for at least 1 ms during a generation (the main thread and the OpenMP workers that
    share each parallel kernel: about 5% of the main thread's time each here, one wake-up per kernel)."""
    import signal
    import time

    from rollout_helpers import ServerThread

    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    with ServerThread(model_dir, replicas=1, threads_per_replica=threads, spin_wait=False) as s, \
            RolloutClient(s.grpc_address, timeout_s=120) as c:
        pid = s.server.pool.replicas[0].process.pid
        parent = _parent(pid)
        greedy = c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=12, ignore_eos=True))
        before = _cpu_ns(pid)
        sampled = c.generate("1+2=" * 30, n=8, params=rollout_pb2.SamplingParams(max_tokens=32, ignore_eos=True,
                                                                                 temperature=1.0, seed=5))
        ran = {tid: t - before.get(tid, 0) for tid, t in _cpu_ns(pid).items()}
        got = {"front_child": parent == os.getpid(), "pid": pid,
               "parent_threads": len(os.listdir(f"/proc/{parent}/task")),
               "tokens": [list(x.token_ids) for x in greedy + sampled],
               "busy_threads": sum(1 for t in ran.values() if t >= 1_000_000),
               "cpu_ms": sorted((round(t / 1e6, 1) for t in ran.values()), reverse=True)}
        survived = True  # a SIGTERM to the forkserver (a signal to the process group reaches it too)
        if parent != os.getpid():
            replica = s.server.pool.replicas[0].process
            os.kill(parent, signal.SIGTERM)
            time.sleep(0.5)
            survived = replica.is_alive() and len(c.generate("1+2=", params=rollout_pb2.SamplingParams(
                max_tokens=4))[0].token_ids) > 0
        return {**got, "survived_sigterm_to_forkserver": survived}


def _child_threads(model_dir: str, threads: int) -> None:
    """In a fresh interpreter: a multi-thread replica forked, then one spawned (the front's environment changed)."""
    first = _serve_threads(Path(model_dir), threads)
    os.environ["TLT_TEST_REPLICA_START"] = "spawn"
    print(json.dumps({"forked": first, "spawned": _serve_threads(Path(model_dir), threads)}))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the replica's threads from /proc")
def test_a_forked_multi_thread_replica_runs_its_torch_threads(tmp_path):
    """threads_per_replica=2 without a spin count is forked too. libgomp is not fork-safe: had the forkserver run
    one parallel kernel before it forked (its pool started), a replica's first parallel kernel would wait forever
    for pool threads the fork did not copy (a fork copies only the calling thread). The forkserver must have
    imported torch without starting a pool, and the replica must set and use its own: torch reports its 2
    threads (the `replica_ready` log line), 2 of its threads share the work of a generation, and it decodes
    what a spawned replica does."""
    import re

    from rollout_helpers import tiny_checkpoint

    threads = 2
    model_dir = tiny_checkpoint(tmp_path)
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}]\n"
            f"from test_replica_start import _child_threads\n"
            f"if __name__ == '__main__':\n    _child_threads({str(model_dir)!r}, {threads})\n")
    env = {k: v for k, v in os.environ.items() if k != "TLT_TEST_REPLICA_START"}
    env["TLT_LOG_JSON"] = "1"  # the replicas' replica_ready lines, read below
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"a server with {threads}-thread replicas hung:\n{err[-3000:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    forked, spawned = got["forked"], got["spawned"]
    assert not forked["front_child"], "the replica was spawned by the front, not forked from the forkserver"
    assert spawned["front_child"]
    # a fork copies only the calling thread: a forkserver with more (an OpenMP pool) hands replicas a stale one
    assert forked["parent_threads"] == 1, f"the forkserver runs {forked['parent_threads']} threads"
    # torch.get_num_threads() in each replica, from its replica_ready line (searched in the whole text: the
    # processes share the pipe, and a line of another may have been written without its end before it)
    ready = {int(pid): int(n) for pid, n in
             re.findall(r'"pid": (\d+), "threads": (\d+), [^{}]*"event": "replica_ready"', out.stderr)}
    assert ready.get(forked["pid"]) == threads, (ready, out.stderr[-3000:])
    assert ready.get(spawned["pid"]) == threads, (ready, out.stderr[-3000:])
    assert forked["busy_threads"] >= threads, forked  # one busy thread: torch's kernels ran on one thread
    assert spawned["busy_threads"] >= threads, spawned
    assert forked["tokens"] == spawned["tokens"]
    # killed, the forkserver took its children's exit statuses with it: multiprocessing said the replica had exited
    assert forked["survived_sigterm_to_forkserver"]


def test_a_replica_the_forkserver_cannot_start_is_spawned(tmp_path, monkeypatch):
    """A forkserver that died or could not start fails the fork with EOFError: the replica is spawned instead,
    and the server serves."""
    import multiprocessing as mp
    from multiprocessing import popen_forkserver

    from rollout_helpers import ServerThread, tiny_checkpoint

    from tlt.services.rollout import replica_lifecycle
    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    def broken(self, process_obj):  # noqa: ANN001, ANN202
        raise EOFError("(test) the forkserver is gone")

    monkeypatch.setattr(popen_forkserver.Popen, "_launch", broken)
    monkeypatch.setattr(replica_lifecycle, "replica_context", lambda *a: (mp.get_context("forkserver"), True))
    monkeypatch.setattr(replica_lifecycle, "warm", lambda ctx: None)
    with ServerThread(tiny_checkpoint(tmp_path), replicas=1) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        assert _parent(s.server.pool.replicas[0].process.pid) == os.getpid()  # spawned by the front
        assert len(c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=4))[0].token_ids) > 0
