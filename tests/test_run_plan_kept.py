"""What a `tlt run` launch keeps from the run it continues, and what its own options beat (`prepare_run`): the
--seed and --baseline a run was started with hold on a plain resume, and --seed beats the seed the preset, TLT_*
or --set gave, 0 included; a plain launch keeps the interrupted run it would continue when refused, and finds it
while another run holds `<preset>`. No service is started (tests/test_run_plan.py has the rest of the plan's rules).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from test_run_plan import _checkpointed, _closed, _fake_model, _plan


def _trainer(plan) -> dict:  # noqa: ANN001 - RunPlan
    return tomllib.loads(plan.config_path.read_text())["trainer"]


def test_a_resume_keeps_the_seed_and_baseline_the_run_was_started_with(tmp_path: Path) -> None:
    """`tlt run --run-id r --seed 7 --baseline`, interrupted, then `tlt run --run-id r`: the resume drew its prompts
    with the preset's seed and ran with speculation on unless run.json's were taken, silently (before the first
    checkpoint nothing compares them)."""
    model, runs = _fake_model(tmp_path)
    _closed(_plan(runs, model, "--run-id", "r", "--seed", "7", "--baseline"))
    plan = _closed(_plan(runs, model, "--run-id", "r"))
    assert _trainer(plan)["seed"] == 7
    assert plan.switches == {"speculation": False, "drafter": False}
    assert tomllib.loads(plan.config_path.read_text())["rollout"]["spec"]["mode"] == "off"
    saved = json.loads((runs / "r" / "run.json").read_text())
    assert saved["seed"] == 7 and saved["baseline"] is True


def test_a_seed_of_zero_beats_the_seed_the_preset_or_set_gives(tmp_path: Path) -> None:
    """--seed is the last word on the trainer's seed (it goes over --set trainer.seed), 0 as much as any other:
    a test of the seed's truth, not of its value, let a preset's seed beat `--seed 0`."""
    model, runs = _fake_model(tmp_path)
    assert _trainer(_closed(_plan(runs, model, "--run-id", "a", "--set", "trainer.seed=5", "--seed", "0")))["seed"] == 0
    assert _trainer(_closed(_plan(runs, model, "--run-id", "b", "--set", "trainer.seed=5", "--seed", "3")))["seed"] == 3


def test_a_resumed_launch_logs_no_eval_again_that_its_trainer_keeps(tmp_path: Path) -> None:
    """Logging (no progress bar), a resume logs only this launch's evals: those after the checkpoint's steps. The
    eval after exactly the checkpoint's step is kept by the trainer (loop.py) and was logged by the launch before;
    counted as not kept, every resume logged it again."""
    from tlt.services.trainer.evaluate import EvalRecord
    from tlt.services.trainer.launcher import Launcher

    model, runs = _fake_model(tmp_path)
    run_dir = _closed(_plan(runs, model, "--run-id", "r")).run_dir
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(EvalRecord(k, k, 0.5, 4, 1, 1.0, 1.0).as_dict()) + "\n"
                                                for k in (0, 2, 4)))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step-00000002\n")
    launcher = Launcher(_closed(_plan(runs, model, "--run-id", "r")), quiet=True)
    assert launcher._evals_kept() == 2  # after 0 and after 2 steps: both logged by the interrupted launch


def test_a_refused_launch_of_the_default_folder_keeps_the_run_it_would_have_continued(tmp_path: Path) -> None:
    """A plain `tlt run` continues the interrupted run in `<preset>`; refused (a bad --set), it must leave that run's
    folder as it was: only a folder this launch made is removed (a refused new run leaves no folder behind)."""
    from tlt.services.common.config import ConfigError

    model, runs = _fake_model(tmp_path)
    run_dir = _closed(_plan(runs, model, "--steps", "4")).run_dir
    _checkpointed(run_dir, 2)  # interrupted after 2 of its 4 steps
    with pytest.raises(ConfigError, match="nope"):
        _plan(runs, model, "--set", "trainer.nope=1")
    assert (run_dir / "run.json").is_file() and (run_dir / "checkpoints" / "latest").is_file()


def test_a_plain_launch_continues_the_interrupted_time_folder_while_another_run_holds_the_preset_folder(
        tmp_path: Path) -> None:
    """`<preset>` held by a running `tlt run`: a plain launch looks on to the preset's interrupted `<preset>-<time>`
    folders and continues the last one, as when `<preset>` is finished; it does not start a new folder."""
    model, runs = _fake_model(tmp_path)
    holder = _plan(runs, model, "--steps", "4")  # runs in runs/cpu-tiny meanwhile
    try:
        interrupted = _closed(_plan(runs, model, "--steps", "4")).run_dir
        assert interrupted != holder.run_dir
        _checkpointed(interrupted, 2)
        again = _closed(_plan(runs, model))
        assert again.run_dir == interrupted and again.resumed and again.steps == 4
    finally:
        _closed(holder)


def test_an_export_that_left_no_weights_is_not_a_finished_run(tmp_path: Path, monkeypatch) -> None:
    """An older TLT's export (no tlt_export.json) killed after config.json but before its safetensors: every step is
    done and policy/ looks exported, but holds no weights. Taken as finished, a plain `tlt run` started a new folder
    and the trained policy was never written; it is continued (its trainer exports again)."""
    from test_run_plan import _clock

    model, runs = _fake_model(tmp_path)
    _clock(monkeypatch, "20260101-000000")
    run_dir = _closed(_plan(runs, model, "--steps", "4")).run_dir
    _checkpointed(run_dir, 4)
    (run_dir / "policy").mkdir()
    (run_dir / "policy" / "config.json").write_text("{}")  # no *.safetensors, no record
    again = _closed(_plan(runs, model, "--steps", "4"))
    assert again.run_dir == run_dir and again.resumed


def test_an_interrupted_folder_of_a_second_launch_in_the_same_second_is_continued(tmp_path: Path, monkeypatch) -> None:
    """Three launches in one second take `<preset>`, `<preset>-<time>` and `<preset>-<time>-2`. The third one
    interrupted while the other two still run: a plain `tlt run` continues it, as any interrupted `<preset>-<time>`
    folder; a name pattern without the `-N` made it start a fourth folder from step 0."""
    from test_run_plan import _clock

    model, runs = _fake_model(tmp_path)
    _clock(monkeypatch, "20260101-000000")
    held = [_plan(runs, model, "--steps", "4") for _ in range(2)]
    try:
        third = _closed(_plan(runs, model, "--steps", "4")).run_dir
        assert third.name == "cpu-tiny-20260101-000000-2"
        _checkpointed(third, 2)
        again = _closed(_plan(runs, model))
        assert again.run_dir == third and again.resumed
    finally:
        for plan in held:
            _closed(plan)


def test_a_resume_with_another_answer_field_is_refused(tmp_path: Path) -> None:
    """answer_field picks which column of the data file is the answer the reward checks: a resume reading another
    one rewards the rest of the run against another target (the checkpoint's prompts, other answers). It is refused
    up front, as another seed or data file is, and run.json keeps the run's options."""
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    _closed(_plan(runs, model, "--run-id", "r"))
    _checkpointed(runs / "r", 2)
    with pytest.raises(ServiceError, match="a resume keeps the data it was trained on .answer_field 'answer' -> 'x'"):
        _plan(runs, model, "--run-id", "r", "--set", "trainer.answer_field=x")
    _closed(_plan(runs, model, "--run-id", "r"))  # the refusal left the folder unlocked, and the run as it was
