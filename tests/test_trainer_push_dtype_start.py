"""A push dtype the rollout server refuses, found when the trainer starts, not at its first push.

The config check cannot know the trainer's device: with `[trainer] bf16` unset and push_dtype "auto", a trainer on
a GPU pushes bf16, and the cpu-tiny preset's float32 engine refused every tensor of the first push, after the first
rollout and training step. The rollout's status now names the dtype pushes must carry and the trainer compares its
own with it before step 1. Real parts: a float32 rollout server (native engine, grpc.aio on 127.0.0.1) and the
trainer's own loop on CPU, forced to push bf16 (push_dtype = "bfloat16"; "auto" with a GPU's bf16 in the second
test, through the same check against the same server).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train
from tlt.services.trainer.weight_sync import PushDtypeError, check_push_dtype


def config(model_dir, address, out, **kw) -> TrainerConfig:
    base = dict(model_dir=str(model_dir), rollout_addresses=[address], output_dir=str(out), prompts_per_step=2,
                n_samples=2, max_tokens=8, mini_batch_size=4, micro_batch_size=4, steps=1, synthetic_problems=16,
                torch_threads=1, connect_timeout_s=30)
    return TrainerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def server(random_model_dir):
    torch.set_num_threads(1)
    with ServerThread(random_model_dir, replicas=1) as s:
        yield s


def test_status_names_the_dtype_pushes_must_carry(server) -> None:
    from tlt.services.rollout.client import RolloutClient

    with RolloutClient(server.grpc_address) as client:
        assert client.status().dtype == "float32"


def test_bf16_pushes_to_a_float32_rollout_are_refused_before_step_1(server, random_model_dir, tmp_path) -> None:
    from tlt.services.rollout.client import RolloutClient

    out = tmp_path / "run"
    with RolloutClient(server.grpc_address) as client:
        before = client.status().versions.policy
    with pytest.raises(PushDtypeError) as e:
        train(config(random_model_dir, server.grpc_address, out, push_dtype="bfloat16"))
    msg = str(e.value)
    assert 'push_dtype="bfloat16"' in msg and "serves float32" in msg and 'trainer.push_dtype = "float32"' in msg
    assert 'rollout.engine.dtype = "bfloat16"' in msg and server.grpc_address in msg and "\n" not in msg
    # before step 1: no rollout ran (no metrics line), nothing was pushed, no tensor-by-tensor refusal
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""
    with RolloutClient(server.grpc_address) as client:
        assert client.status().versions.policy == before
    # the dtype the rollout serves: the run starts
    summary = train(config(random_model_dir, server.grpc_address, out, push_dtype="float32", resume=False))
    assert summary.steps_done == 1


def test_auto_on_a_gpu_names_bf16_and_the_fix(server, random_model_dir, tmp_path) -> None:
    """bf16 unset, "auto": the trainer's device decides. A GPU's bf16 (passed as the policy's resolved bf16, as
    train() does) against the float32 server: refused, naming why bf16 and what to set. fp32 (CPU) passes."""
    from tlt.services.rollout.client import RolloutClient

    cfg = SimpleNamespace(push_dtype="auto", bf16=None)
    with RolloutClient(server.grpc_address) as client:
        with pytest.raises(PushDtypeError) as e:
            check_push_dtype(cfg, True, [client])
        check_push_dtype(cfg, False, [client])
        check_push_dtype(SimpleNamespace(push_dtype="float32", bf16=True), True, [client])
    msg = str(e.value)
    assert 'push_dtype="auto" pushes bfloat16 weights (bf16 unset: the trainer trains bf16 on its GPU)' in msg
    assert 'set trainer.push_dtype = "float32"' in msg


def test_an_sglang_server_is_told_to_set_push_dtype_alone(server) -> None:
    """Against an SGLang rollout the refusal named sglang.dtype as the other fix, which does not change the dtype its
    pool takes pushes in (the checkpoint's): only trainer.push_dtype mends it, and the message says so. A real SGLang
    server needs a CUDA GPU (none here), so the unit under test is the start-up check itself, fed the float32
    server's real status with its backend named "sglang", as an SGLang server's status names it."""
    from tlt.services.rollout.client import RolloutClient

    with RolloutClient(server.grpc_address) as client:
        status = client.status()
    status.backend = "sglang"
    sglang = SimpleNamespace(address="127.0.0.1:45101", status=lambda: status)
    with pytest.raises(PushDtypeError) as e:
        check_push_dtype(SimpleNamespace(push_dtype="bfloat16", bf16=None), False, [sglang])
    msg = str(e.value)
    assert 'push_dtype="bfloat16" pushes bfloat16 weights' in msg and "127.0.0.1:45101 serves float32" in msg
    assert 'set trainer.push_dtype = "float32"' in msg and "checkpoint's dtype" in msg
    assert "sglang.dtype" not in msg and "rollout.engine.dtype" not in msg and "\n" not in msg, msg
