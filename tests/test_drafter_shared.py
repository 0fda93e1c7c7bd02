"""The drafter service follows policy updates: the target's embedding and lm_head it trains and gates with.

After a policy push, the drafter coordinator (its acceptance gate) and a worker (its micro-steps)
switch to the pushed embedding and lm_head, fetched from the rollout over GetWeights
(tests/test_rollout_get_weights.py), and status says which policy version they use; a failed fetch
(a wrong control token) keeps the old ones and is counted in status.

Real parts: the rollout server on 127.0.0.1 (one replica process, native engine, capacity events,
feature push), the drafter coordinator and a worker (a thread here), gRPC, ZeroMQ, a tiny random
Qwen2 built in code. The acceptance function and the micro-step are wrapped only to record the
tensors the drafter held when they ran (they run for real).
"""

from __future__ import annotations

import threading
import time

import pytest
import safetensors.torch
import torch

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.common.events import FeaturePuller
from tlt.services.drafter import coordinator_gate as coordinator_mod
from tlt.services.drafter import worker as worker_mod
from tlt.services.drafter.collect import sample_features
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import Coordinator
from tlt.services.drafter.shared import EMBED, LM_HEAD, rollout_fetch
from tlt.services.drafter.worker import DrafterWorker
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2

TOKEN = "shared-weights-token"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("shared_model"))


@pytest.fixture(scope="module")
def original(model_dir) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(model_dir / "model.safetensors"))


def pushed_policy(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full policy update whose embedding and lm_head are new (the rest as at start)."""
    g = torch.Generator().manual_seed(7)
    new = dict(original)
    for k in (EMBED, LM_HEAD):
        new[k] = torch.randn(original[k].shape, generator=g, dtype=original[k].dtype) * 0.05
    return new


@pytest.fixture(scope="module")
def samples(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [[int(x) for x in torch.randint(5, 200, (6,))] for _ in range(8)]
    return sample_features(model, prompts, max_new_tokens=24, window_tokens=64)


@pytest.fixture
def recorded(monkeypatch):
    """The (embed, lm_head) a drafter held at each acceptance evaluation and each micro-step."""
    evals: list[tuple[torch.Tensor, torch.Tensor]] = []
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_eval, real_step = coordinator_mod.mean_accept_length, worker_mod.micro_step

    def eval_spy(drafter, samples, depth, should_stop=None):
        evals.append((drafter.embed, drafter.lm_head))
        return real_eval(drafter, samples, depth, should_stop)

    def step_spy(drafter, *args, **kwargs):
        steps.append((drafter.embed, drafter.lm_head))
        time.sleep(0.05)  # leave CPU to the replica on this small machine
        return real_step(drafter, *args, **kwargs)

    monkeypatch.setattr(coordinator_mod, "mean_accept_length", eval_spy)
    monkeypatch.setattr(worker_mod, "micro_step", step_spy)
    return evals, steps


def wait_for(cond, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_coordinator_and_worker_switch_to_the_pushed_embedding_and_lm_head(model_dir, original, samples, recorded,
                                                                         tmp_path):
    evals, steps = recorded
    new = pushed_policy(original)

    def uses(pair: tuple[torch.Tensor, torch.Tensor], tensors: dict[str, torch.Tensor]) -> bool:
        return torch.equal(pair[0], tensors[EMBED].float()) and torch.equal(pair[1], tensors[LM_HEAD].float())

    puller = FeaturePuller("tcp://127.0.0.1:*")
    with ServerThread(model_dir, replicas=1, control_token=TOKEN, capacity_pub="tcp://127.0.0.1:*",
                      capacity_heartbeat_s=0.5, features_push=puller.endpoint) as s:
        cap = s.server.capacity
        cfg = DrafterServiceConfig(
            capacity_pub=cap.pub_endpoint, capacity_snapshot=cap.snapshot_endpoint, coordinator_bind="tcp://127.0.0.1:*",
            rollout_grpc=s.grpc_address, control_token=TOKEN, checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=64,
            batch_tokens=64, batch_rows=2, long_tokens=8, submit_every=2, eval_interval_s=0.3, eval_depth=3,
            min_eval_tokens=32, holdout_every=4, pin_cpus=False)
        fetch = rollout_fetch(str(model_dir), s.grpc_address, TOKEN)
        coord = Coordinator(cfg, str(model_dir), puller, None, fetch).start()
        coord.buffer.add_samples(samples[2:])
        coord.buffer.add_samples(samples[:2], holdout=True)
        worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint, fetch)
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        client = RolloutClient(s.grpc_address, control_token=TOKEN, timeout_s=60)
        try:
            # policy version 0: both train and gate with the checkpoint's tensors
            wait_for(lambda: steps and evals, "a micro-step and an evaluation before the push")
            assert uses(steps[0], original) and uses(evals[0], original)

            assert client.update_weights(new, "policy", 1).ok
            n_steps, n_evals = len(steps), len(evals)
            params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            client.generate([5, 17, 33], params=params)  # the replica turns BUSY then IDLE, now at policy 1

            wait_for(lambda: any(uses(p, new) for p in steps[n_steps:]), "a micro-step with the pushed tensors")
            wait_for(lambda: any(uses(p, new) for p in evals[n_evals:]), "an evaluation with the pushed tensors")
            first_new = next(i for i in range(n_steps, len(steps)) if uses(steps[i], new))
            assert all(uses(p, new) for p in steps[first_new:])  # never back to the old ones
            assert all(uses(p, original) for p in steps[:n_steps])

            # A failed fetch (here: a wrong token) keeps the tensors in use, and status counts it.
            bad_cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt-bad"))
            bad = Coordinator(bad_cfg, str(model_dir), None, None,
                              rollout_fetch(str(model_dir), s.grpc_address, "wrong-token")).start()
            try:
                bad.shared.see(1)
                assert not bad.refresh_shared()
                st = bad.status()
                assert st.shared_policy_version == 0 and st.shared_fetch_failures == 1
                assert "UNAUTHENTICATED" in st.shared_fetch_error
                assert torch.equal(bad.shared.current.lm_head, original[LM_HEAD])
            finally:
                bad.close()

            stop.set()  # the worker ends its window and reports it
            thread.join(60)
            st = coord.status()
            assert st.shared_policy_version == 1 and st.shared_fetch_failures == 0
            assert [(w.worker_id, w.shared_policy_version, w.shared_fetch_failures) for w in st.workers] == [(0, 1, 0)]
            # Window 0 is preempted by the push (a replica is BUSY while it applies one); then windows at 1
            # only: one more when the request's BUSY came after the worker had opened a window on the
            # push's IDLE, and the last one ended by `stop`.
            versions = [w.shared_policy_version for w in st.windows]
            assert versions[0] == 0 and set(versions[1:]) == {1} and len(versions) in (2, 3), versions
            assert worker.shared.current.policy_version == 1 and worker.shared.failures == 0
        finally:
            stop.set()
            thread.join(60)
            worker.close()
            coord.close()
            client.close()
            puller.close()


def test_a_lagging_rollouts_older_answer_is_asked_again():
    """Features tagged with policy 1 arrive from a replica that applied the push while GetWeights still answers
    version 0 (the pool serves a version once every replica has it). That answer counted version 1 as fetched: it was
    never asked again, and the drafter trained with policy 0's embedding and lm_head until policy 2 was seen. It is
    asked again after retry_s, and version 1's tensors are taken once served. (The fetch plays GetWeights answering
    what the pool serves at each moment; tests above run the real one.)"""
    from tlt.services.drafter.shared import SharedTensors, SharedWeights

    serving = {"v": 0}

    def fetch() -> SharedTensors:
        v = serving["v"]
        return SharedTensors(v, torch.full((4, 2), float(v)), torch.full((4, 2), float(v)))

    shared = SharedWeights(SharedTensors(0, torch.zeros(4, 2), torch.zeros(4, 2)), fetch, retry_s=0.2)
    shared.see(1)
    assert not shared.refresh() and shared.stale()  # answered 0: still wanted
    serving["v"] = 1
    assert not shared.refresh()  # within retry_s of the lagging answer
    time.sleep(0.25)
    assert shared.refresh() and shared.current.policy_version == 1 and float(shared.current.embed[0, 0]) == 1.0
    assert not shared.stale()


def test_an_older_policy_heard_after_a_newer_one_does_not_hide_it():
    """Replicas apply a push one after another, and feature batches of the previous policy still arrive after it: a
    version heard after a newer one must not lower the newest seen, or the drafter never fetched the newer tensors
    (until a still newer policy was heard) and trained with the previous policy's embedding and lm_head."""
    from tlt.services.drafter.shared import SharedTensors, SharedWeights

    def fetch() -> SharedTensors:
        return SharedTensors(2, torch.full((4, 2), 2.0), torch.full((4, 2), 2.0))

    shared = SharedWeights(SharedTensors(0, torch.zeros(4, 2), torch.zeros(4, 2)), fetch)
    shared.see(2)
    shared.see(1)
    assert shared.seen == 2 and shared.stale()
    assert shared.refresh() and shared.current.policy_version == 2 and not shared.stale()


