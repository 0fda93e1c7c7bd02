"""What the replica lifecycle (services/rollout/replica_lifecycle.py) kills, and when: cases the restart tests
(tests/test_rollout_restarts.py) did not pin, found by session 55's mutation audit.

A real rollout server (real replica processes with the native engine, real grpc.aio) on 127.0.0.1; the tests SIGSTOP a
replica by the pid the server reports (a process this test started) to make it hang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import grpc
import pytest
from rollout_helpers import ServerThread, pid_gone, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("lifecycle-model"))


def test_a_stalled_replica_that_is_not_restarted_is_killed_all_the_same(model_dir):
    """The stall watchdog SIGKILLs a hung replica itself. With a restart coming, the restart's `exit_grace_s` kill
    would hide a watchdog that only declared it dead; with max_restarts=0 nothing else kills it, and a hung process
    that keeps its memory (a GPU's, in service) for the server's lifetime is what the kill is for."""
    with ServerThread(model_dir, replicas=1, max_restarts=0, stall_timeout_s=1.5, redispatch_limit=0) as s, \
            RolloutClient(s.grpc_address, timeout_s=30) as c:
        old = s.server.replica_pids()[0]
        os.kill(old, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as err:
                list(c.batch_generate(["2+2="], n=2, params=rollout_pb2.SamplingParams(max_tokens=4)))
            assert "stalled" in err.value.details(), err.value
            deadline = time.monotonic() + 10
            while not pid_gone(old) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pid_gone(old), "the stalled replica's process was declared dead but left running (stopped)"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGCONT)
