"""The run's bookkeeping without processes: tail time on a sampled timeline, per-step rows, the
resolved per-run config (TOML writer round trip, baseline switches), and report.html with its plots
written from hand-made run files. Values are checked against hand-computed numbers."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from tlt.services.trainer.report import summarize, write_report
from tlt.services.trainer.run_config import RunConfig, resolve_services, to_toml
from report_helpers import saved_axes as _saved_axes, write_metrics as _metrics
from tlt.services.trainer.run_stats import (IdleWindow, TimelineSample, format_row, settled, step_row, step_rows,
                                            tail_seconds)


def sample(t: float, running: int, sd: bool = False) -> TimelineSample:
    return TimelineSample(t, (running,), (0,), (sd,), 1, -1)


def test_tail_seconds_counts_time_with_small_nonzero_batches() -> None:
    # running: 40 during [0,1), 8 during [1,3), 2 during [3,4), 0 during [4,5), 3 during [5,6)
    s = [sample(0, 40), sample(1, 8), sample(3, 2), sample(4, 0), sample(5, 3), sample(6, 0)]
    assert tail_seconds(s, 0, 6, threshold=8) == pytest.approx(2 + 1 + 1)
    assert tail_seconds(s, 2, 3.5, threshold=8) == pytest.approx(1.0 + 0.5)  # clipped to the window
    assert tail_seconds(s, 0, 6, threshold=2) == pytest.approx(1.0)
    assert tail_seconds(s, 0, 6, threshold=100) == pytest.approx(5.0)
    # several replicas: each applies the threshold to its own batch (summed, 2 x 10 running with threshold 16 was
    # no tail although SD ran on both the whole time)
    two = [TimelineSample(t, r, (0, 0), (True, True), 1, -1) for t, r in ((0, (10, 10)), (10, (20, 3)), (12, (0, 0)))]
    assert tail_seconds(two, 0, 12, threshold=16) == pytest.approx(10.0)


def test_step_row_derives_sd_share_acceptance_and_idle_windows() -> None:
    m = {"step": 3, "policy_version": 4, "started_at": 100.0, "reward_mean": 0.5, "accuracy": 0.25, "tokens": 200,
         "sd_verify_steps": 40, "sd_accepted_tokens": 120, "drafter_version": 2,
         "times": {"step_s": 10.0, "rollout_s": 4.0, "reward_tail_s": 0.1, "old_logprobs_s": 1.0, "update_s": 4.0,
                   "push_s": 0.5, "lend_s": 0.25}}
    samples = [sample(100, 32), sample(101, 16), sample(103, 4), sample(104.5, 0)]
    windows = [IdleWindow(0, 0, 95.0, 101.0, 5, True), IdleWindow(0, 0, 104.0, 107.0, 9, True),
               IdleWindow(1, 1, 111.0, 115.0, 3, False)]  # the last one is after the step
    r = step_row(m, samples, windows, threshold=16)
    assert r.tail_s == pytest.approx(3.0)  # [101, 104): 16 then 4 running; rollout ends at 104
    assert r.sd_share == pytest.approx(0.6) and r.accept_len == pytest.approx(3.0)
    assert r.idle_windows == 2 and r.idle_train_s == pytest.approx(1.0 + 3.0)
    assert (r.step_s, r.rollout_s, r.update_s, r.drafter_version, r.lend_s) == (10.0, 4.0, 4.0, 2, 0.25)
    assert (r.reward_s, r.logprobs_s, r.push_s) == (0.1, 1.0, 0.5)  # each part from its own field of `times`
    # `tlt run --quiet` logs it with numbers under their own names (it logged the reward wait as reward="0.10")
    from tlt.services.trainer.run_stats import log_fields

    f = log_fields(r)
    assert (f["reward"], f["reward_wait_s"], f["accuracy"], f["sd_share"], f["accept_len"]) == (0.5, 0.1, 0.25, 0.6, 3.0)
    assert (f["step"], f["step_s"], f["idle_windows"], f["idle_train_s"], f["drafter_version"]) == (3, 10.0, 2, 4.0, 2)


def test_a_window_that_trained_no_micro_step_is_no_idle_window_used() -> None:
    # a worker woken by IDLE and preempted before its first micro-step used no capacity; counted, it made the
    # column read "3/9.1s" for two windows that trained, and the live table and report.html disagree on it
    # (such a window can reach drafter.jsonl after the live row was printed)
    m = {"step": 0, "started_at": 100.0, "times": {"step_s": 10.0}}
    windows = [IdleWindow(0, 0, 99.0, 100.2, 0, True), IdleWindow(0, 0, 102.0, 105.0, 7, True),
               IdleWindow(0, 0, 109.99, 110.1, 0, True)]
    r = step_row(m, [], windows, threshold=16)
    assert r.idle_windows == 1 and r.idle_train_s == pytest.approx(3.0)


def test_a_window_that_only_touches_the_step_is_no_idle_window_of_it() -> None:
    # a window the step's rollout preempted ends at the very time the step starts, and the next may start as the step
    # ends: neither trained during the step (counted, the idle column read "1/0.0s" for a step no window trained in)
    m = {"step": 0, "started_at": 100.0, "times": {"step_s": 10.0}}
    windows = [IdleWindow(0, 0, 90.0, 100.0, 5, True), IdleWindow(0, 0, 110.0, 113.0, 4, False)]
    r = step_row(m, [], windows, threshold=16)
    assert (r.idle_windows, r.idle_train_s) == (0, 0.0) and format_row(r)[12] == "-"


def test_the_summary_counts_every_step_and_keeps_the_reward_apart_from_the_accuracy(tmp_path: Path) -> None:
    """The summary's mean step time and total are over every step the table shows, the first (warm-up) one included,
    and its reward start -> end is the reward's: the only summary test had equal step times and reward = accuracy
    at every step. 4 steps (k = 1), 19, 7, 7, 7 s: mean 10.0, total 40; reward .5 .. .8, accuracy 0 .. .3."""
    _metrics(tmp_path, [{"reward_mean": 0.5 + 0.1 * k, "accuracy": 0.1 * k,
                         "times": {"step_s": 19.0 if k == 0 else 7.0, "rollout_s": 5.0}} for k in range(4)])
    page = write_report(tmp_path, threshold=16).read_text()
    assert "4 steps,\nmean step 10.0 s, total 40 s." in page
    assert "<b>0.000</b> (mean of the first step) &rarr; <b>0.300</b> (the last step)" in page
    assert "mean reward 0.500 &rarr; 0.800" in page
    # k: a quarter of the steps, at least 1 and at most 5 (12 steps: 3; 40 steps: 5, not 10 nor 4)
    rows = [step_row({"step": k, "accuracy": k / 100, "reward_mean": k / 10}, [], [], 16) for k in range(40)]
    assert summarize(rows[:12]).k == 3 and summarize(rows[:3]).k == 1
    s = summarize(rows)
    assert s.k == 5 and (s.acc_start, s.acc_end) == pytest.approx((0.02, 0.37)) and s.reward_end == pytest.approx(3.7)


def test_to_toml_round_trips_nested_service_sections() -> None:
    data = {"rollout": {"host": "127.0.0.1", "replicas": 2, "engine": {"max_num_seqs": 64, "dtype": "float32"},
                        "spec": {"mode": "off", "bucket_arms": [["8_4_16"], ["4_1_5", "2_1_3"]]}},
            "trainer": {"lr": 3e-5, "rollout_addresses": ["127.0.0.1:1"], "bf16": False, "path": 'a "quoted" \\ path'}}
    assert tomllib.loads(to_toml(data)) == data


def test_baseline_switches_speculation_and_drafter_off(tmp_path: Path) -> None:
    preset = {"rollout": {"spec": {"mode": "adaptive", "drafter": "learned", "drafter_path": "d"}}, "trainer": {"steps": 7},
              "drafter": {}, "reward": {}}
    run = RunConfig(model_dir="m", speculation=False, drafter=False, steps=3)
    services, switches = resolve_services(preset, run, tmp_path)
    assert switches == {"speculation": False, "drafter": False}
    assert services["rollout"]["spec"]["mode"] == "off"
    assert services["trainer"]["steps"] == 3 and services["trainer"]["output_dir"] == str(tmp_path)
    ports = {services["rollout"]["grpc_port"], services["rollout"]["http_port"], services["reward"]["port"]}
    assert len(ports) == 3 and services["trainer"]["rollout_addresses"] == [f"127.0.0.1:{services['rollout']['grpc_port']}"]


def test_report_has_plots_table_and_start_end_accuracy(tmp_path: Path) -> None:
    lines = []
    for k in range(8):
        lines.append({"step": k, "policy_version": k + 1, "started_at": 1000.0 + 10 * k, "reward_mean": 0.1 * k,
                      "accuracy": 0.1 * k, "tokens": 100, "sd_verify_steps": 10, "sd_accepted_tokens": 25,
                      "drafter_version": -1, "times": {"step_s": 9.0, "rollout_s": 5.0, "update_s": 3.0}})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "timeline.jsonl").write_text("".join(sample(1000.0 + 0.5 * i, max(0, 32 - i)).to_json() + "\n"
                                                     for i in range(160)))
    page = write_report(tmp_path, threshold=16).read_text()
    for name in ("step_time.png", "reward.png", "timeline.png", "accept.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
        assert f"plots/{name}" in page
    s = summarize([step_row(m, [], [], 16) for m in lines])
    assert s.k == 2 and s.acc_start == pytest.approx(0.05) and s.acc_end == pytest.approx(0.65)
    assert s.reward_start == pytest.approx(0.05) and s.reward_end == pytest.approx(0.65)
    assert "0.050" in page and "0.650" in page and page.count("<tr>") == 9
    assert "mean reward 0.050 &rarr; 0.650" in page
    assert "<td>25</td><td>2.50</td>" in page  # SD%: 25 accepted of 100 tokens, in percent; accept length 25 / 10


def test_drafter_fed_by_the_trainer_gets_the_trainers_features(tmp_path: Path) -> None:
    # `--set drafter.source=trainer`: the coordinator drops the rollout's features, so the trainer must push
    # its own to the drafter's features_bind (it had no address: the drafter never got a sequence)
    preset = {"rollout": {"spec": {"mode": "adaptive", "drafter": "learned", "drafter_path": "d"}}, "trainer": {},
              "drafter": {"source": "trainer"}, "reward": {}}
    services, switches = resolve_services(preset, RunConfig(model_dir="m"), tmp_path)
    assert switches == {"speculation": True, "drafter": True}
    assert services["trainer"]["drafter_features_address"] == services["drafter"]["features_bind"]
    assert "features_push" not in services["rollout"]
    preset["drafter"]["source"] = "rollout"  # the default: the rollout pushes, the trainer does not
    services, _ = resolve_services(preset, RunConfig(model_dir="m"), tmp_path)
    assert services["rollout"]["features_push"] == services["drafter"]["features_bind"]
    assert "drafter_features_address" not in services["trainer"]


def test_the_run_section_reaches_the_services_it_switches(tmp_path: Path) -> None:
    """[run] torch_threads goes over [trainer]'s; a [rollout.spec] without a mode speculates (adaptive, its default);
    run.drafter = false, or a model-free drafter ([rollout.spec] drafter unset: ngram), starts no drafter service and
    leaves the rollout no feature or capacity endpoint (a preset's fixed ports: another run's drafter may bind them)."""
    def preset(spec: dict) -> dict:
        return {"rollout": {"spec": spec, "features_push": "tcp://127.0.0.1:5703", "capacity_pub": "tcp://127.0.0.1:5701"},
                "trainer": {"torch_threads": 1}, "drafter": {}, "reward": {}}

    learned = {"drafter": "learned", "drafter_path": "d"}
    services, switches = resolve_services(preset(learned), RunConfig(model_dir="m", torch_threads=2), tmp_path)
    assert switches == {"speculation": True, "drafter": True} and services["rollout"]["spec"]["mode"] == "adaptive"
    assert services["trainer"]["torch_threads"] == 2
    for spec, run in ((learned, RunConfig(model_dir="m", drafter=False)), ({"mode": "static"}, RunConfig(model_dir="m"))):
        services, switches = resolve_services(preset(spec), run, tmp_path)
        assert switches == {"speculation": True, "drafter": False}, spec
        assert "features_push" not in services["rollout"] and "capacity_pub" not in services["rollout"], spec
        assert services["trainer"]["torch_threads"] == 1


def test_drafter_init_names_the_drafter_the_rollout_and_the_drafter_service_start_from(tmp_path: Path) -> None:
    """run.drafter_init = random or warmup: the run folder's drafter-init, made before the services start; a folder:
    that folder. The drafter service starts from it unless [drafter] init_drafter names its own."""
    preset = {"rollout": {"spec": {"mode": "adaptive", "drafter": "ngram"}}, "trainer": {}, "drafter": {}, "reward": {}}
    for init, path in (("random", tmp_path / "drafter-init"), ("warmup", tmp_path / "drafter-init"), ("/d", Path("/d"))):
        services, switches = resolve_services(preset, RunConfig(model_dir="m", drafter_init=init), tmp_path)
        assert switches == {"speculation": True, "drafter": True}, init
        assert services["rollout"]["spec"]["drafter"] == "learned", init
        assert services["rollout"]["spec"]["drafter_path"] == services["drafter"]["init_drafter"] == str(path), init
    preset["drafter"]["init_drafter"] = "/mine"
    services, _ = resolve_services(preset, RunConfig(model_dir="m", drafter_init="random"), tmp_path)
    assert services["drafter"]["init_drafter"] == "/mine"


def test_regenerated_report_keeps_the_runs_tail_threshold(tmp_path: Path) -> None:
    # `python -m tlt.services.trainer.report runs/<id>` must count tail as `tlt run` did (cpu-tiny: 16, not 32)
    m = {"step": 0, "policy_version": 1, "started_at": 100.0, "times": {"step_s": 5.0, "rollout_s": 4.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(m) + "\n")
    (tmp_path / "timeline.jsonl").write_text("".join(sample(t, r).to_json() + "\n"
                                                     for t, r in [(100, 24), (102, 8), (104, 0)]))
    (tmp_path / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "tail_threshold": 16}))
    page = write_report(tmp_path).read_text()  # as the module's __main__ calls it without a threshold
    assert "at most 16" in page and "<td>2.0</td>" in page  # tail = [102, 104) only
    assert "<td>4.0</td>" in write_report(tmp_path, threshold=32).read_text()  # an explicit one still wins


def test_tlt_report_command_regenerates_a_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tlt.cli import main

    m = {"step": 0, "policy_version": 1, "started_at": 100.0, "times": {"step_s": 5.0, "rollout_s": 4.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(m) + "\n")
    (tmp_path / "timeline.jsonl").write_text("".join(sample(t, r).to_json() + "\n"
                                                     for t, r in [(100, 24), (102, 8), (104, 0)]))
    (tmp_path / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "tail_threshold": 16}))
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.html")
    assert "at most 16" in (tmp_path / "report.html").read_text()
    assert main(["report", str(tmp_path / "nope")]) == 2  # a usage error (it exited 1), and a clear line
    assert "holds no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("text", ['{"preset": "cpu-tiny", "tail_thr', "[]", "\xff"])
def test_tlt_report_writes_the_report_past_a_damaged_run_file(tmp_path: Path, text: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A run.json cut short (a kill mid-write by an older TLT), holding no object, or not UTF-8: `tlt report` ended in a
    traceback. The report is still written from the run's metrics, at the default tail threshold, and says why."""
    from tlt.cli import main

    m = {"step": 0, "policy_version": 1, "started_at": 100.0, "times": {"step_s": 5.0, "rollout_s": 4.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(m) + "\n")
    (tmp_path / "run.json").write_bytes(text.encode("latin-1"))
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "report.html")
    assert "run.json is not a valid run file" in captured.err and "Traceback" not in captured.err
    page = (tmp_path / "report.html").read_text()
    assert "1 steps" in page and "at most 32" in page


