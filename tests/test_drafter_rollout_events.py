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



def _events_until(sub, done, timeout_s: float) -> list:  # noqa: ANN001
    """Capacity events received until done(events so far) holds after an arrival, or the timeout."""
    seen: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        e = sub.recv(0.5)
        if e is not None:
            seen.append(e)
            if done(seen):
                break
    return seen

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

        def settled(seen: list) -> bool:
            last = {e.replica_id: e.state for e in seen if not e.heartbeat}
            beats = {e.replica_id for e in seen if e.heartbeat}
            busied = {e.replica_id for e in seen if e.state == BUSY}
            return beats == busied == {0, 1} and set(last.values()) == {IDLE}

        seen = _events_until(sub, settled, 10)
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


def test_capacity_events_carry_the_current_counts(model_dir) -> None:
    """BUSY says how many sequences the replica holds (not 0), and the count follows the work while it stays
    BUSY: heartbeats and the snapshot repeat the latest count, never the one of the first submission."""
    import threading

    with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.2) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert [e.state for e in sub.snapshot()] == [IDLE]
        done: list = []

        def run() -> None:
            with RolloutClient(s.grpc_address) as client:
                params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=5)
                done.extend(client.batch_generate(["1+2=", "3*4=", "5-1="], n=2, params=params))

        t = threading.Thread(target=run)
        t.start()
        seen = _events_until(sub, lambda seen: seen[-1].state == IDLE and not seen[-1].heartbeat
                             and any(x.state == BUSY for x in seen), 30)
        t.join(30)
        assert len(done) == 6
        busy = [e for e in seen if e.state == BUSY]
        assert busy and all(e.running >= 1 for e in busy), [(e.heartbeat, e.running) for e in busy]
        assert max(e.running for e in busy) == 6, [(e.heartbeat, e.running) for e in busy]
        assert seen[-1].running == 0
        assert [(e.state, e.running) for e in sub.snapshot()] == [(IDLE, 0)]
        sub.close()


def test_features_of_a_sequence_spanning_a_policy_push_come_from_the_version_they_are_tagged_with(model_dir) -> None:
    """A policy push lands between two steps of a running sequence (ReplicaLoop with a real engine, features
    PUSHed over 127.0.0.1). The pushed window must hold only rows computed by the policy version it names:
    compared with a transformers forward (last hidden state, post-norm) of that version's weights."""
    import multiprocessing as mp
    import threading

    import safetensors.torch
    import torch
    import transformers

    from tlt.services.common.weights import pack_state_dict
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.features import FeaturePublisher
    from tlt.services.rollout.ipc import AddRequest, ApplyWeights, Reply, Shutdown, StepEvents
    from tlt.services.rollout.replica import ReplicaLoop
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    puller = FeaturePuller("tcp://127.0.0.1:*")
    engine = LLMEngine(model_dir, EngineConfig(max_model_len=256, block_size=16))
    front, back = mp.Pipe()
    loop = ReplicaLoop(engine, back, 0, FeaturePublisher(puller.endpoint, 0))
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        prompt = (5, 6, 7, 8, 9, 10)
        front.send(AddRequest(GenerationRequest("a", prompt, SamplingParams(temperature=0.0, max_tokens=150,
                                                                            ignore_eos=True))))
        weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
        new_norm = weights["model.norm.weight"] * 2  # version 1: every post-norm feature doubles
        manifest, payload = pack_state_dict({"model.norm.weight": new_norm}, common_pb2.WEIGHT_KIND_POLICY, 1)
        emitted, pushed, done, applied = 0, False, [], None
        while not (done and applied):
            assert front.poll(30)
            ev = front.recv()
            if isinstance(ev, StepEvents):
                emitted += sum(len(s.new_token_ids) for s in ev.steps)
                done += ev.finished
            elif isinstance(ev, Reply):
                applied = ev
            if emitted >= 8 and not pushed:
                front.send(ApplyWeights(1, "policy", 1, manifest.SerializeToString(), bytes(payload)))
                pushed = True
        assert not applied.error and done[0].versions.policy_min == 0  # the push landed mid-sequence
        batch = puller.recv(5.0)
    finally:  # open sockets would keep their zmq contexts (and the interpreter) from ending
        front.send(Shutdown())
        runner.join(10)
        loop.features.close()
        puller.close()
    assert batch is not None and len(batch.sequences) == 1
    q = batch.sequences[0]
    ids = list(prompt) + list(done[0].token_ids)
    start = len(prompt) - 1
    assert list(q.token_ids) == ids[start:start + len(q.token_ids)] and len(q.token_ids) >= 8
    hf = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if q.policy_version == 1:
        hf.load_state_dict({"model.norm.weight": new_norm}, strict=False)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, start:start + len(q.token_ids)]
    f = torch.from_numpy(np.frombuffer(q.features, np.float16).reshape(len(q.token_ids), q.hidden_size).astype(np.float32))
    err = (f - ref).abs().max().item()
    assert err < 1e-2, f"rows tagged policy {q.policy_version} differ from that version's forward by {err}"
