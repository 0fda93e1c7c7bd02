"""`tlt bench e2e --pairs K`: the run order alternates, and the per-pair ratios are what they say.

The bench itself launches whole `tlt run`s (minutes each), which the slow e2e runs in BENCHMARKS.md
exercise; here only its pure parts: the order and the arithmetic, on hand-made results.
"""

from __future__ import annotations

import pytest

from tlt.bench.e2e import SKIP_NOISE, pair_ratios, planned_runs, rollout_bound, run_order


def test_one_pair_is_the_old_order():
    assert run_order(1) == [("tlt", False), ("baseline", True)]


def test_pairs_alternate_which_runs_first():
    assert run_order(3) == [
        ("tlt", False), ("baseline", True),
        ("baseline-2", True), ("tlt-2", False),
        ("tlt-3", False), ("baseline-3", True),
    ]
    with pytest.raises(ValueError, match="at least 1"):
        run_order(0)


def test_pair_ratios_by_hand():
    def r(step, rollout):
        return {"mean_step_s": step, "mean_rollout_s": rollout}

    results = {
        "tlt": r(5.0, 1.0), "baseline": r(4.0, 1.5),      # 0.8, 1.5
        "tlt-2": r(4.0, 2.0), "baseline-2": r(5.0, 1.0),  # 1.25, 0.5
        "tlt-3": r(4.0, 1.0), "baseline-3": r(4.4, 1.2),  # 1.1, 1.2
    }
    got = pair_ratios(results, 3)
    assert got["step_time_ratios"] == pytest.approx([0.8, 1.25, 1.1])
    assert got["step_time_ratio_median"] == pytest.approx(1.1)
    assert got["step_time_ratio_range"] == pytest.approx([0.8, 1.25])
    assert got["rollout_time_ratios"] == pytest.approx([1.5, 0.5, 1.2])
    assert got["rollout_time_ratio_median"] == pytest.approx(1.2)
    assert got["step_time_ratio_pooled"] == pytest.approx((4.0 + 5.0 + 4.4) / (5.0 + 4.0 + 4.0))
    assert got["rollout_time_ratio_pooled"] == pytest.approx((1.5 + 1.0 + 1.2) / (1.0 + 2.0 + 1.0))
    assert got["baseline_step_spread"] == pytest.approx(5.0 / 4.0) and got["tlt_step_spread"] == pytest.approx(5.0 / 4.0)


def test_rollout_bound_by_hand():
    # baseline: 5 s steps of which 1 s rollout; TLT's rollout 0.5 s (2x), its steps 6 s (costs elsewhere)
    got = rollout_bound({"mean_step_s": 6.0, "mean_rollout_s": 0.5}, {"mean_step_s": 5.0, "mean_rollout_s": 1.0})
    assert got["rollout_share"] == pytest.approx(0.2)
    assert got["step_ratio_ceiling"] == pytest.approx(5.0 / 4.0)  # an instant rollout: 5 s -> 4 s
    assert got["step_ratio_from_rollout"] == pytest.approx(5.0 / 4.5)  # the 2x rollout alone: 5 s -> 4.5 s
    # a rollout-dominated step (the paper's regime): 80% rollout, 2x faster -> 1.67x at most from it
    got = rollout_bound({"mean_step_s": 6.0, "mean_rollout_s": 4.0}, {"mean_step_s": 10.0, "mean_rollout_s": 8.0})
    assert got["step_ratio_ceiling"] == pytest.approx(5.0)
    assert got["step_ratio_from_rollout"] == pytest.approx(10.0 / 6.0)
    # not measured (no time): None, not 0.0 (which reads as a measurement), and never infinity (not JSON)
    assert rollout_bound({"mean_step_s": 1.0, "mean_rollout_s": 1.0}, {"mean_step_s": 0.0, "mean_rollout_s": 0.0}) == {
        "rollout_share": None, "step_ratio_ceiling": None, "step_ratio_from_rollout": None}
    assert rollout_bound({"mean_step_s": 1.0, "mean_rollout_s": 1.0}, {"mean_step_s": 2.0, "mean_rollout_s": 2.0})[
        "step_ratio_ceiling"] is None  # the whole step was rollout: no ceiling