def test_reward_plot_shows_rewards_outside_0_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a user's reward (e.g. -1 wrong / +1 right, plus a format bonus) leaves [0, 1]; the plot was fixed to it
    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"reward_mean": r, "accuracy": a} for r, a in [(-1.0, 0.0), (-0.5, 0.25), (1.5, 1.0)]])
    write_report(tmp_path, threshold=16)
    lo, hi = saved["reward.png"][0].get_ylim()
    assert lo <= -1.0 and hi >= 1.5


def test_timeline_plot_scales_to_the_running_batch_not_the_queue(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # a held-out eval queues 736 requests behind 64 running; the queue is not drawn, so the y axis must
    # not reach 736 (the running batch was a flat line at the bottom of the plot)
    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"reward_mean": 0.5}])
    (tmp_path / "timeline.jsonl").write_text("".join(
        TimelineSample(t, (r,), (q,), (False,), 1, -1).to_json() + "\n" for t, r, q in
        [(90.0, 64, 736), (95.0, 64, 100), (100.0, 40, 0), (103.0, 8, 0), (105.0, 0, 0)]))
    write_report(tmp_path, threshold=16)
    assert saved["timeline.png"][0].get_ylim()[1] == pytest.approx(64 * 1.15)


def test_accept_plot_leaves_steps_without_verify_passes_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # acceptance length is undefined without a verify pass (the table shows "-"); plotted as 0 it read as
    # "the drafter's tokens were all rejected"
    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"sd_verify_steps": 10, "sd_accepted_tokens": 30, "drafter_version": 3},
                        {"sd_verify_steps": 0, "sd_accepted_tokens": 0, "drafter_version": 3},
                        {"sd_verify_steps": 4, "sd_accepted_tokens": 10, "drafter_version": 4}])
    write_report(tmp_path, threshold=16)
    ax = saved["accept.png"][0]
    y = list(ax.lines[0].get_ydata())
    assert y[0] == pytest.approx(3.0) and math.isnan(y[1]) and y[2] == pytest.approx(2.5)
    assert [t.get_text() for t in ax.texts] == ["d3", "d4"]  # no label floating at a step without SD
    # the SD share on the right axis in percent (0..100): 30 of 100 tokens, none, 10 of 100
    assert list(saved["accept.png"][1].lines[0].get_ydata()) == pytest.approx([30.0, 0.0, 10.0])


