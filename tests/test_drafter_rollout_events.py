"""The rollout side of the spot trainer, on a real server (real replica processes, real gRPC, real
ZeroMQ on 127.0.0.1): capacity events (IDLE at start, BUSY while a replica has work, IDLE again,
heartbeats, a late subscriber's snapshot) and drafter features of finished sequences (fp16,
post-norm, tagged with the policy version; stripped from completions that did not ask; a missing
consumer drops and counts, never blocks)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.common.events import CapacitySubscriber, FeaturePuller
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import common_pb2, rollout_pb2

BUSY, IDLE = common_pb2.REPLICA_STATE_BUSY, common_pb2.REPLICA_STATE_IDLE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("m"))


def test_capacity_events_and_features(model_dir) -> None:
    puller = FeaturePuller("tcp://127.0.0.1:*")
    with ServerThread(model_dir, replicas=2, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.3,
                      features_push=puller.endpoint) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        snap = sub.snapshot()
        assert sorted(e.replica_id for e in snap) == [0, 1] and all(e.state == IDLE for e in snap)
        with RolloutClient(s.grpc_address) as client:
            params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=24, seed=3)
            done = list(client.batch_generate(["1+2=", "3*4=", "5-1=", "7+7="], n=2, params=params))
        assert len(done) == 8 and all(not c.features for c in done)  # nobody asked for features
        seen: list = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            e = sub.recv(0.5)
            if e is not None:
                seen.append(e)
            last = {e.replica_id: e.state for e in seen if not e.heartbeat}
            beats = {e.replica_id for e in seen if e.heartbeat}
            busied = {e.replica_id for e in seen if e.state == BUSY}
            if beats == busied == {0, 1} and set(last.values()) == {IDLE}:
                break
        changes = [(e.replica_id, e.state) for e in seen if not e.heartbeat]
        for r in (0, 1):
            mine = [st for rid, st in changes if rid == r]
            assert mine[:1] == [BUSY] and mine[-1] == IDLE, (r, mine)
        assert all(e.state == IDLE for e in sub.snapshot())
        sub.close()
        got = []
        deadline = time.monotonic() + 10
        while sum(len(b.sequences) for b in got) < 8 and time.monotonic() < deadline:
            b = puller.recv(0.5)
            if b is not None:
                got.append(b)
        seqs = [q for b in got for q in b.sequences]
        assert len(seqs) == 8 and all(b.source == "rollout" for b in got)
        by_id = {c.request_id + "/" + str(c.sample_index): c for c in done}
        for q in seqs:
            f = np.frombuffer(q.features, np.float16).reshape(len(q.token_ids), q.hidden_size)
            assert q.hidden_size == 64 and np.isfinite(f).all()
            assert q.response_start == 1 and q.policy_version == 0
            c = by_id.get(q.seq_id)
            assert c is not None, q.seq_id
            assert list(q.token_ids[1:]) == list(c.token_ids[: len(q.token_ids) - 1])
        stats = s.call(s.server.pool.snapshot())
        assert all(x.stats.features_dropped == 0 for x in stats)
    puller.close()


def test_features_with_no_consumer_are_dropped_and_counted(model_dir) -> None:
    with ServerThread(model_dir, replicas=1, features_push="tcp://127.0.0.1:1") as s:  # nobody listens there
        with RolloutClient(s.grpc_address) as client:
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=8)
            done = list(client.batch_generate(["1+1=", "2+2="], n=2, params=params))
        assert len(done) == 4
        stats = s.call(s.server.pool.snapshot())
        assert stats[0].stats.features_dropped == 4


def test_a_policy_push_makes_every_replica_busy_while_it_is_applied(model_dir) -> None:
    """Copying new weights in is work on the replica's device: drafter workers must not train meanwhile."""
    import safetensors.torch

    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    with ServerThread(model_dir, replicas=2, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.3) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert all(e.state == IDLE for e in sub.snapshot())
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            assert client.update_weights(weights, "policy", 1).ok
        seen: list = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            e = sub.recv(0.5)
            if e is not None and not e.heartbeat:
                seen.append((e.replica_id, e.state, e.versions.policy))
            if sorted(r for r, st, _ in seen if st == IDLE) == [0, 1]:
                break
        for r in (0, 1):
            mine = [(st, v) for rid, st, v in seen if rid == r]
            # BUSY before the apply (old version), IDLE after it, carrying the new version
            assert mine == [(BUSY, 0), (IDLE, 1)], (r, mine)
        sub.close()
