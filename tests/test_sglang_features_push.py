"""A policy push into an SGLang replica that sends drafter features (`[rollout] features_push`): the replica loop
asked the engine for `engine.scheduler`, which only the native engine has, so after SGLang had applied the weights
the replica raised AttributeError, never answered the push and its loop ended (the replica marked dead) at every
policy push. Engines now say where their unfinished sequences stand through `unfinished_emitted()`. Real parts: a
ReplicaLoop over a real pipe, the SGLang adapter over the SGLangClient stand-in, a real FeaturePublisher pushing to
a real FeaturePuller over ZeroMQ on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from sglang_fakes import make_engine, sglang_chunk, write_checkpoint
from tlt.services.common.events import FeaturePuller
from tlt.services.common.weights import pack_state_dict
from tlt.services.rollout.features import FeaturePublisher
from tlt.services.rollout.ipc import AddRequest, ApplyWeights, Reply, Shutdown, StepEvents
from tlt.services.rollout.replica import ReplicaLoop
from tlt.services.rollout.types import GenerationRequest, SamplingParams
from tlt.v1 import common_pb2


@pytest.fixture
def puller():
    p = FeaturePuller("tcp://127.0.0.1:*")
    yield p
    p.close()


def _next(front, kind: type, timeout_s: float = 10.0):
    while True:
        assert front.poll(timeout_s), f"no {kind.__name__} from the replica loop (has it died?)"
        ev = front.recv()
        if isinstance(ev, kind):
            return ev


def test_a_policy_push_with_features_on_keeps_an_sglang_replica_serving(tmp_path, puller) -> None:
    eng, fake = make_engine(write_checkpoint(tmp_path))
    pub = FeaturePublisher(puller.endpoint, 1)
    # the handshake first: a batch pushed before it is dropped (IMMEDIATE); on a loaded host it took over the few
    # ms the steps below take, and the batch this test waits for was dropped (1 dropped, 0 sent)
    assert pub.pusher.wait_connected(30)
    front, back = mp.Pipe()
    loop = ReplicaLoop(eng, back, 1, pub)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        front.send(AddRequest(GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=8))))
        fake.feed(sglang_chunk("r#0", [4, 5]))  # two tokens under policy 0
        _next(front, StepEvents)
        m, payload = pack_state_dict({"model.embed_tokens.weight": torch.ones(64, 8, dtype=torch.bfloat16)},
                                     common_pb2.WEIGHT_KIND_POLICY, 1)
        front.send(ApplyWeights(5, "policy", 1, m.SerializeToString(), bytes(payload)))
        reply = _next(front, Reply)
        assert reply.cmd_id == 5 and reply.error == "" and reply.versions.policy == 1
        hidden = [[[0.0] * 8] * 3, [1.0] * 8, [2.0] * 8, [3.0] * 8]  # prompt block, then a row per token fed back
        fake.feed(sglang_chunk("r#0", [4, 5, 6, 7], finish={"type": "length"}, hidden_states=hidden))
        (c,) = _next(front, StepEvents).finished
        assert c.versions.policy == 1 and c.versions.policy_min == 0 and c.features is None  # not asked: stripped
        batch = puller.recv(10)
        assert batch is not None and runner.is_alive(), (pub.dropped, pub.pusher.sent)
        (seq,) = batch.sequences  # its features end where the push found it, tagged with the version before
        assert list(seq.token_ids) == [3, 4] and seq.policy_version == 0
    finally:
        front.send(Shutdown())
        runner.join(10)
        pub.close()