def test_step_time_plot_stacks_each_part_once_under_the_step_total(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the rollout bar is split into its tail and the rest: drawn whole beside its tail, the stack rose past the step's
    # own time. One step of 10 s: rollout 4 s (tail [102, 104): 2 s), reward wait .1, old logprobs 1, update 3, push .5
    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"times": {"step_s": 10.0, "rollout_s": 4.0, "reward_tail_s": 0.1, "old_logprobs_s": 1.0,
                                   "update_s": 3.0, "push_s": 0.5}}])
    (tmp_path / "timeline.jsonl").write_text("".join(sample(t, r).to_json() + "\n"
                                                     for t, r in [(100, 24), (102, 8), (104, 0)]))
    write_report(tmp_path, threshold=16)
    (ax,) = saved["step_time.png"]
    bars = [(c.get_label(), c.patches[0].get_y(), c.patches[0].get_height()) for c in ax.containers]
    assert [b[0] for b in bars] == ["rollout (tail)", "rollout (rest)", "reward wait", "old logprobs", "update",
                                    "weight push"]
    want = [(0, 2), (2, 2), (4, 0.1), (4.1, 1), (5.1, 3), (8.1, 0.5)]  # (bottom, height): each on the last
    assert [b[1:] for b in bars] == [pytest.approx(b) for b in want]
    assert list(ax.lines[0].get_ydata()) == [10.0] and ax.lines[0].get_label() == "step total"


