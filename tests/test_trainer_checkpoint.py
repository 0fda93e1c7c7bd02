"""Checkpoints: exact resume (weights, optimizer, LR schedule, data, RNG), atomicity, and kill -9.

Real DeepSpeed (gloo), a tiny random Qwen2 built in code; the kill -9 test runs
`tlt train` as a subprocess against a real rollout server on 127.0.0.1 and
SIGKILLs it (by its own pid) mid-run. Nothing is faked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_trainer_step import config, make_samples, tiny_qwen2
from tlt.services.trainer.checkpoint import CheckpointManager
from tlt.services.trainer.data import PromptSampler, synthetic_prompts
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def _params(policy):
    return {k: p.detach().clone() for k, p in policy.module.named_parameters()}


def test_resume_is_exact(tmp_path):
    cfg = config(warmup_steps=2, lr_schedule="cosine", steps=3)
    items = synthetic_prompts(10, seed=0)
    ckpt = CheckpointManager(tmp_path / "ck", keep=2)

    a = Policy(cfg, model=tiny_qwen2(0))
    sa = PromptSampler(items, seed=0)
    grpo_step(a, make_samples(2, 4, seed=0), step=0)
    sa.next_batch(3)
    ckpt.save(a, sa, steps_done=1)
    draw_a = torch.rand(3)
    for step in (1, 2):
        grpo_step(a, make_samples(2, 4, seed=step), step=step)
    batch_a = [i.index for i in sa.next_batch(3)]

    b = Policy(cfg, model=tiny_qwen2(seed=7))  # different initial weights: all must come from the checkpoint
    sb = PromptSampler(items, seed=0)
    state = ckpt.load(b, sb)
    assert state.steps_done == 1 and b.version == 1
    assert torch.equal(torch.rand(3), draw_a)  # RNG restored
    for step in (1, 2):
        grpo_step(b, make_samples(2, 4, seed=step), step=step)
    assert [i.index for i in sb.next_batch(3)] == batch_a  # data position restored
    assert b.version == a.version == 3 and b.lr == pytest.approx(a.lr)
    pa, pb = _params(a), _params(b)
    for k in pa:  # optimizer moments and LR schedule restored: identical updates
        torch.testing.assert_close(pb[k], pa[k], atol=1e-7, rtol=0)


def test_incomplete_save_is_ignored_and_cleaned(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ck", keep=1)
    assert ckpt.latest() is None
    p = Policy(config(), model=tiny_qwen2())
    s = PromptSampler(synthetic_prompts(4, seed=0), seed=0)
    first = ckpt.save(p, s, steps_done=1)
    # a save killed half-way: only a .tmp folder exists
    partial = tmp_path / "ck" / ".tmp-step-00000002"
    (partial / "engine").mkdir(parents=True)
    (partial / "engine" / "half-written").write_bytes(b"\0" * 10)
    assert ckpt.latest() == first
    second = ckpt.save(p, s, steps_done=3)
    assert ckpt.latest() == second and not partial.exists() and not first.exists()  # keep=1 pruned the old one


class _Killed(BaseException):
    """A kill -9 at that line of the save."""


@pytest.mark.parametrize("kill_at", ["rename", "replace", "rmtree"])
def test_a_save_over_the_checkpoint_latest_names_survives_a_kill_at_any_point(tmp_path, monkeypatch, kill_at):
    # a run restarted with resume=false in a folder an older run left checkpoints in saves step 2 again: the old
    # step-2 folder, the one `latest` named, was deleted before the new one was renamed into place, and a kill
    # in between left `latest` naming nothing (every later resume: FileNotFoundError)
    from tlt.services.trainer import checkpoint as ck

    ckpt = CheckpointManager(tmp_path / "ck", keep=2)
    p = Policy(config(), model=tiny_qwen2())
    s = PromptSampler(synthetic_prompts(4, seed=0), seed=0)
    old = ckpt.save(p, s, steps_done=2)
    p.version = 7  # the new run's state differs from the old run's
    real = {"rename": ck.os.rename, "replace": ck.os.replace, "rmtree": ck.shutil.rmtree}

    def killed(*a, **kw):
        if kill_at == "rmtree" and ".tmp-" in str(a[0]):
            return real["rmtree"](*a, **kw)  # the stale-tmp sweep before the save
        raise _Killed

    monkeypatch.setattr(ck.os if kill_at != "rmtree" else ck.shutil, kill_at, killed)
    with pytest.raises(_Killed):
        ckpt.save(p, s, steps_done=2)
    monkeypatch.undo()
    latest = ckpt.latest()  # never a FileNotFoundError
    state = torch.load(latest / ck.STATE_FILE, weights_only=False)
    assert state["policy_version"] == (7 if kill_at == "rmtree" else 0) and (latest == old) == (kill_at != "rmtree")
    assert CheckpointManager.steps_of((tmp_path / "ck" / "latest").read_text()) == 2
    again = ckpt.save(p, s, steps_done=2)  # the restarted save completes and cleans up every other step-2 folder
    assert ckpt.latest() == again
    assert [d.name for d in (tmp_path / "ck").iterdir() if d.is_dir()] == [again.name]


@pytest.mark.parametrize("change", [{"hidden_size": 64}, {"eos_token_id": 5}])
def test_checkpoint_of_another_model_is_refused_before_loading(tmp_path, change):
    # the default output_dir (runs/latest) and resume=true pick up a checkpoint of whatever model ran there before:
    # another shape failed with torch's page of "size mismatch" lines (naming neither the checkpoint nor the fix),
    # and a same-shape variant (base vs instruct: another eos token) silently continued the old run's weights
    from transformers import Qwen2ForCausalLM

    from tlt.services.trainer.checkpoint import CheckpointError

    ckpt = CheckpointManager(tmp_path / "ck", keep=1)
    s = PromptSampler(synthetic_prompts(4, seed=0), seed=0)
    path = ckpt.save(Policy(config(), model=tiny_qwen2(0)), s, steps_done=1)
    other_cfg = tiny_qwen2(0).config
    for k, v in change.items():
        setattr(other_cfg, k, v)
    torch.manual_seed(1)
    other = Policy(config(), model=Qwen2ForCausalLM(other_cfg))
    before = _params(other)
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is a checkpoint of another model")) as e:
        ckpt.load(other, PromptSampler(synthetic_prompts(4, seed=0), seed=0))
    assert next(iter(change)) in str(e.value) and "output_dir" in str(e.value)
    assert other.version == 0
    for k, v in _params(other).items():  # refused before DeepSpeed loaded anything
        assert torch.equal(v, before[k])


def test_checkpoint_of_edited_data_of_the_same_size_is_refused_before_loading(tmp_path):
    # the data file edited to the same number of prompts resumed into other prompts without a word; the refusal
    # is a DataError, which `tlt train` reports in one line with exit 2 (like another seed or prompt count)
    from tlt.services.trainer.data import DataError
    from tlt.services.trainer.types import PromptItem

    items = synthetic_prompts(4, seed=0)
    ckpt = CheckpointManager(tmp_path / "ck", keep=1)
    ckpt.save(Policy(config(), model=tiny_qwen2(0)), PromptSampler(items, seed=0), steps_done=1)
    edited = items[:1] + [PromptItem(1, items[1].prompt + " ", items[1].answer)] + items[2:]
    other = Policy(config(), model=tiny_qwen2(seed=7))
    before = _params(other)
    with pytest.raises(DataError, match="4 prompts of other content"):
        ckpt.load(other, PromptSampler(edited, seed=0))
    assert other.version == 0
    for k, v in _params(other).items():  # refused before DeepSpeed loaded anything
        assert torch.equal(v, before[k])


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.slow  # about a minute: two trainer processes and a rollout server
def test_kill_minus_nine_resumes_without_lost_or_repeated_steps(random_model_dir, tmp_path):
    from rollout_helpers import ServerThread
    from tlt.services.rollout.client import RolloutClient

    out = tmp_path / "run"
    steps = 4
    with ServerThread(random_model_dir, replicas=1) as server:
        cmd = [sys.executable, "-m", "tlt.cli", "train", "--config", "cpu-tiny",
               *[f"--set={kv}" for kv in (
                   f"model_dir='{random_model_dir}'", f"rollout_addresses=['{server.grpc_address}']",
                   f"output_dir='{out}'", "prompts_per_step=2", "n_samples=4", "max_tokens=12",
                   "mini_batch_size=8", "micro_batch_size=4", f"steps={steps}", "checkpoint_interval=1",
                   "synthetic_problems=64", "torch_threads=1", "lr=0.001", "reward='task'", "eval_problems=4",
                   "eval_interval=1")]]
        log = (tmp_path / "train.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 240
        while len(_lines(out / "metrics.jsonl")) < 2:
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "trainer made no progress"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        rerun = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=300)
        log.close()
        assert rerun.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]
        with RolloutClient(server.grpc_address) as client:
            serving = client.status().versions.policy
    lines = _lines(out / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(steps))  # each step exactly once
    sampler = PromptSampler(synthetic_prompts(64, 0), seed=0)
    assert [m["prompt_indices"] for m in lines] == [[p.index for p in sampler.next_batch(2)] for _ in range(steps)]
    versions = [m["policy_version"] for m in lines]
    assert versions == sorted(set(versions)) and serving == versions[-1]  # versions only grow; rollout in sync
    evals = _lines(out / "eval.jsonl")  # held-out evals: before training and after every step, each once
    assert [e["after_steps"] for e in evals] == list(range(steps + 1))
    assert (out / "checkpoints" / "step-00000004" / "trainer_state.pt").exists()


def _spread_reward(prompts, completions, **kw):
    """A completion-dependent score: every group has a spread, so every step updates the weights."""
    import zlib

    return [float(zlib.crc32(c.encode()) % 7) / 6.0 for c in completions]


class _Crash(BaseException):
    """The trainer killed right after a checkpoint."""


def test_a_resumed_run_redoes_the_steps_after_its_checkpoint_as_they_first_ran(random_model_dir, tmp_path,
                                                                               monkeypatch):
    # The trainer sent no sampling seed: the rollout drew each request's from its own per-process counter, so the
    # resumed run (its services restarted, or here the same server, further on) sampled other completions in the
    # steps after its checkpoint. Now each rollout server's request is seeded by the run (collect.request_seed).
    from rollout_helpers import ServerThread
    from safetensors.torch import load_file

    from test_trainer_loop import config as loop_config
    from tlt.services.trainer import checkpoint as ck
    from tlt.services.trainer.loop import train

    torch.set_num_threads(1)

    def cfg(out):  # noqa: ANN001, ANN202
        return loop_config(random_model_dir, server.grpc_address, out, reward="python", eval_problems=0,
                           reward_function=f"{__name__}:_spread_reward")

    real_save = ck.CheckpointManager.save

    def save_then_crash(self, policy, sampler, steps_done):  # noqa: ANN001, ANN202
        real_save(self, policy, sampler, steps_done)
        raise _Crash(f"killed after checkpoint {steps_done}")

    with ServerThread(random_model_dir, replicas=1) as server:
        train(cfg(tmp_path / "a"))  # two steps, uninterrupted
        monkeypatch.setattr(ck.CheckpointManager, "save", save_then_crash)
        with pytest.raises(_Crash):
            train(cfg(tmp_path / "b"))
        monkeypatch.undo()
        assert train(cfg(tmp_path / "b")).resumed_from == 1
    keys = ("step", "prompt_indices", "tokens", "response_len_mean", "reward_mean", "loss")
    a, b = ([{k: m[k] for k in keys} for m in _lines(tmp_path / run / "metrics.jsonl")] for run in "ab")
    assert [m["step"] for m in a] == [0, 1] and b == a
    p0, pa, pb = (load_file(d / "model.safetensors") for d in (random_model_dir, tmp_path / "a" / "policy",
                                                                  tmp_path / "b" / "policy"))
    assert any(not torch.equal(p0[k], pa[k].to(p0[k].dtype)) for k in pa)  # the steps trained
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("change, now", [({"zero_stage": 2}, "zero_stage=2"), ({"bf16": True}, "bf16=true")])
def test_a_resume_with_another_zero_stage_or_bf16_is_refused_in_one_line_before_loading(tmp_path, change, now):
    # DeepSpeed's optimizer state is laid out by the ZeRO stage and precision: a resume with another one failed deep in
    # load_checkpoint (FileNotFoundError .../zero_pp_rank_0_mp_rank_00_optim_states.pt, KeyError 'dynamic_loss_scale'),
    # and `tlt run --resume` started every service first
    from tlt.services.trainer.checkpoint import CheckpointError
    from tlt.services.trainer.run_resume import check_resume
    from tlt.services.trainer.procs import ServiceError

    ckpt = CheckpointManager(tmp_path / "checkpoints", keep=1)
    path = ckpt.save(Policy(config(), model=tiny_qwen2(0)), PromptSampler(synthetic_prompts(4, seed=0), 0), 1)
    saved = "saved with zero_stage=0, bf16=false; this run has " + now
    with pytest.raises(ServiceError, match=re.escape(f"{tmp_path} continues from its trainer checkpoint, {saved}: ")):
        check_resume(tmp_path, change, model_dir=str(tmp_path))  # `tlt run`: before any service starts
    other = Policy(config(**change), model=tiny_qwen2(seed=7))
    before = _params(other)
    with pytest.raises(CheckpointError, match=re.escape(f"{path} was {saved}: keep those settings")) as e:
        ckpt.load(other, PromptSampler(synthetic_prompts(4, seed=0), seed=0))
    assert "\n" not in str(e.value) and "resume=false" in str(e.value)
    assert other.version == 0
    for k, v in _params(other).items():  # refused before DeepSpeed loaded anything
        assert torch.equal(v, before[k])


def test_a_checkpoint_saved_before_the_engine_settings_were_kept_still_loads(tmp_path):
    from tlt.services.trainer.checkpoint import STATE_FILE
    from tlt.services.trainer.run_resume import check_resume

    ckpt = CheckpointManager(tmp_path / "checkpoints", keep=1)
    path = ckpt.save(Policy(config(), model=tiny_qwen2(0)), PromptSampler(synthetic_prompts(4, seed=0), 0), 1)
    raw = torch.load(path / STATE_FILE, weights_only=False)
    torch.save({k: v for k, v in raw.items() if k not in ("zero_stage", "bf16", "world_size")}, path / STATE_FILE)
    check_resume(tmp_path, {}, model_dir=str(tmp_path))
    state = ckpt.load(Policy(config(), model=tiny_qwen2(7)), PromptSampler(synthetic_prompts(4, seed=0), 0))
    assert state.steps_done == 1 and state.zero_stage is None


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_resume_trains_with_this_run_s_lr_weight_decay_and_betas(tmp_path, zero_stage):
    # `tlt run --resume DIR --set trainer.lr=1e-5` (after diverged steps): DeepSpeed's load_checkpoint brought back the
    # checkpoint's param_groups and the scheduler's base_lrs, and the run trained on with the old lr and weight decay
    from tlt.services.trainer.policy import lr_lambda

    items = synthetic_prompts(8, seed=0)
    ckpt = CheckpointManager(tmp_path / "ck", keep=1)
    a = Policy(config(zero_stage=zero_stage, warmup_steps=3, lr_schedule="cosine", steps=4), model=tiny_qwen2(0))
    grpo_step(a, make_samples(2, 4, seed=0), step=0)
    ckpt.save(a, PromptSampler(items, 0), steps_done=1)
    moments = a.optimizer.state_dict()

    cfg = config(zero_stage=zero_stage, warmup_steps=3, lr_schedule="cosine", steps=4, lr=1e-5, weight_decay=0.1,
                 adam_betas=(0.8, 0.99))
    b = Policy(cfg, model=tiny_qwen2(7))
    ckpt.load(b, PromptSampler(items, 0))
    factor = lr_lambda(3, 4, "cosine")
    position = b.scheduler.last_epoch
    assert position == a.scheduler.last_epoch == 1  # the schedule's position is the checkpoint's
    for group in b.optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-5 * factor(position)) and group["weight_decay"] == 0.1
        assert tuple(group["betas"]) == (0.8, 0.99)
    assert b.scheduler.base_lrs == [1e-5] and b.scheduler.get_last_lr() == [b.lr]
    _assert_same(b.optimizer.state_dict(), moments)  # the Adam moments are the checkpoint's
    grpo_step(b, make_samples(2, 4, seed=1), step=1)
    assert b.lr == pytest.approx(1e-5 * factor(position + 1))  # the schedule goes on from the new peak lr


def _assert_same(got, want) -> None:  # noqa: ANN001 - optimizer state dicts (nested dicts, lists and tensors)
    """Every tensor of the optimizer state `want` (moments, step counts) equal in `got`; settings are not compared."""
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        for k, v in want.items():
            if k != "param_groups":
                _assert_same(got[k], v)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)


def test_latest_naming_a_missing_checkpoint_is_a_one_line_refusal(tmp_path):
    # checkpoints/latest naming a folder removed by hand (or not copied along) ended the trainer with a
    # FileNotFoundError traceback; `tlt train` reports a CheckpointError in one line (exit 2)
    from tlt.services.trainer.checkpoint import LATEST, CheckpointError
    from tlt.services.trainer.run_resume import latest_state

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / LATEST).write_text("step-00000003\n")
    with pytest.raises(CheckpointError, match="names step-00000003, which is not a complete checkpoint: .*resume="):
        CheckpointManager(tmp_path / "checkpoints").latest()
    assert latest_state(tmp_path) is None  # `tlt run` leaves it to the trainer to say


def test_a_checkpoint_that_cannot_be_written_is_one_error_and_leaves_the_last_whole_one(tmp_path) -> None:
    """A full disk mid-save ended the trainer in an OSError / "basic_ios::clear" traceback and left the partial
    folder taking the space. It is a CheckpointWriteError (an OSError `tlt train` reports in one line) saying where
    and that the run resumes from its last complete checkpoint; the partial folder goes, `latest` is untouched.
    (DeepSpeed's writer is made to fail as on a full disk: no disk can be filled here.)"""
    import errno
    from pathlib import Path
    from types import SimpleNamespace

    from tlt.services.trainer.checkpoint import CheckpointManager, CheckpointWriteError

    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step-00000001\n")

    def full_disk(path, **kw):  # noqa: ANN001, ANN003, ANN202
        (Path(path) / "engine").mkdir(parents=True)
        (Path(path) / "engine" / "part").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    policy = SimpleNamespace(engine=SimpleNamespace(save_checkpoint=full_disk))
    with pytest.raises(CheckpointWriteError, match=r"after 2 steps could not be written .*No space left.*resumes"):
        CheckpointManager(root).save(policy, None, 2)
    assert sorted(p.name for p in root.iterdir()) == ["latest"] and (root / "latest").read_text() == "step-00000001\n"
