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
