"""Load balancing across replicas: each request goes to the live replica with the fewest outstanding sequences,
ties broken round-robin (replicas.py, `ReplicaPool._pick`).

Nothing tested it: the pool's tests kill, restart and stop replicas, but all of them passed with every tie sent to
replica 0 (one replica did every sequential request while the other idled) and with the engines' reported running
counts in place of the pool's own (a replica whose steps had not reported yet looked empty, so a burst alternated
between a replica holding a big request and an idle one).

Real parts: the rollout server on 127.0.0.1 (two replica processes, native engine, real gRPC). Both replicas are
SIGSTOPped (processes this test started) while a burst arrives, so where it goes is read before any step reports.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("balance-model"))


def _wait(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_requests_go_to_the_replica_with_fewest_outstanding_sequences_and_ties_alternate(model_dir):
    params = rollout_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    with ServerThread(model_dir, replicas=2) as s, RolloutClient(s.grpc_address, timeout_s=120) as c:
        pool = s.server.pool
        # one at a time: every pick is a tie (nothing outstanding), so they alternate
        used = [o.replica_id for _ in range(4) for o in c.generate("1+2=", n=1, params=params)]
        assert sorted(used) == [0, 0, 1, 1], used

        pids = s.server.replica_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        outs: list = []
        try:
            big = threading.Thread(target=lambda: outs.extend(c.generate("7*3=", n=4, params=params)))
            big.start()
            _wait(lambda: pool.pending_sequences == 4, "the n=4 request never reached a replica")
            (loaded,) = [r.replica_id for r in pool.replicas if r.outstanding == 4]
            small = threading.Thread(target=lambda: outs.extend(
                c.batch_generate(["1+1=", "2+2=", "3+3="], n=1, params=params)))
            small.start()
            _wait(lambda: pool.pending_sequences == 7, "the three small requests never reached a replica")
            # the stopped replicas reported no step: only the pool's own counts tell the loaded one from the other
            assert [r.outstanding for r in pool.replicas] == [4 if r.replica_id == loaded else 3 for r in pool.replicas]
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        big.join(120)
        small.join(120)
        assert len(outs) == 7 and all(len(o.token_ids) == 8 for o in outs)
        _wait(lambda: pool.pending_sequences == 0, "sequences still counted outstanding", 10)
