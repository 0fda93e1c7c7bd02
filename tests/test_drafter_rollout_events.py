"""The rollout side of the spot trainer, on a real server (real replica processes, real gRPC, real
ZeroMQ on 127.0.0.1): capacity events (IDLE at start, BUSY while a replica has work, IDLE again,
heartbeats, a late subscriber's snapshot) and drafter features of finished sequences (fp16,
post-norm, tagged with the policy version; stripped from completions that did not ask; a missing
consumer drops and counts, never blocks)."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from rollout_helpers import ServerThread, learned_drafter, tiny_checkpoint
from tlt.services.common.events import CapacitySubscriber, FeaturePuller
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import common_pb2, events_pb2, rollout_pb2

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
        assert sorted((e.replica_id, e.state) for e in sub.snapshot()) == [(0, IDLE), (1, IDLE)]
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
    """Counted in the replica's stats and, where docs/DRAFTER.md sends users, on /metrics (it was on neither)."""
    import re

    import httpx

    with ServerThread(model_dir, replicas=1, features_push="tcp://127.0.0.1:1") as s:  # nobody listens there
        with RolloutClient(s.grpc_address) as client:
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=8)
            done = list(client.batch_generate(["1+1=", "2+2="], n=2, params=params))
        assert len(done) == 4
        stats = s.call(s.server.pool.snapshot())
        assert stats[0].stats.features_dropped == 4
        text = httpx.get(s.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
        assert re.search(r'^rollout_replica_features_dropped_total\{replica="0"\} 4\.0$', text, re.M), text[-2000:]


def test_a_policy_push_makes_every_replica_busy_while_it_is_applied(model_dir) -> None:
    """Copying new weights in is work on the replica's device: drafter workers must not train meanwhile."""
    import safetensors.torch

    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    with ServerThread(model_dir, replicas=2, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.3) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert sorted((e.replica_id, e.state) for e in sub.snapshot()) == [(0, IDLE), (1, IDLE)]
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


def test_a_drafter_push_leaves_idle_replicas_idle(model_dir, tmp_path) -> None:
    """A drafter push swaps a few small tensors between two steps: no BUSY for it (drafter workers would stop training
    on every push they make, and a colocated trainer's lend would be taken back), only the new drafter version on the
    IDLE the replica repeats. Untested before: a pool that made every replica BUSY for a drafter push passed."""
    spec, own = learned_drafter(model_dir, tmp_path)
    with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.3,
                      spec=spec) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert [(e.state, e.versions.drafter) for e in sub.snapshot()] == [(IDLE, 0)]
        with RolloutClient(s.grpc_address, timeout_s=60) as client:
            assert client.update_weights(own, "drafter", 1).ok
        seen = _events_until(sub, lambda seen: seen[-1].versions.drafter == 1 and not seen[-1].heartbeat, 10)
        assert [(e.state, e.versions.drafter) for e in seen if not e.heartbeat] == [(IDLE, 1)], seen
        sub.close()


def test_a_replica_killed_during_a_policy_push_is_never_idle_again(model_dir) -> None:
    """A replica that misses a policy push's update_timeout_s is killed (DRAINING); the push holds on the other. The
    push's end makes the replicas it was applied on IDLE again, but never the dead one: a drafter worker seeing IDLE
    would load onto a device whose replica is gone (and, with max_restarts = 0, never comes back). Untested before:
    a pool that made every replica of the push IDLE again, dead or not, passed."""
    import os
    import signal

    import safetensors.torch

    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    changed = {"model.norm.weight": weights["model.norm.weight"] * 1.25}
    with ServerThread(model_dir, replicas=2, max_restarts=0, update_timeout_s=1.0, capacity_pub="tcp://127.0.0.1:*",
                      capacity_heartbeat_s=0.3) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert sorted((e.replica_id, e.state) for e in sub.snapshot()) == [(0, IDLE), (1, IDLE)]
        pid = s.server.replica_pids()[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            with RolloutClient(s.grpc_address, timeout_s=60) as client:
                assert client.update_weights(changed, "policy", 1).ok
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        seen = _events_until(sub, lambda seen: False, 1.5)  # everything the push's end published, and then some
        mine = [e.state for e in seen if e.replica_id == 1 and not e.heartbeat]
        assert mine and mine[-1] == common_pb2.REPLICA_STATE_DRAINING, mine
        assert IDLE not in mine[mine.index(common_pb2.REPLICA_STATE_DRAINING):], mine
        assert {e.replica_id: e.state for e in sub.snapshot()} == {0: IDLE, 1: common_pb2.REPLICA_STATE_DRAINING}
        sub.close()


def _six_sequences_until_idle(s, sub, max_tokens: int, timeout_s: float) -> list:
    """Run 3 prompts x n=2 through the server in a thread; the capacity events until the replica is IDLE again."""
    import threading

    done: list = []

    def run() -> None:
        with RolloutClient(s.grpc_address) as client:
            params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=5)
            done.extend(client.batch_generate(["1+2=", "3*4=", "5-1="], n=2, params=params))

    t = threading.Thread(target=run)
    t.start()
    seen = _events_until(sub, lambda seen: seen[-1].state == IDLE and not seen[-1].heartbeat
                         and any(x.state == BUSY for x in seen), timeout_s)
    t.join(timeout_s)
    assert len(done) == 6
    return seen


