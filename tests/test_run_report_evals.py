"""The report and `tlt run`'s last line on the held-out evals: evals marked on the timeline, greedy accuracy beside
the sampled one, the change since the first eval paired by problem with its standard error, and the sharper paired
check's command when that change is within the evals' noise. Hand-made run files; values checked against
hand-computed numbers. Split from test_run_report.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from report_helpers import saved_axes as _saved_axes, write_metrics as _metrics
from tlt.services.trainer.report import write_report
from tlt.services.trainer.run_stats import TimelineSample


def test_timeline_plot_marks_held_out_evals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a held-out eval runs 800 sequences through the rollout between steps: unmarked, its batch-64 plateau read as a
    # step's rollout (in a 6-step run evals were most of the plot)
    from tlt.services.trainer.evaluate import EvalRecord

    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"reward_mean": 0.5}])
    (tmp_path / "timeline.jsonl").write_text("".join(
        TimelineSample(t, (r,), (0,), (False,), 1, -1).to_json() + "\n" for t, r in
        [(100.0, 0), (101.0, 64), (120.0, 64), (130.0, 0), (140.0, 32), (150.0, 0)]))
    (tmp_path / "eval.jsonl").write_text(
        json.dumps(EvalRecord(0, 0, 0.3, 200, 4, 1.0, 28.5, started_at=100.5).as_dict()) + "\n"
        + json.dumps({"after_steps": 1, "policy_version": 1, "accuracy": 0.4, "problems": 200, "samples": 4,
                      "temperature": 1.0, "seconds": 9.0}) + "\n")  # an older record: no start time, not drawn
    write_report(tmp_path, threshold=16)
    ax = saved["timeline.png"][0]
    spans = [p for p in ax.patches if p.get_gid() == "held-out eval"]
    assert len(spans) == 1
    assert spans[0].get_x() == pytest.approx(0.5) and spans[0].get_width() == pytest.approx(28.5)
    assert "held-out eval" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_report_draws_and_states_greedy_held_out_accuracy_beside_the_sampled(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # eval_greedy: each eval also scored one greedy completion per problem (a deployment's pass@1); the sampled
    # accuracy stayed flat while the greedy one rose, so the report shows both curves and both start -> end
    from tlt.services.trainer.evaluate import EvalRecord

    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"reward_mean": 0.5, "accuracy": 0.4}] * 3)
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps(EvalRecord(k, k, a, 200, 4, 1.0, 9.0, greedy_accuracy=g).as_dict()) + "\n"
        for k, a, g in [(0, 0.401, 0.43), (2, 0.398, 0.45), (3, 0.394, 0.465)]))
    page = write_report(tmp_path, threshold=16).read_text()
    ax = saved["reward.png"][0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "held-out, sampled (200 problems, T = 1, 4 per problem)" in labels and "held-out, greedy" in labels
    greedy = ax.lines[labels.index("held-out, greedy")]
    assert list(greedy.get_xdata()) == [-0.5, 1.5, 2.5] and list(greedy.get_ydata()) == [0.43, 0.45, 0.465]
    sampled = ax.lines[labels.index("held-out, sampled (200 problems, T = 1, 4 per problem)")]
    assert list(sampled.get_xdata()) == [-0.5, 1.5, 2.5] and list(sampled.get_ydata()) == [0.401, 0.398, 0.394]
    assert "<b>0.401</b> after 0 steps &rarr; <b>0.394</b> after 3 steps" in page
    assert "greedy (one completion per problem): <b>0.430</b> after 0 steps &rarr; <b>0.465</b> after 3 steps" in page
    assert "(every eval: 0: 0.401, 2: 0.398, 3: 0.394);" in page and "(every eval: 0: 0.430, 2: 0.450, 3: 0.465)." in page
    # without greedy records (eval_greedy off, or a run from before it): one curve and the line as it was
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps(EvalRecord(k, k, 0.4, 200, 4, 1.0, 9.0).as_dict()) + "\n" for k in (0, 3)))
    page = write_report(tmp_path, threshold=16).read_text()
    labels = [t.get_text() for t in saved["reward.png"][0].get_legend().get_texts()]
    assert labels[-1] == "held-out accuracy (200 problems x 4, T=1)" and not any("greedy" in x for x in labels)
    assert "greedy" not in page


def test_report_states_and_draws_the_change_since_the_first_eval_paired_by_problem(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A 50-step run's held-out rise of 1-3 points is invisible on reward.png's 0..1 axis and within two independent
    accuracies' noise: with per-problem counts the report gives each eval's change since the first, paired by
    problem, with its 95% interval (heldout.png) and states the last one with its s.e. Hand values: 4 problems x 2
    samples, sampled 0, .5, 1, .5 -> .5, .5, 1, 1 (mean difference +25 points, s.e. 14.4); greedy 0, 1, 1, 0 ->
    1, 1, 1, 0 (+25, s.e. 25)."""
    from tlt.services.trainer.evaluate import EvalRecord

    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"reward_mean": 0.5, "accuracy": 0.4}] * 3)
    recs = [EvalRecord(0, 0, 0.5, 4, 2, 1.0, 9.0, greedy_accuracy=0.5, correct=(0, 1, 2, 1), greedy_correct=(0, 1, 1, 0)),
            EvalRecord(3, 3, 0.75, 4, 2, 1.0, 9.0, greedy_accuracy=0.75, correct=(1, 1, 2, 2),
                       greedy_correct=(1, 1, 1, 0))]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r.as_dict()) + "\n" for r in recs))
    page = write_report(tmp_path, threshold=16).read_text()
    assert "a change of <b>+25.0 points</b> (paired s.e. 14.4; 95% -3.3 .. +53.3)" in page
    assert "a change of <b>+25.0 points</b> (paired s.e. 25.0; 95% -24.0 .. +74.0)" in page
    assert "heldout.png" in page
    (ax,) = saved["heldout.png"]
    bars = {c.get_label().split(" ")[0]: c for c in ax.containers}  # "sampled (T = 1, 2 per problem)", "greedy"
    sampled_line = bars["sampled"].lines[0]
    assert list(sampled_line.get_ydata()) == pytest.approx([0.0, 25.0])
    (segments,) = bars["sampled"].lines[2]  # the error bars: 1.96 s.e. either side
    ys = [seg[:, 1] for seg in segments.get_segments()]
    assert ys[1] == pytest.approx([25.0 - 1.96 * 14.4338, 25.0 + 1.96 * 14.4338], abs=1e-3)
    assert list(bars["greedy"].lines[0].get_ydata()) == pytest.approx([0.0, 25.0])
    # greedy evals (eval_temperature 0): one curve, the sampled pass is the greedy one
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(EvalRecord(k, k, 0.5, 4, 1, 0.0, 9.0, greedy_accuracy=0.5,
                                                                       correct=c).as_dict()) + "\n"
                                                 for k, c in [(0, (0, 1, 1, 0)), (3, (1, 1, 1, 0))]))
    write_report(tmp_path, threshold=16)
    assert [c.get_label() for c in saved["heldout.png"][0].containers] == ["greedy"]
    # records from before the counts were kept: no plot and no paired figure, the line as it was
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps(EvalRecord(k, k, 0.4, 200, 4, 1.0, 9.0).as_dict()) + "\n" for k in (0, 3)))
    saved.clear()
    page = write_report(tmp_path, threshold=16).read_text()
    assert "heldout.png" not in saved and "a change of" not in page and "heldout.png" not in page


