"""A step's rollout redone (a replica died, a server restarted) is counted, and timed, in its metrics line.

metrics.jsonl said rollout_retries 0 and a rollout_s of the last attempt alone for a step redone after its rollout
server restarted (VersionGuard threw the first attempt's result, and the retry it counted, away), and a rollout_s of
the last attempt alone where a replica died past `redispatch_limit` (collect_retrying counted the retry, collect()
timed one attempt): a 23 s step said rollout 0.5 s, and its phases summed to half of it. Now rollout_retries counts
every attempt dropped, and rollout_s runs from the first attempt to the kept one's last completion, with
rollout_retry_s (part of it) the dropped attempts and the waits before each redo.

Real parts: the rollout server (replica process, native engine, gRPC on 127.0.0.1), the weight push, the trainer
loop with DeepSpeed on a gloo group. A stream's UNAVAILABLE is played by a client wrapper (as tests/
test_trainer_collect.py does) where the point is the bookkeeping, and by a SIGKILLed replica in the loop test.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from structlog.testing import capture_logs

from rollout_helpers import ReplicaDied, ServerThread, kill_replica_once_busy
from tlt.services.trainer.collect import collect_retrying, sampling_params
from tlt.services.trainer.rewards import RewardResult
from tlt.services.trainer.types import PromptItem

SLOW_S = 0.6  # how long the attempt that fails takes before its stream ends UNAVAILABLE


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server(random_model_dir):
    with ServerThread(random_model_dir, replicas=1) as s:
        yield s


class _Rewards:
    """Every completion right (the bookkeeping, not the scores, is the point)."""

    def begin(self):  # noqa: ANN201
        keys: list[str] = []

        class Batch:
            def submit(self, key, *args, **kw) -> None:  # noqa: ANN001, ANN002, ANN003
                keys.append(key)

            def results(self):  # noqa: ANN202
                return {k: RewardResult(1.0, True) for k in keys}

            def cancel(self) -> None:
                pass

        return Batch()

    def close(self) -> None:
        pass


class _SlowDeath:
    """A rollout client whose first stream sends `sends` completions (at most), takes SLOW_S more and ends
    UNAVAILABLE (a replica that died and whose samples could not be re-dispatched); later streams are the server's."""

    def __init__(self, real, sends: int = 1) -> None:  # noqa: ANN001 - RolloutClient
        self.real, self.address, self.died, self.sends = real, real.address, False, sends
        self.stub = real.stub  # wait_serving's status poll
        self.status = real.status

    def batch_generate(self, *args, **kw):  # noqa: ANN002, ANN003, ANN201
        inner = self.real.batch_generate(*args, **kw)
        if self.died:
            return inner
        self.died = True
        sends = self.sends

        class Stream:
            def __iter__(self):
                for _, c in zip(range(sends), inner):  # range first: no completion read past `sends`
                    yield c
                time.sleep(SLOW_S)
                raise ReplicaDied()

            def cancel(self) -> None:
                inner.cancel()

        return Stream()


def _prompts(k: int) -> list[PromptItem]:
    return [PromptItem(i, f"{i}+{i}=", str(2 * i)) for i in range(k)]


def _spans_the_call(res, took: float) -> None:  # noqa: ANN001 - RolloutResult
    """rollout_s + reward_tail_s is the whole call: the first attempt started it, the kept one's scores ended it."""
    t = res.times
    assert t["rollout_retry_s"] >= SLOW_S, t
    assert t["rollout_s"] > t["rollout_retry_s"], t
    assert took - 0.1 <= t["rollout_s"] + t["reward_tail_s"] <= took, (t, took)


def test_a_rollout_redone_after_a_replica_death_counts_the_dropped_attempt_in_its_time(server) -> None:
    from tlt.services.rollout.client import RolloutClient

    with RolloutClient(server.grpc_address) as real:
        t0 = time.perf_counter()
        res = collect_retrying(_prompts(2), [_SlowDeath(real)], _Rewards(), 2, sampling_params(6, 1.0, 1.0, seed=3),
                               0, retries=1, wait_s=10)
        took = time.perf_counter() - t0
        clean = collect_retrying(_prompts(2), [real], _Rewards(), 2, sampling_params(6, 1.0, 1.0, seed=3), 0,
                                 retries=1, wait_s=10)
    assert res.retries == 1 and len(res.samples) == 4
    _spans_the_call(res, took)
    assert clean.retries == 0 and clean.times["rollout_retry_s"] == 0.0  # a step not redone says 0, not nothing