def test_capacity_events_carry_the_current_counts(model_dir) -> None:
    """BUSY says how many sequences the replica holds (running + queued, not 0), and the count follows the work while it stays
    BUSY: heartbeats and the snapshot repeat the latest count, never the one of the first submission."""
    with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.2) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert [e.state for e in sub.snapshot()] == [IDLE]
        # long enough to outlast REFRESH_MIN_S: the count of all six comes with the first count event after BUSY
        seen = _six_sequences_until_idle(s, sub, max_tokens=160, timeout_s=30)
        busy = [e for e in seen if e.state == BUSY]
        assert busy and all(e.running + e.queued >= 1 for e in busy), [(e.running, e.queued) for e in busy]
        assert max(e.running for e in busy) == 6, [(e.heartbeat, e.running) for e in busy]
        assert seen[-1].running == 0
        assert [(e.state, e.running) for e in sub.snapshot()] == [(IDLE, 0)]
        sub.close()


def test_capacity_events_split_running_from_queued_and_carry_kv_use(model_dir) -> None:
    """The engine runs at most max_num_seqs=2 sequences at once: of 6 submitted, the events say 2 run and 4 wait
    (the engine's own split, reported with each step), with the KV cache's use; they add up to what the replica
    holds, and IDLE holds nothing."""
    with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.2,
                      engine={"max_num_seqs": 2}) as s:
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert [e.state for e in sub.snapshot()] == [IDLE]
        # long enough that the first two sequences run well past REFRESH_MIN_S (count events are that far apart)
        seen = _six_sequences_until_idle(s, sub, max_tokens=160, timeout_s=60)
        counts = [(e.state, e.running, e.queued, round(e.kv_usage, 3)) for e in seen if not e.heartbeat]
        busy = [e for e in seen if e.state == BUSY]
        assert all(e.running <= 2 and e.running + e.queued <= 6 for e in busy), counts
        assert any(e.running == 2 and e.queued == 4 for e in busy), counts
        assert any(e.kv_usage > 0 for e in busy) and all(0 <= e.kv_usage <= 1 for e in seen), counts
        assert (seen[-1].running, seen[-1].queued) == (0, 0), counts
        sub.close()


def test_count_events_are_coalesced_to_one_per_refresh_interval(model_dir, monkeypatch) -> None:
    """A replica's counts and KV use change with nearly every step; every subscriber (each drafter worker, the
    coordinator) wakes and parses each event while the replicas decode. Count events of one replica are at least
    REFRESH_MIN_S apart, carrying the counts of their moment; state changes are not held back (the last event is
    IDLE with nothing left). The same work without the spacing makes more, some much closer together (here 20
    against 6 on a quiet 2-core machine, 20 against 9-10 with both cores loaded)."""
    from tlt.services.rollout import pool_states

    def count_events(spacing_s: float) -> tuple[int, list[float]]:
        monkeypatch.setattr(pool_states, "REFRESH_MIN_S", spacing_s)
        with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.5,
                          engine={"max_num_seqs": 2}) as s:
            cap = s.server.capacity
            sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
            sub.snapshot()
            seen = [e for e in _six_sequences_until_idle(s, sub, max_tokens=160, timeout_s=60) if not e.heartbeat]
            sub.close()
        first_busy = [e.state for e in seen].index(BUSY)
        assert (seen[-1].state, seen[-1].running, seen[-1].queued) == (IDLE, 0, 0)
        pairs = list(zip(seen[first_busy:], seen[first_busy + 1:]))
        gaps = [b.timestamp - a.timestamp for a, b in pairs if b.state == BUSY]  # BUSY again: a count event
        return len(gaps), gaps

    spaced, gaps = count_events(0.1)
    assert spaced and min(gaps) >= 0.1 - 0.01, gaps
    unspaced, unspaced_gaps = count_events(0.0)  # the same work, one count event per loop turn: a step or so apart
    assert unspaced > spaced and min(unspaced_gaps) < 0.05, (unspaced, spaced, unspaced_gaps)


