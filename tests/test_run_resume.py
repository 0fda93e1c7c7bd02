"""`tlt run` with real processes on 127.0.0.1: every service launched, a report written, nothing left
running; and resume after `kill -9` of the trainer with no step lost or repeated.

Real parts: the `tlt run` command in a subprocess, which starts `tlt reward serve`, `tlt rollout serve`
(its replica process) and `tlt train` (DeepSpeed on CPU). The model is a seeded random Qwen2 with the
task tokenizer (tests never download; the trained tiny model is not needed to test the plumbing).
Nothing is faked. What `tlt run` decides before it starts anything (the run folder, a resume, the settings
it keeps): tests/test_run_plan.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_helpers import pid_gone

STEPS = 6
PROMPTS = 2
SMALL = ["--set", "trainer.prompts_per_step=2", "--set", "trainer.n_samples=4", "--set", "trainer.max_tokens=12",
         "--set", "trainer.mini_batch_size=8", "--set", "trainer.micro_batch_size=4",
         "--set", "trainer.synthetic_problems=64", "--set", "trainer.torch_threads=1",
         "--set", "trainer.checkpoint_interval=1", "--set", "rollout.threads_per_replica=1",
         "--set", "run.poll_interval_s=0.2", "--set", "trainer.eval_problems=4", "--set", "trainer.eval_interval=2"]


def tlt_run(runs: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tlt.cli", "run", "--quiet", "--set", f"run.runs_dir={runs}", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def all_pids(run_dir: Path) -> list[int]:
    p = json.loads((run_dir / "pids.json").read_text())
    return [v for k, v in p.items() if isinstance(v, int) and k != "launcher"] + p["rollout_replicas"]


def expected_prompt_indices(steps: int) -> list[list[int]]:
    from tlt.services.trainer.data import PromptSampler, synthetic_prompts

    sampler = PromptSampler(synthetic_prompts(64, 0), 0)
    return [[p.index for p in sampler.next_batch(PROMPTS)] for _ in range(steps)]


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"tlt run did not finish in {timeout_s}s:\n{out[-3000:]}")
    return proc.returncode, out


def check_steps(run_dir: Path) -> None:
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(STEPS)), [m["step"] for m in lines]
    assert [m["policy_version"] for m in lines] == list(range(1, STEPS + 1))
    assert [m["prompt_indices"] for m in lines] == expected_prompt_indices(STEPS)
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    # held-out evals before training and after every 2nd step, each exactly once across the kill
    assert [(e["after_steps"], e["policy_version"]) for e in evals] == [(k, k) for k in range(0, STEPS + 1, 2)]


@pytest.mark.slow  # two launches of every service: ~2-3 minutes on the shared 2-core machine
def test_kill_minus_nine_of_the_trainer_then_resume(random_model_dir: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "r"
    # a checkpoint every 2nd step: killed after step 2's line, the resumed trainer starts from the checkpoint
    # after 2 steps, drops that line and runs step 2 again
    args = [a.replace("checkpoint_interval=1", "checkpoint_interval=2") for a in SMALL]
    proc = tlt_run(runs, "--model", str(random_model_dir), "--run-id", "r", "--steps", str(STEPS), "--baseline", *args)
    deadline = time.monotonic() + 300
    while len(metrics(run_dir)) < 3:  # wait for step 2's line (a step takes far longer than this poll)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)
    pids = json.loads((run_dir / "pids.json").read_text())
    services = all_pids(run_dir)
    os.kill(pids["trainer"], signal.SIGKILL)
    rc, out = wait_exit(proc, 120)
    assert rc != 0 and "trainer exited with code -9" in out, out[-3000:]
    killed_after = len(metrics(run_dir))
    assert killed_after == 3 and (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    deadline = time.monotonic() + 30
    while not all(pid_gone(p) for p in services):  # the launcher stopped every service
        assert time.monotonic() < deadline, [p for p in services if not pid_gone(p)]
        time.sleep(0.2)

    proc = tlt_run(runs, "--resume", str(run_dir))
    rc, out = wait_exit(proc, 400)
    assert rc == 0, out[-3000:]
    check_steps(run_dir)  # every step exactly once, data position continued, versions consecutive
    # the resumed launch's log: the steps it ran, each once (it showed the killed run's step 2, then step 2 again;
    # and it logged the earlier launch's steps 0-1 again, under its own time stamps), numbers under their own names
    shown = [int(re.search(r"\bstep=(\d+)", x).group(1)) for x in out.splitlines() if "step_done" in x]
    assert shown == list(range(2, STEPS)), shown
    assert all("reward_wait_s=" in x and "reward=" in x for x in out.splitlines() if "step_done" in x), out[-3000:]
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "checkpoint_loaded" in log and "resumed_from=" in log
    assert (run_dir / "report.html").exists() and (run_dir / "plots" / "timeline.png").exists()
    assert all(pid_gone(p) for p in all_pids(run_dir))


def test_run_end_to_end_writes_report_and_stops_everything(random_model_dir: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "e"
    args = [a.replace("checkpoint_interval=1", "checkpoint_interval=0") for a in SMALL]
    proc = tlt_run(runs, "--model", str(random_model_dir), "--run-id", "e", "--steps", "2", *args)
    rc, out = wait_exit(proc, 300)
    assert rc == 0, out[-3000:]
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [0, 1]
    assert all(m["times"]["rollout_s"] > 0 and m["times"]["update_s"] > 0 and m["times"]["push_s"] > 0 for m in lines)
    assert (run_dir / "timeline.jsonl").read_text().count("\n") > 5  # the rollout's status was sampled
    last = json.loads((run_dir / "rollout_status.json").read_text())  # ... and its last one kept, speculation's view
    assert [r["replica_id"] for r in last["replicas"]] == [0] and last["replicas"][0]["spec"]["mode"] == "adaptive"
    page = (run_dir / "report.html").read_text()
    assert "Speculative decoding at the end of the run" in page  # from rollout_status.json, before the report
    page = page.split("<h2>Speculative decoding")[0]  # the per-step table: its header and one row per step
    assert "Rollout accuracy:" in page and page.count("<tr>") == 3
    # the held-out eval ran before training and after the last step, is in the report and the summary line
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["after_steps"] for e in evals] == [0, 2]
    assert "Held-out accuracy (4 problems" in page and "eval_accuracy=" in out
    # cpu-tiny's eval_greedy: each eval also scored greedy, shown in the report and the summary line
    assert all(isinstance(e["greedy_accuracy"], float) for e in evals)
    assert "greedy (one completion per problem)" in page and "; greedy " in out
    # per-problem counts: the change since the first eval, paired by problem, in the line, the page and a plot
    assert all(len(e["correct"]) == len(e["greedy_correct"]) == 4 for e in evals)
    assert "paired s.e." in out and "a change of" in page and (run_dir / "plots" / "heldout.png").is_file()
    for name in ("logs/reward.log", "logs/rollout.log", "logs/trainer.log", "checkpoints/latest", "policy/config.json"):
        assert (run_dir / name).exists(), name
    # pids.json, rewritten once the trainer starts, still lists the rollout's replica (and the drafter's worker)
    pids = json.loads((run_dir / "pids.json").read_text())
    assert pids["trainer"] and len(pids["rollout_replicas"]) == 1 and len(pids["drafter_workers"]) == 1, pids
    assert all(pid_gone(p) for p in all_pids(run_dir))
    # the online drafter beside the policy (it lived only in the coordinator's checkpoint): its serving weights,
    # a drafter folder the rollout loads, named in the summary line
    import torch

    from tlt.model.drafter import load_drafter
    from tlt.services.drafter.training import load_state, own_tensors, target_shared

    serving = load_state(run_dir / "drafter" / "coordinator.pt")["serving"]
    _, embed, head = target_shared(run_dir / "policy")
    got = own_tensors(load_drafter(run_dir / "policy-drafter", embed, head))
    assert set(got) == set(serving) and all(torch.equal(got[k], serving[k]) for k in serving)
    assert re.search(r"run_done .*drafter=\S*/runs/e/policy-drafter drafter_version=\d", out), out[-2000:]
    assert not list(run_dir.glob(".policy-drafter.tmp-*"))
    record = json.loads((run_dir / "policy-drafter" / "tlt_export.json").read_text())
    version = load_state(run_dir / "drafter" / "coordinator.pt")["serving_version"]
    assert record["drafter_version"] == version and record["policy_steps_done"] == 2 and record["run"] == "e"
    page = (run_dir / "report.html").read_text()
    assert f"holds the drafter the rollout served last (version {version}" in page and "(after 2 steps)" in page
    # --resume of the finished run: no service started (pids.json untouched), the export not redone; said so
    exported, pids_before = (run_dir / "policy" / "tlt_export.json").read_text(), (run_dir / "pids.json").read_text()
    rc, out = wait_exit(tlt_run(runs, "--model", str(random_model_dir), "--resume", str(run_dir), *args), 120)
    assert rc == 0 and "run_already_finished" in out and "--steps N (over 2) trains it further" in out, out[-2000:]
    assert (run_dir / "policy" / "tlt_export.json").read_text() == exported
    assert (run_dir / "pids.json").read_text() == pids_before and "run_done" in out


def test_sigterm_to_tlt_run_stops_every_child(random_model_dir: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "t"
    proc = tlt_run(runs, "--model", str(random_model_dir), "--run-id", "t", "--steps", "50", "--baseline", *SMALL)
    deadline = time.monotonic() + 300
    while not metrics(run_dir):  # training is under way
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    children = all_pids(run_dir)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # an impatient second one, while the services stop: it used to cut the stop
    rc, out = wait_exit(proc, 120)  # short with a traceback, rc -2 and no report
    assert rc == 130, out[-3000:]
    assert all(pid_gone(p) for p in children), [p for p in children if not pid_gone(p)]
    assert "tlt run --resume" in out  # tells how to continue
    assert "Traceback" not in out and "run_done" in out and (run_dir / "report.html").exists(), out[-3000:]