def test_a_change_within_the_evals_noise_points_to_a_sharper_paired_check(tmp_path: Path) -> None:
    """An in-run eval of 800-1,600 sampled completions puts a 1-point change within its noise (paired s.e. ~1-1.2
    points), while `tlt model eval --against` with 500 problems x 8 samples resolves it (s.e. ~0.6; BENCHMARKS.md,
    End to end, Session 40). When the last eval's sampled change has a 95% interval holding 0, the report says what the
    eval can resolve and gives that command for this run's policy and start; not when the interval excludes 0, nor
    when no such check exists (other eval data, another temperature, no saved policy). Hand values: 4 problems x 2
    samples, 0, .5, 1, .5 -> .5, .5, 1, .5 (+12.5 points, s.e. 12.5: 1.96 s.e. = 24.5)."""
    from tlt.services.trainer.evaluate import EvalRecord
    from tlt.services.trainer.report import sharper_check

    def evals(last: tuple[int, ...], temperature: float = 1.0) -> list[EvalRecord]:
        recs = [EvalRecord(0, 0, 0.5, 4, 2, temperature, 9.0, correct=(0, 1, 2, 1)),
                EvalRecord(3, 3, 0.6, 4, 2, temperature, 9.0, correct=last)]
        (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r.as_dict()) + "\n" for r in recs))
        return recs

    _metrics(tmp_path, [{"reward_mean": 0.5, "accuracy": 0.4}] * 3)
    start = tmp_path / "start model"  # a path with a space: the command quotes it
    config = f"[trainer]\nmodel_dir = {json.dumps(str(start))}\neval_problems = 4\n"
    (tmp_path / "config.toml").write_text(config)
    (tmp_path / "policy").mkdir()
    within = evals((1, 1, 2, 1))
    expected = f"tlt model eval --model {tmp_path / 'policy'} --against '{start}' --n 500 --samples 8"
    assert sharper_check(tmp_path, within) == expected
    # no change on any problem (an interval of 0 .. 0) is within the noise too, not a resolved change
    assert sharper_check(tmp_path, evals((0, 1, 2, 1))) == expected
    within = evals((1, 1, 2, 1))
    page = write_report(tmp_path, threshold=16).read_text()
    assert ("with 8 sampled completions an eval cannot tell a change under about 24.5 points from none" in page
            and f"<code>{expected.replace(chr(39), '&#x27;')}</code>" in page), page
    # a change beyond the noise: 0, .5, 1, .5 -> 1, 1, 1, 1 (+37.5 points, s.e. 12.5): nothing to add
    assert sharper_check(tmp_path, evals((2, 2, 2, 2))) is None
    assert "sharper" not in write_report(tmp_path, threshold=16).read_text()
    # a fall beyond the noise: 0, .5, 1, .5 -> 0, 0, 0, 0 (-50 points, s.e. 20.4; 95% -90 .. -10): nothing either
    assert sharper_check(tmp_path, evals((0, 0, 0, 0))) is None
    # the last eval's change is the one judged, not the second's: within the noise after 3 steps, beyond it after 6
    beyond = EvalRecord(6, 6, 1.0, 4, 2, 1.0, 9.0, correct=(2, 2, 2, 2))
    assert sharper_check(tmp_path, [*within, beyond]) is None
    assert sharper_check(tmp_path, [within[0], beyond, within[1]]) == expected
    # no check to point to: evals at another temperature, the run's own eval data, no policy saved, one eval
    assert sharper_check(tmp_path, evals((1, 1, 2, 1), temperature=0.7)) is None
    (tmp_path / "config.toml").write_text(config + 'eval_data_path = "eval.jsonl"\n')
    assert sharper_check(tmp_path, within) is None
    (tmp_path / "config.toml").write_text(config)
    (tmp_path / "policy").rmdir()
    assert sharper_check(tmp_path, within) is None
    (tmp_path / "policy").mkdir()
    assert sharper_check(tmp_path, within[:1]) is None
    assert sharper_check(tmp_path, within) == expected