def _abandon(pool, request_id: str, after_steps: int, before_close=None):  # noqa: ANN001, ANN202
    """A client that reads a 16-sample request's first `after_steps` steps, then goes away (the pool aborts it)."""
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    async def run() -> None:
        params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=1)
        stream = pool.generate(GenerationRequest(request_id, (5, 6, 7, 8), params, n=16), want_steps=True)
        got = 0
        async for _ in stream:
            got += 1
            if got == 16 * after_steps:
                break
        if before_close is not None:
            before_close()
        await stream.aclose()

    return run()


def test_idle_after_an_abort_waits_for_the_replica_to_drop_the_sequences(model_dir) -> None:
    """A client goes away while its replica decodes: the replica is then in the middle of a step over the aborted
    sequences. IDLE (a drafter worker starts training on the device) must wait until the replica has dropped them:
    nothing that the replica sends after the IDLE may come from a step (it used to be published at once)."""
    from tlt.services.rollout.ipc import StepEvents

    with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.2) as s:
        pool = s.server.pool
        stepped: list[float] = []  # when the pool's loop took in each step of the replica (same clock as events)
        on_event = pool._on_event

        def recording(rep, event) -> None:  # noqa: ANN001
            if isinstance(event, StepEvents):
                stepped.append(time.time())
            on_event(rep, event)

        pool._on_event = recording  # observes what the real replica sends; the pool handles it as ever
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert [e.state for e in sub.snapshot()] == [IDLE]
        for i in range(3):
            s.call(_abandon(pool, f"gone-{i}", after_steps=3))
            seen = _events_until(sub, lambda seen: seen[-1].state == IDLE and not seen[-1].heartbeat
                                 and any(x.state == BUSY for x in seen), 10)
            idle = seen[-1]
            assert idle.state == IDLE and not idle.heartbeat, [(e.state, e.heartbeat) for e in seen]
            time.sleep(0.3)  # a step the replica was still in when IDLE went out has reached the pool by now
            late = [t - idle.timestamp for t in stepped if t >= idle.timestamp]
            assert not late, f"round {i}: IDLE went out, then the replica still sent {len(late)} step(s): {late}"
            assert (idle.running, idle.queued) == (0, 0) and pool.replicas[0].outstanding == 0
        sub.close()


def test_an_unanswered_abort_keeps_the_replica_busy_and_its_death_leaves_no_count(model_dir) -> None:
    """A replica that cannot act on an abort (stopped here with SIGSTOP, as a replica stuck in a long step) still
    holds the sequences: it stays BUSY with them counted. When it dies meanwhile, nothing of them stays counted
    (DRAINING with 0 running / 0 queued, nothing outstanding), and the pool still routes nothing to it."""
    import os
    import signal

    with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", capacity_heartbeat_s=0.2) as s:
        pool = s.server.pool
        rep = pool.replicas[0]
        cap = s.server.capacity
        sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
        assert [e.state for e in sub.snapshot()] == [IDLE]
        try:
            s.call(_abandon(pool, "stuck", after_steps=2, before_close=lambda: os.kill(rep.info.pid, signal.SIGSTOP)))
            seen = _events_until(sub, lambda seen: False, 1.0)
            changes = [(e.state, e.running, e.queued) for e in seen if not e.heartbeat]
            assert all(st == BUSY for st, _, _ in changes) and seen[-1].state == BUSY, changes
            assert seen[-1].running + seen[-1].queued == 16 and rep.outstanding == 16, changes
        finally:
            os.kill(rep.info.pid, signal.SIGKILL)
        seen = _events_until(sub, lambda seen: seen[-1].state == common_pb2.REPLICA_STATE_DRAINING, 10)
        assert (seen[-1].state, seen[-1].running, seen[-1].queued) == (common_pb2.REPLICA_STATE_DRAINING, 0, 0)
        assert rep.outstanding == 0 and rep.error and not rep.alive
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
    features = FeaturePublisher(puller.endpoint, 0)
    assert features.pusher.wait_connected(30)  # a batch pushed before the handshake is dropped (IMMEDIATE)
    loop = ReplicaLoop(engine, back, 0, features)
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


