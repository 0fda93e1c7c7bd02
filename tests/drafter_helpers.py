"""Shared helpers for the drafter service tests (tests/test_drafter_worker*.py, tests/test_drafter_coordinator*.py).

`make` starts a real CapacityPublisher (ZeroMQ on 127.0.0.1, heartbeats every 0.2 s) that plays the
rollout's replicas 0 and 1 (both BUSY) and a real coordinator whose buffer holds `feature_samples`, real
target features of a tiny random Qwen2 (`rollout_helpers.tiny_checkpoint`); the rollout's UpdateWeights is
replaced by a recording function. `state` publishes a replica's state; `wait_for` polls a condition.
`gated_coordinator` is a coordinator (not started) whose gate the tests call by hand.
Stand-in, not the real thing: `StubbedWorker` replaces a real worker's coordinator and capacity feed by
in-process stubs so that BUSY lands at an exact micro-step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rollout_helpers import tiny_checkpoint

from tlt.services.common.events import CapacityPublisher
from tlt.services.drafter.collect import sample_features
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import Coordinator
from tlt.services.drafter.worker import DrafterWorker
from tlt.v1 import common_pb2, events_pb2

BUSY, IDLE = common_pb2.REPLICA_STATE_BUSY, common_pb2.REPLICA_STATE_IDLE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201 - import into a test module to use it
    return tiny_checkpoint(tmp_path_factory.mktemp("m"))


@pytest.fixture(scope="module")
def samples(model_dir):  # noqa: ANN001, ANN201
    return feature_samples(model_dir)


@contextmanager
def running(worker, pub, coord) -> Iterator[threading.Thread]:  # noqa: ANN001
    """`worker.run` in a thread; on the way out the worker is stopped (its replica published BUSY, so a window
    ends), joined and closed, then the coordinator and the publisher."""
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        state(pub, worker.replica_id, BUSY)
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


def feature_samples(model_dir):  # noqa: ANN001, ANN201
    """Feature windows of 12 short generations of the model in `model_dir` (the tests' `samples` fixture)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [[int(x) for x in torch.randint(5, 200, (6,))] for _ in range(12)]
    return sample_features(model, prompts, max_new_tokens=40, window_tokens=64)


def make(tmp_path, model_dir, samples, pushes, server_id="", features=None, **over):
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", server_id=server_id, heartbeat_s=0.2)
    kw = dict(capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
              coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=64,
              batch_tokens=64, batch_rows=2, lr=3e-3, submit_every=5, eval_interval_s=0.2, min_eval_tokens=32,
              holdout_every=4, publish_margin=0.0)
    cfg = DrafterServiceConfig(**{**kw, **over})
    coord = Coordinator(cfg, str(model_dir), features, lambda t, v: pushes.append((sorted(t), v))).start()
    coord.buffer.add_samples(samples[3:])
    coord.buffer.add_samples(samples[:3], holdout=True)
    for r in (0, 1):
        pub.publish(events_pb2.CapacityEvent(replica_id=r, state=BUSY))
    return pub, cfg, coord


def state(pub, r, s):
    return pub.publish(events_pb2.CapacityEvent(replica_id=r, state=s))


def wait_for(cond, timeout_s: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


class StubbedWorker:
    """A DrafterWorker whose coordinator and capacity feed are stubs: `busy_after` batch requests of a
    window, a BUSY event is queued; `asks` records every request kind in order."""

    def __init__(self, tmp_path, model_dir, **over) -> None:  # noqa: ANN001
        import numpy as np

        from tlt.services.drafter.packing import Sample, pack
        from tlt.services.drafter.training import new_drafter, own_tensors

        kw = dict(capacity_pub="tcp://127.0.0.1:9", capacity_snapshot="tcp://127.0.0.1:9",
                  checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=16, batch_tokens=16, batch_rows=1,
                  submit_every=100, pin_cpus=False)
        self.worker = DrafterWorker(DrafterServiceConfig(**{**kw, **over}), str(model_dir), 0, 0, "tcp://127.0.0.1:9")
        self.worker.sub.close()
        self.worker.stale_s = float("inf")  # the stub feed sends no heartbeats: its IDLE never goes stale
        self.cand = own_tensors(new_drafter(model_dir))
        g = np.random.default_rng(0)
        h = self.cand["fc.weight"].shape[0]
        smp = Sample("a", g.integers(0, 100, 16).astype(np.int32), g.standard_normal((16, h)).astype(np.float16), 1, 0)
        self.batch = pack([smp], 1, 16)[0].to_proto()
        self.events: list = []
        self.asks: list[str] = []
        self.busy_after = 0
        self.version = 0
        self.shared_policy_version = self.shared_fetch_failures = 0
        self.worker.client, self.worker.sub = self, self

    def busy(self) -> None:
        self.events.append(events_pb2.CapacityEvent(replica_id=0, state=BUSY, timestamp=time.time()))

    def ask(self, should_stop=None, **body):  # noqa: ANN001, ANN003, ANN201 - should_stop: never called (answers at once)
        from tlt.services.drafter.training import tensors_from, tensors_message
        from tlt.v1 import drafter_pb2

        kind = next(iter(body))
        self.asks.append(kind)
        if kind == "pull":
            m, p = tensors_message(self.cand, self.version)
            return drafter_pb2.CoordinatorMessage(candidate=drafter_pb2.CandidateWeights(
                version=self.version, manifest=m, payload=p))
        if kind == "batch_request":
            self.busy_after -= 1
            if self.busy_after < 0:
                self.busy()
            return drafter_pb2.CoordinatorMessage(batch=self.batch)
        if kind == "update":
            for k, d in tensors_from(body["update"].manifest, body["update"].payload).items():
                self.cand[k] += d
            self.version += 1
            return drafter_pb2.CoordinatorMessage(candidate_version=self.version)
        return drafter_pb2.CoordinatorMessage()

    def recv(self, timeout_s):  # noqa: ANN001, ANN201
        return self.events.pop(0) if self.events else None

    def close(self) -> None:
        pass


def gated_coordinator(tmp_path, model_dir, publish, **cfg) -> Coordinator:
    """A coordinator (not started) whose gate publishes on any gain, with one held-out window to score on;
    the scores themselves are scripted by the tests (monkeypatched `mean_accept_length`)."""
    import numpy as np

    from tlt.services.drafter.packing import Sample

    cfg = DrafterServiceConfig(**{"coordinator_bind": "tcp://127.0.0.1:*", "checkpoint_dir": str(tmp_path / "ckpt"),
                                  "window_tokens": 16, "batch_tokens": 16, "min_eval_tokens": 8, "publish_margin": 0.0,
                                  "gate_when_idle": False, **cfg})
    coord = Coordinator(cfg, str(model_dir), None, publish)
    h = coord.drafter_cfg.hidden_size
    g = np.random.default_rng(0)
    coord.buffer.add_samples([Sample("held", g.integers(0, 100, 16).astype(np.int32),
                                     g.standard_normal((16, h)).astype(np.float16), 1, 0)], holdout=True)
    return coord