def _stub_runs(monkeypatch, steps: int, evals: list[dict] | None = None,  # noqa: ANN001, ANN202
               windows: list[dict] | None = None, per_step=None):  # noqa: ANN001
    """Make `tlt bench e2e` find run folders written by hand (`steps` steps of 3 s, 1 s of it rollout, reward 0.5, or
    what `per_step(name, k)` gives as (step_s, rollout_s, reward); `evals` as eval.jsonl, and for TLT's runs `windows`
    as drafter.jsonl, the drafter at version k // 2 in step k) instead of running `tlt run`. Returns the module and a
    function that runs the bench's CLI."""
    import argparse
    import json

    from tlt.bench import e2e

    def fake_run(name, out, args, seed, baseline, extra=()):  # noqa: ANN001, ANN202
        run = out / name
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"switches": {"speculation": not baseline, "drafter": not baseline}}))
        drafter = {} if baseline or windows is None else {"drafter_version": None}
        figures = [per_step(name, k) if per_step else (3.0, 1.0, 0.5) for k in range(steps)]
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": k, "reward_mean": reward, "started_at": 1.0 + k,
                        "times": {"step_s": step_s, "rollout_s": rollout_s}, **{key: k // 2 for key in drafter}}) + "\n"
            for k, (step_s, rollout_s, reward) in enumerate(figures)))
        if drafter:
            (run / "drafter.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
        if evals is not None:
            (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
        return 0

    monkeypatch.setattr(e2e, "_run", fake_run)
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    return lambda *argv: e2e.run(parser.parse_args(list(argv)))


def test_one_step_reports_the_steps_after_the_first_as_not_measured(tmp_path, monkeypatch, capsys):
    """`--steps 1` has no step after the first: the bench printed 0.00 for every run and a ratio of 0.0 ("TLT
    infinitely slower"); they are None in results.json and "-" in the table. (The runs are stubbed: a one-step run
    folder written by hand, not `tlt run`.)"""
    import json

    bench = _stub_runs(monkeypatch, steps=1)
    assert bench("--steps", "1", "--out", str(tmp_path / "b")) == 0
    summary = json.loads((tmp_path / "b" / "results.json").read_text())["summary"]
    assert summary["step_time_ratio_after_first"] is None and summary["step_time_ratio"] == 1.0
    assert "| 3.00 | - |" in capsys.readouterr().out


def test_the_noise_run_keeps_the_prompts_and_changes_only_the_sampling_seed():
    """The noise run was the baseline with another trainer --seed, which picks the synthetic problem set and its
    order: it saw other prompts at every step, and prompt difficulty made the "noise" the reward check compares
    with 5x larger than TLT-vs-baseline's difference could be. Now only the rollout's sampling seed changes: the
    trainer's (trainer.sampling_seed), which it seeds every rollout request from; [rollout.engine] seed, which the
    noise run set before, seeds only requests that come unseeded, so it changed nothing."""
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import PromptSampler, synthetic_prompts
    from tlt.services.trainer.evaluate import sampling_seed

    runs = planned_runs(3, 1, 7)
    assert runs == {"tlt": (3, False, ()), "baseline": (3, True, ()),
                    "baseline-noise": (3, True, ("trainer.sampling_seed=7",))}
    (override,) = runs["baseline-noise"][2]
    field, value = override.removeprefix("trainer.").split("=")
    noise = TrainerConfig(seed=3, **{field: int(value)})
    assert sampling_seed(noise) == 7 != sampling_seed(TrainerConfig(seed=3)) and noise.seed == 3
    assert "baseline-noise" not in planned_runs(3, 2, SKIP_NOISE)
    # what the trainer draws from its --seed: the same for all three runs
    draw = [[p.prompt for p in PromptSampler(synthetic_prompts(64, s), s).next_batch(8)] for s, _, _ in runs.values()]
    assert draw[0] == draw[1] == draw[2]


def test_the_table_and_results_carry_the_greedy_held_out_accuracy(tmp_path, monkeypatch, capsys):
    """With [trainer] eval_greedy the runs' evals have a greedy figure: results.json keeps it per eval and the
    table shows it beside the sampled curve. (The runs are stubbed: run folders written by hand, not `tlt run`.)"""
    import json

    record = dict(problems=4, samples=2, temperature=1.0, seconds=1.0)
    evals = [dict(after_steps=0, policy_version=0, accuracy=0.398, greedy_accuracy=0.42, **record),
             dict(after_steps=2, policy_version=2, accuracy=0.395, greedy_accuracy=0.445, **record)]
    bench = _stub_runs(monkeypatch, steps=2, evals=evals)
    assert bench("--steps", "2", "--out", str(tmp_path / "b")) == 0
    runs = json.loads((tmp_path / "b" / "results.json").read_text())["runs"]
    assert runs["tlt"]["eval_greedy_accuracy"] == [0.42, 0.445]
    assert "| 0.398 -> 0.395 (greedy 0.420 -> 0.445) |" in capsys.readouterr().out


def test_the_table_and_results_say_what_the_online_drafter_did(tmp_path, monkeypatch, capsys):
    """Session 37's GPU runs: TLT's online drafter trained 0-1 micro-steps in 6 steps and was never swapped, which
    the bench did not show (its table said only "drafter on"). results.json now has the serving drafter's version
    per step and the training windows' micro-steps; the table sums them. (Stubbed run folders, not `tlt run`.)"""
    import json

    windows = [dict(worker_id=0, replica_id=0, start=1.0, end=1.5, micro_steps=0, preempted=True),
               dict(worker_id=0, replica_id=0, start=2.0, end=2.9, micro_steps=7, preempted=True),
               dict(worker_id=0, replica_id=0, start=4.0, end=4.2, micro_steps=5, preempted=False)]
    bench = _stub_runs(monkeypatch, steps=4, windows=windows)
    assert bench("--steps", "4", "--out", str(tmp_path / "b")) == 0
    runs = json.loads((tmp_path / "b" / "results.json").read_text())["runs"]
    assert runs["tlt"]["drafter_version"] == [0, 0, 1, 1]
    assert runs["tlt"]["drafter_windows"] == 3 and runs["tlt"]["drafter_micro_steps"] == 12
    assert runs["baseline"]["drafter_version"] == [-1] * 4 and runs["baseline"]["drafter_windows"] == 0
    out = capsys.readouterr().out
    assert "| on | 12 micro-steps in 3 windows, v0 -> v1 | 3.00 |" in out
    assert "| off | - | 3.00 |" in out


def test_the_summary_ratios_are_baseline_over_tlt_and_the_reward_check_compares_with_the_noise(tmp_path, monkeypatch):
    """The summary's figures by hand (stubbed run folders with other times per run): TLT 2 s steps with 0.5 s
    rollouts after a 6 s first step, the baseline 4 s steps (8 s first) with 2 s rollouts; TLT's rewards 0.1 from the
    baseline's each step, the noise run's 0.2 from it. A ratio > 1 means TLT is faster."""
    import json

    def per_step(name, k):  # noqa: ANN001, ANN202
        first = k == 0
        if name == "tlt":
            return (6.0 if first else 2.0), 0.5, 0.6 + 0.1 * (k % 2)
        extra = 0.2 if name == "baseline-noise" else 0.0
        return (8.0 if first else 4.0), 2.0, 0.5 + 0.1 * (k % 2) + extra

    bench = _stub_runs(monkeypatch, steps=3, per_step=per_step)
    assert bench("--steps", "3", "--out", str(tmp_path / "b")) == 0
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    summary = results["summary"]
    assert [results["runs"][n]["sampling_seed"] for n in ("tlt", "baseline")] == [None, None]
    assert type(results["runs"]["baseline-noise"]["sampling_seed"]) is int  # as the config reads it (was "7")
    assert summary["step_time_ratio"] == pytest.approx((8 + 4 + 4) / (6 + 2 + 2))
    assert summary["step_time_ratio_after_first"] == pytest.approx(2.0)  # the first (warm-up) step left out
    assert summary["rollout_time_ratio"] == pytest.approx(4.0)
    assert summary["reward_step_mad_tlt_vs_baseline"] == pytest.approx(0.1)
    assert summary["reward_step_mad_noise"] == pytest.approx(0.2)
    assert summary["rewards_agree"] is True  # 0.1 <= 1.5 x 0.2
    bench = _stub_runs(monkeypatch, steps=3, per_step=lambda name, k: (3.0, 1.0, 0.9 if name == "tlt" else 0.5))
    assert bench("--steps", "3", "--out", str(tmp_path / "c")) == 0
    summary = json.loads((tmp_path / "c" / "results.json").read_text())["summary"]
    assert summary["rewards_agree"] is False  # 0.4 apart, the two baselines 0 apart


def test_the_baseline_runs_are_launched_with_baseline_and_tlt_without(tmp_path, monkeypatch):
    """The tests above stub `_run`; this checks its command line: `--baseline` on the baseline runs only, the
    trainer seed, and each run's own override after the user's."""
    import argparse
    import subprocess

    from tlt.bench import e2e

    cmds: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: cmds.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(["--seed", "3", "--set", "trainer.max_tokens=64"])
    for name, (seed, baseline, extra) in planned_runs(3, 1, 7).items():
        assert e2e._run(name, tmp_path, args, seed, baseline, extra) == 0
    (tlt, base, noise) = cmds
    assert "--baseline" not in tlt and "--baseline" in base and "--baseline" in noise
    for cmd in cmds:
        assert cmd[cmd.index("--seed") + 1] == "3"
    sets = [noise[i + 1] for i, a in enumerate(noise) if a == "--set"]
    assert sets[-2:] == ["trainer.max_tokens=64", "trainer.sampling_seed=7"]