def test_capacity_events_name_the_drafter_the_rollout_started_with(model_dir, tmp_path) -> None:
    """`start_drafter`: the identity of the learned drafter the rollout started with, the same a drafter coordinator
    started from that folder records as its lineage (so it may push its serving drafter again after a restart);
    empty for a rollout drafting with n-grams."""
    from tlt.model.drafter import folder_identity
    from tlt.services.drafter.lineage import identity
    from tlt.services.drafter.training import new_drafter, own_tensors
    from tlt.services.rollout.spec.config import SpecConfig

    drafter = new_drafter(str(model_dir), seed=5)
    drafter.save(tmp_path / "drafter")
    want = folder_identity(tmp_path / "drafter")
    assert want == identity(str(tmp_path / "drafter"), own_tensors(drafter)) and want.startswith("sha256:")
    for spec, expected in ((SpecConfig(drafter="learned", drafter_path=str(tmp_path / "drafter")), want),
                           (SpecConfig(drafter="ngram"), "")):
        with ServerThread(model_dir, replicas=1, capacity_pub="tcp://127.0.0.1:*", spec=spec) as s:
            cap = s.server.capacity
            sub = CapacitySubscriber(cap.pub_endpoint, cap.snapshot_endpoint)
            try:
                snap = sub.snapshot()
            finally:
                sub.close()
        assert [e.start_drafter for e in snap] == [expected], (spec.drafter, snap)
    # without capacity events nobody reads it: the replica does not spend seconds hashing a large drafter
    with ServerThread(model_dir, replicas=1, spec=SpecConfig(drafter="learned",
                                                             drafter_path=str(tmp_path / "drafter"))) as s:
        assert [r.info.start_drafter for r in s.server.pool.replicas] == [""]


def test_a_redone_rollout_step_publishes_its_prompts_under_the_same_groups(model_dir) -> None:
    """The drafter holds out whole prompt groups so that no sibling of a held-out sequence is trained on. The group
    was the server's request id, which takes a fresh uuid per BatchGenerate call: a step the trainer rolls out again
    (collect_retrying, same batch id and seeds) published the same prompts under new groups, and with reproducible
    sampling the very same samples, so a twin could train while the other was held out. The group is now the
    prompt's token ids (a digest): the redo's sequences join their twins, on the same side of the split."""
    from tlt.services.drafter.buffer import FeatureBuffer

    puller = FeaturePuller("tcp://127.0.0.1:*")
    try:
        with ServerThread(model_dir, replicas=1, features_push=puller.endpoint) as s, \
                RolloutClient(s.grpc_address) as client:
            params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=8, seed=11)
            for _ in range(2):  # the step and its redo, as collect_retrying sends them
                assert len(list(client.batch_generate(["1+2=", "3*4=", "5-1="], n=2, params=params,
                                                      batch_id="step0-s0"))) == 6
            seqs = []
            deadline = time.monotonic() + 20
            while len(seqs) < 12 and time.monotonic() < deadline:
                b = puller.recv(0.5)
                seqs += list(b.sequences) if b is not None else []
        assert len(seqs) == 12
        by_sample: dict[tuple, list] = {}
        for q in seqs:  # twins: the same prompt (request's prompt index) and sample index, in either attempt
            by_sample.setdefault((q.seq_id.split("/")[0].rsplit("-", 1)[1], q.seq_id.split("/")[1]), []).append(q)
        assert len(by_sample) == 6 and all(len(v) == 2 for v in by_sample.values())
        assert all(a.token_ids == b.token_ids for a, b in by_sample.values())  # the very same samples
        assert all(a.group_id == b.group_id for a, b in by_sample.values())
        assert len({q.group_id for q in seqs}) == 3  # one per prompt
        buf = FeatureBuffer(100, 100, 64, 4, holdout_every=2)
        buf.add_batch(events_pb2.FeatureBatch(source="rollout", sequences=seqs))
        held = {s.seq_id.split("@")[0] for s in buf.holdout(1)}
        trained = {s.seq_id.split("@")[0] for s in buf._train}
        assert held and trained
        twin = {x.seq_id: y.seq_id for v in by_sample.values() for x, y in (v, v[::-1])}
        assert not {twin[h] for h in held} & trained
    finally:
        puller.close()