def test_report_of_a_run_stopped_before_its_first_eval_does_not_say_evals_were_off(tmp_path: Path) -> None:
    """A run configured for held-out evals but stopped before the first: the report blamed eval_problems = 0 and
    printed a rollout accuracy of 0.000 over "the first 0 steps"."""
    (tmp_path / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "tail_threshold": 16}))
    (tmp_path / "config.toml").write_text("[trainer]\neval_problems = 200\n")
    page = write_report(tmp_path).read_text()
    assert "eval_problems = 0" not in page and "No held-out eval recorded" in page
    assert "first 0 steps" not in page and "No step finished" in page
    (tmp_path / "config.toml").write_text("[trainer]\neval_problems = 0\n")
    assert "eval_problems = 0" in write_report(tmp_path).read_text()


def test_the_closing_line_gives_the_sharper_check_when_the_change_is_within_noise(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`tlt run`'s last line (what `make run` leaves on the terminal) carries the same command as the report."""
    import argparse
    import time
    from types import SimpleNamespace

    from tlt.services.trainer.evaluate import EvalRecord
    from tlt.services.trainer.launch import _finish

    recs = [EvalRecord(0, 0, 0.5, 4, 2, 1.0, 9.0, correct=(0, 1, 2, 1)),
            EvalRecord(3, 3, 0.625, 4, 2, 1.0, 9.0, correct=(1, 1, 2, 1))]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r.as_dict()) + "\n" for r in recs))
    (tmp_path / "config.toml").write_text('[trainer]\nmodel_dir = "artifacts/tiny"\n')
    (tmp_path / "policy").mkdir()
    args, plan = argparse.Namespace(no_report=True), SimpleNamespace(run_dir=tmp_path, tail_threshold=16,
                                                                                      services={}, switches={})
    assert _finish(args, plan, 0, time.monotonic()) == 0
    out = "".join(capsys.readouterr())
    assert "run_done" in out and "(+0.125, paired s.e. 0.125)" in out, out
    assert f"tlt model eval --model {tmp_path / 'policy'} --against artifacts/tiny --n 500 --samples 8" in out, out
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r.as_dict()) + "\n" for r in recs[:1]))
    _finish(args, plan, 0, time.monotonic())
    out = "".join(capsys.readouterr())
    assert "run_done" in out and "sharper_check" not in out, out


