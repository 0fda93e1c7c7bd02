"""A trainer checkpoint of ZeRO >= 1 holds one optimizer partition per rank: resumed on another number of ranks it is
refused up front, in one line naming the saved and the current world size (`tlt run`'s check_resume before any
service starts, CheckpointManager.load before DeepSpeed reads anything). ZeRO-1 is the case the suite missed: a
check starting at ZeRO-2 passed every test (the mutation audit's c5). ZeRO-0 keeps no partition: its rank count
is not compared. Real DeepSpeed (CPU, gloo) on a tiny Qwen2 built in code.
"""

from __future__ import annotations

import re

import pytest
import torch

from test_trainer_step import config, tiny_qwen2
from tlt.services.trainer.checkpoint import CheckpointError, CheckpointManager
from tlt.services.trainer.data import PromptSampler, synthetic_prompts
from tlt.services.trainer.policy import Policy


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def _sampler() -> PromptSampler:
    return PromptSampler(synthetic_prompts(4, seed=0), seed=0)


def test_a_zero1_checkpoint_resumed_on_another_world_size_is_refused_up_front(tmp_path, monkeypatch):
    from tlt.services.trainer.procs import ServiceError
    from tlt.services.trainer.run_resume import check_resume

    ckpt = CheckpointManager(tmp_path / "checkpoints", keep=1)
    path = ckpt.save(Policy(config(zero_stage=1), model=tiny_qwen2(0)), _sampler(), 1)
    saved = "saved with zero_stage=1, bf16=false, world_size=1; this run has world_size=2"
    monkeypatch.setenv("WORLD_SIZE", "2")  # `tlt run` under a launcher's world of two
    with pytest.raises(ServiceError, match=re.escape(f"{tmp_path} continues from its trainer checkpoint, {saved}: ")):
        check_resume(tmp_path, {"zero_stage": 1}, model_dir=str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_resume(tmp_path, {"zero_stage": 1}, model_dir=str(tmp_path))  # the same world: resumes

    other = Policy(config(zero_stage=1), model=tiny_qwen2(seed=7))
    monkeypatch.setattr(other, "world_size", 2)  # the trainer's own check, on rank 0 of two
    before = {k: p.detach().clone() for k, p in other.module.named_parameters()}
    with pytest.raises(CheckpointError, match=re.escape(f"{path} was {saved}: keep those settings")) as e:
        ckpt.load(other, _sampler())
    assert "\n" not in str(e.value)
    assert other.version == 0
    assert all(torch.equal(p, before[k]) for k, p in other.module.named_parameters())  # nothing loaded


def test_a_zero0_checkpoint_resumes_on_another_world_size(tmp_path, monkeypatch):
    from tlt.services.trainer.run_resume import check_resume

    CheckpointManager(tmp_path / "checkpoints", keep=1).save(Policy(config(), model=tiny_qwen2(0)), _sampler(), 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_resume(tmp_path, {}, model_dir=str(tmp_path))  # no partitions: the rank count is not compared