def test_timeline_plot_holds_no_sample_across_a_resume_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the run was interrupted with 40 sequences running (SD on) and resumed 1000 s later: the plot drew
    # 40 running and SD on through the 1000 s nothing ran
    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{"reward_mean": 0.5}])
    (tmp_path / "timeline.jsonl").write_text("".join(
        TimelineSample(t, (r,), (0,), (True,), 1, -1).to_json() + "\n" for t, r in
        [(100.0, 40), (100.5, 40), (1100.5, 8), (1101.0, 3), (1101.5, 0)]))
    write_report(tmp_path, threshold=16)
    ax = saved["timeline.png"][0]
    x, y = ax.lines[0].get_xdata(), ax.lines[0].get_ydata()
    held = [(a, b) for a, b, v in zip(x, x[1:], y) if not math.isnan(v) and b - a > 10]
    assert not held  # no value drawn over the gap
    spans = [p.get_width() for p in ax.patches]  # SD-on shading (the run has no drafter windows)
    assert sorted(spans) == pytest.approx([0.5, 0.5, 0.5])  # [100, 100.5), [1100.5, 1101), [1101, 1101.5)


def test_live_rows_wait_for_the_drafter_window_that_trains_through_the_step(tmp_path: Path) -> None:
    # step 0 runs [100, 110): its rollout ends at 103 and the drafter trains on the idle replica from
    # 103.2 until step 1's rollout starts at 110.5. That window reaches drafter.jsonl only when it ends,
    # after step 0's line was written: the live row showed "-" (the report: 1 window, 6.8 s).
    _metrics(tmp_path, [{"times": {"step_s": 10.0, "rollout_s": 3.0}}])
    rows = step_rows(tmp_path, 16)
    assert rows[0].idle_windows == 0  # what the line alone gives
    assert settled(rows, windows_known_at=0.0) == 0  # drafter not yet seen idle: the row waits
    assert settled(rows, windows_known_at=109.0) == 0  # seen idle, but before the step ended
    (tmp_path / "drafter.jsonl").write_text(json.dumps(IdleWindow(0, 0, 103.2, 110.6, 40, True).__dict__) + "\n")
    assert settled(rows, windows_known_at=110.7) == 1  # no worker training after the step: settled
    assert (rows := step_rows(tmp_path, 16))[0].idle_windows == 1 and rows[0].idle_train_s == pytest.approx(6.8)
    _metrics(tmp_path, [{"times": {"step_s": 10.0, "rollout_s": 3.0}}, {"times": {"step_s": 10.0, "rollout_s": 3.0}}])
    assert settled(step_rows(tmp_path, 16), windows_known_at=0.0) == 1  # a later step's line settles the earlier
    assert settled(step_rows(tmp_path, 16), windows_known_at=math.inf) == 2  # no drafter: every row at once
    assert settled([], windows_known_at=0.0) == 0