def test_the_greedy_line_starts_at_the_first_eval_that_scored_greedy_and_is_not_repeated_at_t0(tmp_path: Path) -> None:
    # a run resumed with eval_greedy turned on: its first eval has no greedy accuracy; the greedy start -> end runs
    # from the first eval that has one (from evals[0], the report failed on its missing value)
    from tlt.services.trainer.evaluate import EvalRecord

    _metrics(tmp_path, [{"reward_mean": 0.5, "accuracy": 0.4}] * 3)
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps(EvalRecord(k, k, a, 200, 4, 1.0, 9.0, greedy_accuracy=g).as_dict()) + "\n"
        for k, a, g in [(0, 0.401, None), (2, 0.398, 0.45), (3, 0.394, 0.465)]))
    page = write_report(tmp_path, threshold=16).read_text()
    assert "<b>0.401</b> after 0 steps &rarr; <b>0.394</b> after 3 steps" in page
    assert "greedy (one completion per problem): <b>0.450</b> after 2 steps &rarr; <b>0.465</b> after 3 steps" in page
    # at temperature 0 the sampled pass is the greedy one (its records carry greedy_accuracy = accuracy): said once
    (tmp_path / "eval.jsonl").write_text("".join(
        json.dumps(EvalRecord(k, k, a, 200, 1, 0.0, 9.0, greedy_accuracy=a).as_dict()) + "\n"
        for k, a in [(0, 0.41), (3, 0.44)]))
    page = write_report(tmp_path, threshold=16).read_text()
    assert "<b>0.410</b> after 0 steps &rarr; <b>0.440</b> after 3 steps" in page and "greedy (one" not in page