def test_a_batch_rolled_out_again_for_a_restarted_server_counts_every_attempt_it_dropped(random_model_dir,
                                                                                         server) -> None:
    """The server serves version 0 (as one restarted from its start checkpoint does) where the trainer pushed 1:
    VersionGuard pushes again and rolls the batch out again. The attempt it drops had itself been redone after a
    replica death (the audit's run: the restarted server first refused the connection): 2 attempts dropped. The
    death comes before any completion: a stale completion fails the rollout as it arrives (test_trainer_stale_rollout),
    so the stale attempt is the redo, dropped at its first completion with the redo before it counted."""
    from safetensors.torch import load_file

    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.weight_sync import VersionGuard, WeightPublisher

    weights = {}
    for f in sorted(random_model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    with RolloutClient(server.grpc_address) as real:
        version = real.status().versions.policy + 1
        publisher = WeightPublisher([real])
        guard = VersionGuard([real], repush=lambda behind, v: publisher.push(weights, v, clients=behind))
        clients = [_SlowDeath(real, sends=0)]
        t0 = time.perf_counter()
        res = guard.collect(lambda: collect_retrying(_prompts(2), clients, _Rewards(), 2,
                                                     sampling_params(6, 1.0, 1.0, seed=3), 1, retries=1, wait_s=10),
                            version)
        took = time.perf_counter() - t0
    assert guard.repushes == 1 and {s.policy_version for s in res.samples} == {version}
    assert res.retries == 2, res.retries
    _spans_the_call(res, took)


def test_a_step_whose_replica_died_past_the_redispatch_limit_says_so_in_its_metrics_and_log(random_model_dir,
                                                                                           tmp_path) -> None:
    """The trainer loop end to end: the replica SIGKILLed while step 0's requests are in it, re-dispatch off, so the
    step is rolled out again once the replica is back. Its metrics line counts the retry and its phases cover the
    step; its log line's `kl` is metrics.jsonl's (the KL to the reference), approx_kl its own (it printed approx_kl
    as `kl`)."""
    from tlt.model.testing import random_checkpoint
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.loop import train

    reference = random_checkpoint(tmp_path / "reference", seed=1)  # another model: kl and approx_kl differ
    with ServerThread(random_model_dir, replicas=1, max_restarts=1, redispatch_limit=0) as srv:
        pool = srv.server.pool
        killer = kill_replica_once_busy(pool)
        cfg = TrainerConfig(model_dir=str(random_model_dir), rollout_addresses=[srv.grpc_address],
                            output_dir=str(tmp_path / "run"), prompts_per_step=2, n_samples=4, max_tokens=12,
                            mini_batch_size=4, micro_batch_size=4, lr=1e-3, steps=1, checkpoint_interval=1,
                            synthetic_problems=64, torch_threads=1, connect_timeout_s=30, rollout_retries=1,
                            kl_beta=0.1, reference_model_dir=str(reference), eval_problems=0)
        with capture_logs() as logs:
            train(cfg)
        killer.join(5)
        restarts = dict(pool.restarts)
    assert restarts == {0: 1}
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    t = m["times"]
    assert m["rollout_retries"] == 1
    assert t["rollout_retry_s"] > 0.5, t  # the dropped attempt and the replica's restart (~1 s back-off)
    phases = t["rollout_s"] + t["reward_tail_s"] + t["old_logprobs_s"] + t["update_s"] + t["push_s"]
    assert t["rollout_s"] > t["rollout_retry_s"] and phases >= 0.9 * t["step_s"], t
    (line,) = [e for e in logs if e["event"] == "step"]
    assert round(m["kl"], 6) != round(m["approx_kl"], 6), m
    assert line["kl"] == round(m["kl"], 6) and line["approx_kl"] == round(m["approx_kl"], 6), (line, m)
