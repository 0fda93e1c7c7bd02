"""The run's bookkeeping without processes: tail time on a sampled timeline, per-step rows, the
resolved per-run config (TOML writer round trip, baseline switches), and report.html with its plots
written from hand-made run files. Values are checked against hand-computed numbers."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from tlt.services.trainer.report import summarize, write_report
from tlt.services.trainer.run_config import RunConfig, resolve_services, to_toml
from tlt.services.trainer.run_stats import IdleWindow, TimelineSample, step_row, tail_seconds


def sample(t: float, running: int, sd: bool = False) -> TimelineSample:
    return TimelineSample(t, (running,), (0,), (sd,), 1, -1)


def test_tail_seconds_counts_time_with_small_nonzero_batches() -> None:
    # running: 40 during [0,1), 8 during [1,3), 2 during [3,4), 0 during [4,5), 3 during [5,6)
    s = [sample(0, 40), sample(1, 8), sample(3, 2), sample(4, 0), sample(5, 3), sample(6, 0)]
    assert tail_seconds(s, 0, 6, threshold=8) == pytest.approx(2 + 1 + 1)
    assert tail_seconds(s, 2, 3.5, threshold=8) == pytest.approx(1.0 + 0.5)  # clipped to the window
    assert tail_seconds(s, 0, 6, threshold=2) == pytest.approx(1.0)
    assert tail_seconds(s, 0, 6, threshold=100) == pytest.approx(5.0)


def test_step_row_derives_sd_share_acceptance_and_idle_windows() -> None:
    m = {"step": 3, "policy_version": 4, "started_at": 100.0, "reward_mean": 0.5, "accuracy": 0.25, "tokens": 200,
         "sd_verify_steps": 40, "sd_accepted_tokens": 120, "drafter_version": 2,
         "times": {"step_s": 10.0, "rollout_s": 4.0, "reward_tail_s": 0.1, "old_logprobs_s": 1.0, "update_s": 4.0,
                   "push_s": 0.5}}
    samples = [sample(100, 32), sample(101, 16), sample(103, 4), sample(104.5, 0)]
    windows = [IdleWindow(0, 0, 95.0, 101.0, 5, True), IdleWindow(0, 0, 104.0, 107.0, 9, True),
               IdleWindow(1, 1, 111.0, 115.0, 3, False)]  # the last one is after the step
    r = step_row(m, samples, windows, threshold=16)
    assert r.tail_s == pytest.approx(3.0)  # [101, 104): 16 then 4 running; rollout ends at 104
    assert r.sd_share == pytest.approx(0.6) and r.accept_len == pytest.approx(3.0)
    assert r.idle_windows == 2 and r.idle_train_s == pytest.approx(1.0 + 3.0)
    assert (r.step_s, r.rollout_s, r.update_s, r.drafter_version) == (10.0, 4.0, 4.0, 2)


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
    assert "0.050" in page and "0.650" in page and page.count("<tr>") == 9


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


def test_regenerated_report_keeps_the_runs_tail_threshold(tmp_path: Path) -> None:
    # `python -m tlt.services.trainer.report runs/<id>` must count tail as `tlt run` did (cpu-tiny: 16, not 32)
    m = {"step": 0, "policy_version": 1, "started_at": 100.0, "times": {"step_s": 5.0, "rollout_s": 4.0}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(m) + "\n")
    (tmp_path / "timeline.jsonl").write_text("".join(sample(t, r).to_json() + "\n"
                                                     for t, r in [(100, 24), (102, 8), (104, 0)]))
    (tmp_path / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "tail_threshold": 16}))
    page = write_report(tmp_path).read_text()  # as the module's __main__ calls it without a threshold
    assert "between 1 and 16" in page and "<td>2.0</td>" in page  # tail = [102, 104) only
    assert "<td>4.0</td>" in write_report(tmp_path, threshold=32).read_text()  # an explicit one still wins
