"""A rollout server restarted mid-run serves its start checkpoint (policy version 0): the trainer pushes its weights
to it again and rolls the step out again, instead of ending the run with StaleWeightsError (the run was lost back to
its last checkpoint, and `tlt train` had to be started again by hand). A server serving a NEWER version than the
trainer pushed (another trainer pushes to it) still ends the run: a second push of ours would not be served.

Real parts: the rollout server (replica process, native engine, gRPC on 127.0.0.1), restarted on the same ports;
DeepSpeed with a gloo group; the task verifier in-process. The restart is made between step 0's weight push and
step 1's rollout by wrapping the trainer's collect call; nothing in the trainer is stubbed.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.common.ports import free_port
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train


def _config(model_dir, port: int, out, **kw) -> TrainerConfig:  # noqa: ANN001
    base = dict(model_dir=str(model_dir), rollout_addresses=[f"127.0.0.1:{port}"], output_dir=str(out),
                prompts_per_step=2, n_samples=2, max_tokens=8, mini_batch_size=4, micro_batch_size=4, lr=1e-3,
                steps=3, checkpoint_interval=1, synthetic_problems=64, torch_threads=1, connect_timeout_s=60,
                eval_problems=0)
    return TrainerConfig(**{**base, **kw})


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _on_second_collect(monkeypatch, action) -> list:  # noqa: ANN001
    """Run `action()` just before the trainer's second rollout (step 1's), after step 0's weights were pushed;
    returns the list of policy versions each rollout's completions carried: ("dropped", "[v]") for one that failed
    at its first stale completion (collect.EXPECTED_VERSION: dropped before it was scored)."""
    from tlt.services.trainer import collect
    from tlt.services.trainer.weight_sync import StaleWeightsError

    real, seen = collect.collect_retrying, []

    def wrapped(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        if len(seen) == 1:
            action()
        try:
            result = real(*args, **kw)
        except StaleWeightsError as e:
            seen.append(("dropped", re.search(r"version\(s\) (\[[\d, ]*\])", str(e))[1]))
            raise
        seen.append(sorted({s.policy_version for s in result.samples}))
        return result

    monkeypatch.setattr(collect, "collect_retrying", wrapped)
    return seen


def test_a_rollout_server_restarted_mid_run_gets_the_weights_again(random_model_dir, tmp_path, monkeypatch) -> None:
    from tlt.services.rollout.client import RolloutClient

    grpc_port, http_port = free_port(), free_port()
    servers = [ServerThread(random_model_dir, replicas=1, grpc_port=grpc_port, http_port=http_port).__enter__()]

    def restart() -> None:
        servers[-1].__exit__()
        servers.append(ServerThread(random_model_dir, replicas=1, grpc_port=grpc_port, http_port=http_port).__enter__())

    seen = _on_second_collect(monkeypatch, restart)
    try:
        summary = train(_config(random_model_dir, grpc_port, tmp_path / "run"))
        with RolloutClient(f"127.0.0.1:{grpc_port}") as client:
            serving = client.status().versions.policy
    finally:
        servers[-1].__exit__()
    assert len(servers) == 2, "the server was not restarted"
    # step 0 from version 0; step 1 first from the restarted server's version 0 (dropped at its first completion), then
    # again from the version pushed
    # to it (1); step 2 from 2
    assert seen == [[0], ("dropped", "[0]"), [1], [2]], seen
    assert summary.steps_done == 3 and summary.policy_version == 3 and serving == 3
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2] and [m["policy_version"] for m in lines] == [1, 2, 3]


def test_a_server_serving_a_newer_version_than_pushed_still_ends_the_run(random_model_dir, tmp_path,
                                                                          monkeypatch) -> None:
    from safetensors.torch import load_file

    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.weight_sync import StaleWeightsError, WeightPublisher

    grpc_port, http_port = free_port(), free_port()
    with ServerThread(random_model_dir, replicas=1, grpc_port=grpc_port, http_port=http_port):
        weights = {}
        for f in sorted(random_model_dir.glob("*.safetensors")):
            weights.update(load_file(f))
        with RolloutClient(f"127.0.0.1:{grpc_port}") as other_trainer:
            seen = _on_second_collect(monkeypatch, lambda: WeightPublisher([other_trainer]).push(weights, 99))
            with pytest.raises(StaleWeightsError, match=r"policy version\(s\) \[99\] but version 1 was pushed"):
                train(_config(random_model_dir, grpc_port, tmp_path / "run"))
    assert seen == [[0], ("dropped", "[99]")]  # rolled out once: no second push over another trainer's
