"""How a replica process starts (services/rollout/replica_start.py): forked from a forkserver that imported torch
and transformers once, where that gives the process a spawn would, and spawned otherwise.

Real rollout servers on 127.0.0.1 with a tiny random Qwen2 built in code, in a fresh interpreter (the
forkserver is one per process: in this one, earlier tests decided its environment); the replica's parent
process is read from /proc (Linux)."""

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
    monkeypatch.setenv("TLT_TEST_REPLICA_START", "changed")  # the forkserver started without it: spawn
    assert replica_context("native", "cpu", 1, spin_wait=False)[0].get_start_method() == "spawn"
    monkeypatch.delenv("TLT_TEST_REPLICA_START")
    assert replica_context("native", "cpu", 1, spin_wait=False)[0].get_start_method() == "forkserver"


def _parent(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after its closing parenthesis
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _serve(model_dir: Path) -> dict:
    """Whether a 1-replica server's replica is the front's child, greedy and seeded-sampled token ids, and whether
    the replica still counts as alive and serves after a SIGTERM to its parent (when that is not the front: the
    forkserver, which a signal to the process group reaches too)."""
    import signal
    import time

    from rollout_helpers import ServerThread

    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    with ServerThread(model_dir, replicas=1) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        replica = s.server.pool.replicas[0].process
        parent = _parent(replica.pid)
        greedy = c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=12, ignore_eos=True))
        sampled = c.generate("1+2=", n=2, params=rollout_pb2.SamplingParams(max_tokens=12, ignore_eos=True,
                                                                            temperature=1.0, seed=5))
        survived = True
        if parent != os.getpid():
            os.kill(parent, signal.SIGTERM)
            time.sleep(0.5)
            survived = replica.is_alive() and len(c.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=4))[0].token_ids) > 0
        return {"front_child": parent == os.getpid(), "tokens": [list(x.token_ids) for x in greedy + sampled],
                "survived_sigterm_to_forkserver": survived}


def _child(model_dir: str) -> None:
    """In a fresh interpreter: a server whose replica is forked, then one whose front's environment changed."""
    first = _serve(Path(model_dir))
    os.environ["TLT_TEST_REPLICA_START"] = "spawn"  # an environment the forkserver did not start with
    print(json.dumps({"forked": first, "spawned": _serve(Path(model_dir))}))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the replica's parent from /proc")
def test_a_forked_replica_serves_what_a_spawned_one_does(tmp_path):
    """A spawned replica imported torch and transformers itself (8 s of a core here, per replica and per
    restart); a forked one is a child of the forkserver, not of the front, and decodes the same tokens."""
    from rollout_helpers import tiny_checkpoint

    model_dir = tiny_checkpoint(tmp_path)
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}]\n"
            f"from test_replica_start import _child\n"
            f"if __name__ == '__main__':\n    _child({str(model_dir)!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "TLT_TEST_REPLICA_START"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not got["forked"]["front_child"], "the replica was spawned by the front, not forked from the forkserver"
    assert got["spawned"]["front_child"]
    assert got["forked"]["tokens"] == got["spawned"]["tokens"]
    # killed, the forkserver took its children's exit statuses with it: multiprocessing said the replica had exited
    assert got["forked"]["survived_sigterm_to_forkserver"]


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