def test_drafter_sampler_knows_when_every_window_is_on_file(tmp_path: Path) -> None:
    # Real drafter service parts (as tests/test_drafter_worker.py): a CapacityPublisher on 127.0.0.1 plays
    # the rollout's replica, the real coordinator with its gRPC status server, one real worker (a thread)
    # training a tiny random Qwen2's drafter on real features. The sampler polls by hand (no thread).
    import threading
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from rollout_helpers import tiny_checkpoint
    from tlt.services.common.events import CapacityPublisher
    from tlt.services.drafter.collect import sample_features
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.serve import start_status_server
    from tlt.services.drafter.worker import DrafterWorker
    from tlt.services.trainer.run_monitor import DrafterSampler
    from tlt.services.trainer.run_stats import read_windows
    from tlt.v1 import common_pb2, events_pb2

    model_dir = tiny_checkpoint(tmp_path / "m")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    samples = sample_features(model, [[int(x) for x in torch.randint(5, 200, (6,))] for _ in range(4)],
                              max_new_tokens=20, window_tokens=64)
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    cfg = DrafterServiceConfig(capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
                               coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               window_tokens=64, batch_tokens=64, batch_rows=2, submit_every=5, eval_interval_s=60.0)
    coord = Coordinator(cfg, str(model_dir), None, None).start()
    coord.buffer.add_samples(samples)
    pub.publish(events_pb2.CapacityEvent(replica_id=0, state=common_pb2.REPLICA_STATE_BUSY))
    server, port = start_status_server(coord, "127.0.0.1", 0)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sampler = DrafterSampler(f"127.0.0.1:{port}", run_dir)

    def wait(cond, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    try:
        wait(lambda: coord.status().workers, "worker joined")
        sampler.poll()
        quiet = sampler.quiet_since
        assert quiet > 0  # the replica is busy: no worker trains
        pub.publish(events_pb2.CapacityEvent(replica_id=0, state=common_pb2.REPLICA_STATE_IDLE))
        wait(lambda: any(w.training for w in coord.status().workers), "worker training")
        sampler.poll()
        assert sampler.quiet_since == quiet  # a window is open: what it trains is not on file yet
        pub.publish(events_pb2.CapacityEvent(replica_id=0, state=common_pb2.REPLICA_STATE_BUSY))
        wait(lambda: coord.windows, "window reported")
        sampler.poll()
        (window,) = read_windows(run_dir / "drafter.jsonl")
        assert sampler.quiet_since > window.end  # the window ended and is on file, then no worker was training
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        server.stop(0)
        sampler.channel.close()
        coord.close()
        pub.close()


def test_tlt_report_on_a_run_cut_off_before_its_first_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh trainer deletes metrics.jsonl and writes its first line after step 0: a run stopped before that is
    still a run folder (run.json); `tlt report` called it not one."""
    from tlt.cli import main

    (tmp_path / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "tail_threshold": 16}))
    (tmp_path / "timeline.jsonl").write_text(sample(100, 24).to_json() + "\n" + '{"t": 100.1, "runn')  # cut by a kill
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.html")
    assert "0 steps" in (tmp_path / "report.html").read_text()


def test_a_line_cut_by_a_killed_launch_does_not_swallow_the_next_launchs_first_sample(tmp_path):
    """`tlt run` killed with -9 can leave timeline.jsonl ending mid-line. The resumed launch appended to it, its first
    sample joined the cut line, and reading dropped both. The sampler now starts its records on a new line.
    (A real RolloutSampler, not started: its first record is written by hand; nothing is polled.)"""
    from tlt.services.trainer.run_monitor import RolloutSampler
    from tlt.services.trainer.run_stats import TimelineSample, read_timeline

    path = tmp_path / "timeline.jsonl"
    first = TimelineSample(1.0, (3,), (0,), (True,), 1, 0)
    path.write_text(first.to_json() + "\n" + TimelineSample(2.0, (2,), (0,), (True,), 1, 0).to_json()[:17])
    sampler = RolloutSampler("127.0.0.1:9", path, 1.0)
    resumed = TimelineSample(3.0, (1,), (0,), (False,), 2, 0)
    sampler.out.write(resumed.to_json() + "\n")
    sampler.out.close()
    sampler.client.close()
    assert read_timeline(path) == [first, resumed]


@pytest.mark.parametrize("threshold", ["0", "-5"])
def test_tlt_report_refuses_a_tail_threshold_below_one(tmp_path: Path, threshold: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--threshold -5` wrote "running batch between 1 and -5" into the report and an empty tail column."""
    from tlt.cli import main

    (tmp_path / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "tail_threshold": 16}))
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path), "--threshold", threshold])
    assert e.value.code == 2 and "--threshold" in capsys.readouterr().err
    assert not (tmp_path / "report.html").exists()