def test_a_fetched_head_of_another_shape_is_refused_and_the_old_tensors_kept():
    """GetWeights of another model (rollout_grpc pointing elsewhere) answering an embedding of the drafter's shape but
    a head of another: taken, the next micro-step or gate evaluation failed on it. Refused as a fetch failure (logged,
    counted, retried); the drafter keeps the tensors it has."""
    from tlt.services.drafter.shared import SharedTensors, SharedWeights

    def fetch() -> SharedTensors:
        return SharedTensors(1, torch.ones(4, 2), torch.ones(5, 2))

    shared = SharedWeights(SharedTensors(0, torch.zeros(4, 2), torch.zeros(4, 2)), fetch)
    shared.see(1)
    assert not shared.refresh()
    assert shared.failures == 1 and "(5, 2) differ from the drafter's" in shared.last_error
    assert shared.current.policy_version == 0 and shared.stale()


def test_a_worker_follows_the_policy_its_batches_carry(tmp_path, model_dir):
    """A batch's features say which policy made them: a worker that has heard of no newer policy from the capacity
    events (they name its own replica's; a batch may come from another, or from the trainer) takes its version from
    the batch, and its next window trains with that policy's embedding and lm_head."""
    from drafter_helpers import IDLE, StubbedWorker
    from tlt.services.drafter.shared import SharedTensors

    stub = StubbedWorker(tmp_path, model_dir)
    worker = stub.worker
    stub.batch.policy_version = 1
    cur = worker.shared.current
    worker.shared.fetch = lambda: SharedTensors(1, cur.embed + 1.0, cur.lm_head + 1.0)
    worker.state, stub.busy_after = IDLE, 1
    assert worker.window().micro_steps == 1 and worker.shared.current.policy_version == 0  # a window keeps its own
    worker.state, stub.busy_after = IDLE, 1
    worker.window()
    assert worker.shared.current.policy_version == 1 and torch.equal(worker.shared.current.embed, cur.embed + 1.0)
