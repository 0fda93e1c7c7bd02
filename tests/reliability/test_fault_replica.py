"""kill -9 of a rollout replica: the pool restarts it and replays the latest policy AND drafter before it serves.

A real rollout server (2 real replica processes with the native engine, a
learned EAGLE drafter folder, real grpc.aio) on 127.0.0.1. The test pushes a
new policy (v1: a perturbed lm_head, so greedy text changes) and a new
drafter (v1), then SIGKILLs replica 0 by the pid the server reports (a
process this test started). Checked:

- requests keep being served by the live replica while replica 0 is down
  (a request that was on the killed replica is re-dispatched to it, or fails with UNAVAILABLE; none other);
- the replacement gets a new pid, and is routed to only once its versions
  equal the pool's (policy 1, drafter 1) — GetStatus shows them per replica;
- greedy tokens from BOTH replicas afterwards equal the v1 tokens (the replay
  applied the pushed weights, not the model folder's).
"""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest
import safetensors.torch
import torch
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import common_pb2, rollout_pb2

pytestmark = pytest.mark.slow

GREEDY = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["1+2=", "7*3=", "12-5=", "4+4="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("fault-model"))


def _replicas(client) -> dict[int, rollout_pb2.ReplicaStatus]:
    return {r.replica_id: r for r in client.status().replicas}


def test_killed_replica_is_restarted_and_resynced(model_dir, tmp_path):
    from tlt.model.drafter import Drafter, DrafterConfig

    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    cfg = DrafterConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    torch.manual_seed(3)
    Drafter(cfg, weights["model.embed_tokens.weight"], weights["lm_head.weight"]).save(tmp_path / "drafter")
    spec = {"mode": "adaptive", "drafter": "learned", "drafter_path": str(tmp_path / "drafter")}
    with ServerThread(model_dir, replicas=2, spec=spec, max_restarts=2) as s, RolloutClient(s.grpc_address, timeout_s=120) as c:
        before = [list(c.generate(p, params=GREEDY)[0].token_ids) for p in PROMPTS]
        torch.manual_seed(7)
        policy = {"lm_head.weight": weights["lm_head.weight"] + 0.5 * torch.randn_like(weights["lm_head.weight"])}
        assert c.update_weights(policy, "policy", 1).ok
        torch.manual_seed(4)
        own = Drafter(cfg, weights["model.embed_tokens.weight"], weights["lm_head.weight"]).state_dict()
        assert c.update_weights(own, "drafter", 1).ok
        v1 = [list(c.generate(p, params=GREEDY)[0].token_ids) for p in PROMPTS]
        assert v1 != before  # the push changed the policy, so a replica on the folder's weights would show

        old_pid = s.server.replica_pids()[0]
        os.kill(old_pid, signal.SIGKILL)
        t_kill = time.monotonic()
        served, failed, down_states = 0, [], set()
        while True:  # traffic during the outage: served by replica 1, or a clear UNAVAILABLE
            try:
                outs = c.generate(PROMPTS[served % 4], params=GREEDY)
                assert list(outs[0].token_ids) == v1[served % 4]
                served += 1
            except grpc.RpcError as e:
                failed.append(e.code())
            reps = _replicas(c)
            if not reps[0].alive:
                down_states.add(reps[0].state)
            if reps[0].alive and s.server.replica_pids()[0] != old_pid:
                break
            assert time.monotonic() - t_kill < 240, "replica 0 was not restarted"
        down_s = time.monotonic() - t_kill
        assert set(failed) <= {grpc.StatusCode.UNAVAILABLE}, failed
        assert down_states == {common_pb2.REPLICA_STATE_DRAINING}, down_states  # GetStatus says so while it is down
        assert served > 0
        reps = _replicas(c)
        for r in reps.values():
            assert r.alive and (r.versions.policy, r.versions.drafter) == (1, 1), r
        assert s.server.pool.restarts == {0: 1}

        # both replicas serve v1: concurrent requests spread over them (least-loaded routing)
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda p: c.generate(p, params=GREEDY)[0], PROMPTS * 4))
        assert {o.replica_id for o in outs} == {0, 1}
        for o, p in zip(outs, PROMPTS * 4):
            assert list(o.token_ids) == v1[PROMPTS.index(p)], o.replica_id
            assert (o.versions.policy, o.versions.drafter) == (1, 1)
        print(f"replica 0 back and re-synced {down_s:.1f}s after kill -9; {served} requests served meanwhile, "
              f"{len(failed)} UNAVAILABLE")