def test_a_run_config_with_any_text_is_valid_toml() -> None:
    """config.toml is read by every service; json.dumps wrote a character outside the BMP (`--run-id exp-🚀` makes
    the run's paths hold one) as a UTF-16 surrogate pair, which TOML refuses, so every service failed to start."""
    import tomllib

    from tlt.services.trainer.run_config import to_toml

    data = {"trainer": {"output_dir": "runs/exp-🚀", "note": 'a "quote", a \\ and a\ttab\n', "lr": 1e-5, "ok": True,
                        "stop": ["ü", "</s>"]}, "rollout": {"engine": {"name": "日本"}}}
    assert tomllib.loads(to_toml(data)) == data


def test_metrics_lines_are_strict_json_when_a_run_diverges(tmp_path: Path) -> None:
    """A diverged step's NaN loss went into metrics.jsonl as a bare NaN, which jq and JSON.parse refuse."""
    import json

    from tlt.services.trainer.loop import _append

    def strict(line: str) -> dict:
        return json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))

    path = tmp_path / "metrics.jsonl"
    _append(path, {"step": 0, "loss": float("nan"), "times": {"update_s": float("inf")}, "lrs": [1e-3, float("-inf")]})
    line = strict(path.read_text().splitlines()[0])
    assert line == {"step": 0, "loss": None, "times": {"update_s": None}, "lrs": [1e-3, None]}


def test_the_sd_share_is_over_the_tokens_the_rollout_generated() -> None:
    """With dynamic sampling the SD counters covered every round but the share divided them by the tokens trained
    on (the kept groups): a step that took two rounds showed 200%."""
    from tlt.services.trainer.run_stats import step_row

    m = {"step": 0, "tokens": 100, "sd_response_tokens": 200, "sd_accepted_tokens": 200, "sd_verify_steps": 50}
    assert step_row(m, [], [], 16).sd_share == 1.0
    assert step_row({**m, "sd_response_tokens": 0, "sd_accepted_tokens": 50}, [], [], 16).sd_share == 0.5  # old lines


def test_a_report_that_fails_is_logged_and_does_not_end_the_run(tmp_path: Path, capsys) -> None:
    """Only KeyboardInterrupt was caught around the report: any other error (a corrupt run.json, an eval.jsonl line
    of another version) ended `tlt run` with a traceback, and its run_done line and exit code were lost."""
    from tlt.services.trainer.launch import report

    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "eval.jsonl").write_text('{"after_steps": 0, "accuracy": "high"}\n')  # not an eval record
    assert report(tmp_path, 16) is None
    assert "report_failed" in capsys.readouterr().err


def test_report_shows_the_rollouts_last_speculation_status(tmp_path: Path) -> None:
    """rollout_status.json as `tlt run` writes it (MessageToDict: int64 counts as strings) -> the report's tables of
    each arm's steps and accept length and of the bandit's choices per bucket; no file, no section."""
    _metrics(tmp_path, [{"reward_mean": 0.5}])
    write_report(tmp_path, threshold=16)
    assert "Speculative decoding" not in (tmp_path / "report.html").read_text()
    status = {"replicas": [{"replica_id": 0, "spec": {
        "mode": "adaptive", "active": True, "arm": "5_1_6", "mean_accept_len": 4.53, "verify_steps": "120",
        "plain_steps": "23", "switches": "1", "no_room": "0", "over_budget": "2",
        "arms": [{"arm": "8_1_9", "steps": "27", "accept_len": 5.74}, {"arm": "plain", "steps": "11", "accept_len": 1.0}],
        "bandit": [{"bucket": ">=5", "explored": "51", "exploited": "62",
                    "arms": [{"arm": "3_1_4", "samples": "62", "median_reward": 1664.2, "chosen": "62"},
                             # rewards at other sizes only: the status says 0 (proto3), the report "-"
                             {"arm": "plain", "samples": "61", "median_reward": 0.0, "chosen": "61"}]}]}}]}
    (tmp_path / "rollout_status.json").write_text(json.dumps(status))
    page = (write_report(tmp_path, threshold=16)).read_text()
    assert "120 verify steps, 23 plain steps, mean accept length 4.53" in page and "2 over the verify budget" in page
    assert "<td>8_1_9</td><td>27</td><td>5.74</td>" in page
    assert "<td>&gt;=5</td><td>51</td><td>62</td><td>3_1_4</td><td>62</td><td>62</td><td>1664</td>" in page
    assert "<td>plain</td><td>61</td><td>61</td><td>-</td>" in page


def test_a_resume_keeps_the_timeline_and_windows_of_the_kept_steps_only(tmp_path: Path) -> None:
    """A run killed after step 3 resumes from its checkpoint after step 2: steps 2-3 and their rollouts run again. The
    killed launch's samples and drafter windows after the kept steps and eval ended (119.9 here) were drawn in the
    report as rollouts of no step (a QA run: 292 samples, ~180 s). They go; what the kept steps did stays. On a start
    from no checkpoint nothing stays."""
    from tlt.services.trainer.run_stats import read_timeline, read_windows, trim_samples

    _metrics(tmp_path, [{}, {}, {}, {}])  # steps 0-3 started at 100, 110, 120, 130; 9 s each
    (tmp_path / "eval.jsonl").write_text(json.dumps({"after_steps": 2, "started_at": 119.5, "seconds": 0.4}) + "\n"
                                         + json.dumps({"after_steps": 4, "started_at": 139.5, "seconds": 0.4}) + "\n")
    times = sorted([100.0 + i for i in range(41)] + [119.6])  # 119.6: during the eval after step 2, past step 1's end
    (tmp_path / "timeline.jsonl").write_text("".join(sample(t, 4).to_json() + "\n" for t in times))
    (tmp_path / "drafter.jsonl").write_text("".join(json.dumps(IdleWindow(0, 0, s, s + 2, 3, True).__dict__) + "\n"
                                                    for s in (105.0, 119.0, 125.0)))
    trim_samples(tmp_path, 2)
    assert [s.t for s in read_timeline(tmp_path / "timeline.jsonl")] == [100.0 + i for i in range(20)] + [119.6]
    assert [w.start for w in read_windows(tmp_path / "drafter.jsonl")] == [105.0, 119.0]
    trim_samples(tmp_path, 0)
    assert not (tmp_path / "timeline.jsonl").exists() and not (tmp_path / "drafter.jsonl").exists()


def test_the_timeline_names_the_tail_threshold_and_draws_only_windows_that_trained(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dashed line is the report's tail threshold (`tlt report --threshold 64` labelled it "SD threshold 64" while
    the rollout speculated up to 16); a drafter window preempted before its first micro-step is no idle window used
    in the table, and is not drawn as one either."""
    saved = _saved_axes(monkeypatch)
    _metrics(tmp_path, [{}])
    (tmp_path / "timeline.jsonl").write_text("".join(sample(100.0 + i, 4).to_json() + "\n" for i in range(8)))
    (tmp_path / "drafter.jsonl").write_text("".join(json.dumps(IdleWindow(0, 0, s, s + 1, n, True).__dict__) + "\n"
                                                    for s, n in ((101.0, 0), (104.0, 5))))
    write_report(tmp_path, threshold=64)
    ax = saved["timeline.png"][0]
    assert "tail threshold 64" in [t.get_text() for t in ax.get_legend().get_texts()]
    purple = [p for p in ax.patches if p.get_facecolor()[:3] == pytest.approx((0.580, 0.404, 0.741), abs=1e-3)]
    assert len(purple) == 1 and purple[0].get_x() == pytest.approx(4.0)


def test_a_report_without_run_json_says_the_switches_are_unknown_and_takes_the_configs_threshold(tmp_path: Path) -> None:
    """Without run.json the page said "speculative decoding off, online drafter off" for a run that had both on, and
    counted the tail at batch <= 32 where the run's config.toml speculated up to 16."""
    m = {"step": 0, "policy_version": 1, "started_at": 100.0, "times": {"step_s": 5.0, "rollout_s": 4.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(m) + "\n")
    (tmp_path / "config.toml").write_text('[rollout.spec]\nmode = "adaptive"\nthreshold = 16\n')
    page = write_report(tmp_path).read_text()
    assert "speculative decoding <b>unknown (no run.json)</b>" in page and "at most 16" in page


def test_a_resumed_runs_speculation_section_says_whose_counts_it_shows(tmp_path: Path) -> None:
    """rollout_status.json is the last launch's rollout server, whose counts start over at a resume: a 5-step run
    resumed after step 2 read "100 verify steps" as if for the whole run."""
    m = {"step": 0, "policy_version": 1, "started_at": 100.0, "times": {"step_s": 5.0, "rollout_s": 4.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(m) + "\n")
    replica = {"replica_id": 0, "spec": {"mode": "adaptive", "verify_steps": "100", "plain_steps": "7"}}
    for since, says in ((2, True), (0, False)):
        (tmp_path / "rollout_status.json").write_text(json.dumps({"since_step": since, "replicas": [replica]}))
        page = write_report(tmp_path, threshold=16).read_text()
        assert "100 verify steps" in page and ("resumed after step 2" in page) == says


def test_a_spec_section_under_the_engine_is_read_and_moved_to_rollout_spec(tmp_path: Path) -> None:
    """A preset written when [rollout.spec] sat under the engine ([rollout.engine.spec]): `tlt run` reads its
    switches there and writes them as [rollout.spec], which the rollout takes (its engine section has no spec)."""
    from tlt.services.rollout.config import RolloutConfig

    preset = {"rollout": {"engine": {"dtype": "float32", "spec": {"mode": "off", "drafter": "learned", "drafter_path": "d"}}},
              "trainer": {}, "drafter": {}, "reward": {}}
    services, switches = resolve_services(preset, RunConfig(model_dir="m"), tmp_path)
    assert switches == {"speculation": False, "drafter": False}
    assert services["rollout"]["spec"]["mode"] == "off" and "spec" not in services["rollout"]["engine"]
    assert RolloutConfig(**services["rollout"]).spec.mode == "off"


def test_the_report_says_where_the_runs_online_drafter_went(tmp_path) -> None:
    """policy-drafter/tlt_export.json (drafter/export.py's export_run_drafter): its version and the command that serves
    it with the policy; version 0 said to be the drafter the run started with; no record, no line."""
    import json

    from tlt.services.trainer.report import _drafter_line

    assert _drafter_line(tmp_path) == ""
    (tmp_path / "policy-drafter").mkdir()
    record = tmp_path / "policy-drafter" / "tlt_export.json"
    record.write_text(json.dumps({"drafter_version": 57, "policy_steps_done": 50, "run": "r"}))
    line = _drafter_line(tmp_path)
    assert "(version 57), for the policy in <code>policy/</code> (after 50 steps)" in line
    assert f"--drafter {tmp_path / 'policy-drafter'}" in line and "started with" not in line
    record.write_text(json.dumps({"drafter_version": 0, "policy_steps_done": 2, "run": "r"}))
    assert "(version 0; the drafter the run started with: no trained one passed the acceptance gate)" in \
        _drafter_line(tmp_path)
