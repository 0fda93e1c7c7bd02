"""`tlt run`'s plan, made before any service starts (`prepare_run`): which run folder a launch takes (new,
`<preset>-<time>`, or the interrupted one it continues), the settings a resume keeps or takes from this launch
(--set, presets, the environment), and the inputs it refuses up front, in one line, leaving no folder behind.
No service is started here: the launches themselves are in tests/test_run_resume.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tlt.services.common.config import ConfigError


def _plan(runs: Path, model: Path, *argv: str):
    import argparse

    from tlt.services.trainer.launch import add_arguments
    from tlt.services.trainer.launcher import prepare_run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return prepare_run(parser.parse_args(["--model", str(model), "--set", f"run.runs_dir={runs}", *argv]))


def test_two_tlt_runs_never_share_a_run_folder(tmp_path: Path) -> None:
    """A second `tlt run` while the first one runs: with the default folder it takes a fresh one; with the same
    --run-id it refuses (it resumed the running folder: its trainer deleted the first one's metrics.jsonl)."""
    from tlt.services.trainer.procs import ServiceError

    model, runs = tmp_path / "model", tmp_path / "runs"
    model.mkdir()
    (model / "config.json").write_text("{}")  # prepare_run only checks that a model is there
    first = _plan(runs, model, "--run-id", "r")
    with pytest.raises(ServiceError, match=rf"in use by another `tlt run` \(pid {os.getpid()}\)"):  # the holder's
        _plan(runs, model, "--run-id", "r")
    with pytest.raises(ServiceError, match="in use by another `tlt run`"):
        _plan(runs, model, "--resume", str(runs / "r"))
    a = _plan(runs, model)
    b = _plan(runs, model)  # `tlt run` twice at once: two folders, each with its own ports
    assert a.run_dir == runs / "cpu-tiny" and b.run_dir != a.run_dir and b.run_dir.name.startswith("cpu-tiny-")
    first.lock.close()  # that run ended (kill -9 releases it too): the folder can be resumed
    assert _plan(runs, model, "--run-id", "r").resumed


def test_run_id_help_states_the_default_folder() -> None:
    """`tlt run --help` describes the folder prepare_run picks without --run-id (test above): `<preset>`,
    continued when interrupted, and `<preset>-<time>` only when that one is finished or in use."""
    import argparse

    from tlt.services.trainer.launch import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if "--run-id" in a.option_strings]
    assert "default: <preset>," in action.help and "<preset>-<time>" in action.help, action.help


def test_resume_with_set_takes_this_launchs_value(tmp_path: Path) -> None:
    import tomllib

    model, runs = tmp_path / "model", tmp_path / "runs"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def lr(*argv: str) -> float:
        plan = _plan(runs, model, "--run-id", "r", *argv)
        if plan.lock is not None:
            plan.lock.close()  # this launch is over
        return tomllib.loads(plan.config_path.read_text())["trainer"]["lr"]

    assert lr("--set", "trainer.lr=1e-5") == 1e-5
    assert lr("--set", "trainer.lr=2e-5") == 2e-5
    assert lr() == 2e-5  # a resume without --set keeps the last one
    assert lr("--set", "trainer.lr=1e-5") == 1e-5  # back to the first value: it was ignored (already in run.json)
    assert json.loads((runs / "r" / "run.json").read_text())["tail_threshold"] == 16  # cpu-tiny's SD threshold


def test_a_set_of_the_step_count_beats_the_steps_the_run_was_started_with(tmp_path: Path) -> None:
    """A run started with --steps 3 kept 3 on a resume with --set trainer.steps=10 (or run.steps=10): the saved
    --steps beat every section, though run.json recorded the new --set."""
    model, runs = _fake_model(tmp_path)
    assert _closed(_plan(runs, model, "--run-id", "r", "--steps", "3")).steps == 3
    assert _closed(_plan(runs, model, "--run-id", "r")).steps == 3  # a resume keeps it
    assert _closed(_plan(runs, model, "--run-id", "r", "--set", "trainer.steps=10")).steps == 10
    assert _closed(_plan(runs, model, "--run-id", "r")).steps == 10  # and keeps the new one
    assert _closed(_plan(runs, model, "--run-id", "r", "--set", "run.steps=12")).steps == 12
    assert _closed(_plan(runs, model, "--run-id", "r", "--steps", "4")).steps == 4


def _fake_model(tmp_path: Path) -> tuple[Path, Path]:
    model, runs = tmp_path / "model", tmp_path / "runs"
    model.mkdir()
    (model / "config.json").write_text("{}")  # prepare_run only checks that a model is there
    return model, runs


def _closed(plan):  # noqa: ANN001, ANN202 - RunPlan
    if plan.lock is not None:
        plan.lock.close()  # this launch is over (kill -9 releases the lock too)
    return plan


def test_resume_with_another_seed_or_data_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """The trainer's checkpoint holds a data position for its seed and data set; a resume with another one
    failed only in the trainer, after every service had started, and run.json kept the new seed: every later
    `tlt run --resume` failed the same way. Refused up front now, and run.json keeps the run's options.
    (The checkpoint is its `latest` pointer only: all prepare_run reads of it.)"""
    from tlt.services.common.config import load_config
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    assert _closed(_plan(runs, model, "--run-id", "new")).run_dir.is_dir()
    _closed(_plan(runs, model, "--run-id", "new", "--seed", "3"))  # no checkpoint yet: the run starts over anyway
    _closed(_plan(runs, model, "--run-id", "r"))
    (runs / "r" / "checkpoints").mkdir(parents=True)
    (runs / "r" / "checkpoints" / "latest").write_text("step-00000002\n")
    for change in (["--seed", "7"], ["--set", "trainer.seed=7"], ["--set", "trainer.synthetic_problems=64"]):
        with pytest.raises(ServiceError, match="a resume keeps"):
            _plan(runs, model, "--run-id", "r", *change)
        saved = json.loads((runs / "r" / "run.json").read_text())
        assert saved["seed"] is None and saved["overrides"] == [f"run.runs_dir={runs}"], change
        _closed(_plan(runs, model, "--resume", str(runs / "r")))  # the refusal left the folder unlocked
    plan = _closed(_plan(runs, model, "--resume", str(runs / "r"), "--set", "trainer.lr=1e-5"))  # the rest may change
    assert load_config(TrainerConfig, "trainer", plan.config_path).seed == 0
    # with trainer.resume = false the trainer starts over: any seed
    plan = _closed(_plan(runs, model, "--run-id", "r", "--seed", "7", "--set", "trainer.resume=false"))
    assert load_config(TrainerConfig, "trainer", plan.config_path).seed == 7


def test_resume_with_an_edited_data_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """The trainer's checkpoint holds a data position in its data file's content (PromptSampler's fingerprint);
    the trainer refuses a resume after the file was edited (same settings, other prompts), but only once every
    service had started. prepare_run compares the fingerprint too now. The checkpoint is a real one, written by
    CheckpointManager.save; a checkpoint saved before the fingerprint was kept is checked on the count alone,
    as the trainer does."""
    import torch

    from test_trainer_step import config, tiny_qwen2
    from tlt.services.trainer.checkpoint import STATE_FILE, CheckpointManager
    from tlt.services.trainer.data import DataError, PromptSampler, load_prompts
    from tlt.services.trainer.policy import Policy
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "source": "test"} for i in range(8)]

    def write(rows: list[dict]) -> None:
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(rows)
    opts = ["--run-id", "r", "--set", f"trainer.data_path={data}", "--set", "trainer.eval_problems=0"]
    run_dir = _closed(_plan(runs, model, *opts)).run_dir
    sampler = PromptSampler(load_prompts(data), 0)  # as the run's trainer has it, 2 steps of 2 prompts in
    sampler.next_batch(4)
    ckpt = CheckpointManager(run_dir / "checkpoints").save(Policy(config(), model=tiny_qwen2(0)), sampler, 2)
    assert _closed(_plan(runs, model, "--run-id", "r")).resumed  # the same file: resumes

    write([*rows[:3], {**rows[3], "answer": "99"}, *rows[4:]])  # edited to the same number of prompts
    with pytest.raises(DataError, match="other content"):  # what the trainer would say, after starting everything
        PromptSampler(load_prompts(data), 0).load_state_dict(sampler.state_dict())
    for argv in (["--run-id", "r"], ["--resume", str(run_dir)]):
        with pytest.raises(ServiceError, match=r"continues from its trainer checkpoint, and a resume keeps the data "
                                               r"it was trained on \(.*prompts.jsonl was edited"):
            _plan(runs, model, *argv)
    write(rows[:6])  # fewer prompts
    with pytest.raises(ServiceError, match="holds 6 prompts, 8 at the checkpoint"):
        _plan(runs, model, "--run-id", "r")
    data.unlink()
    with pytest.raises(ServiceError, match="a resume keeps the data it was trained on.*does not exist"):
        _plan(runs, model, "--run-id", "r")

    write([*rows[:3], {**rows[3], "answer": "99"}, *rows[4:]])
    saved = torch.load(ckpt / STATE_FILE, weights_only=False)  # as written before the fingerprint was kept
    saved["sampler"] = {k: v for k, v in saved["sampler"].items() if k != "fingerprint"}
    torch.save(saved, ckpt / STATE_FILE)
    assert _closed(_plan(runs, model, "--run-id", "r")).resumed
    write(rows[:6])
    with pytest.raises(ServiceError, match="holds 6 prompts"):
        _plan(runs, model, "--run-id", "r")
    assert _closed(_plan(runs, model, "--run-id", "r", "--set", "trainer.resume=false")).resumed  # trainer starts over


def test_resume_with_another_model_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """`--resume ... --model OTHER` failed only in the trainer (a checkpoint of another model), after every service
    had started, and run.json then named the other model: no later resume of the folder could start. The checkpoint
    is a real one (CheckpointManager.save of a tiny Qwen2)."""
    from test_trainer_step import config, tiny_qwen2
    from tlt.services.trainer.checkpoint import CheckpointManager
    from tlt.services.trainer.data import PromptSampler, synthetic_prompts
    from tlt.services.trainer.policy import Policy
    from tlt.services.trainer.procs import ServiceError

    runs = tmp_path / "runs"
    model, other = tmp_path / "model", tmp_path / "other"
    tiny_qwen2(0).config.save_pretrained(model)
    wider = tiny_qwen2(0).config
    wider.intermediate_size = 96
    wider.save_pretrained(other)
    run_dir = _closed(_plan(runs, model, "--run-id", "r")).run_dir
    CheckpointManager(run_dir / "checkpoints").save(Policy(config(), model=tiny_qwen2(0)),
                                                    PromptSampler(synthetic_prompts(8, seed=0), 0), 2)
    assert _closed(_plan(runs, model, "--resume", str(run_dir))).resumed  # its own model: resumes
    with pytest.raises(ServiceError, match=r"checkpoint of another model \(intermediate_size: 64 there, 96"):
        _plan(runs, other, "--resume", str(run_dir))
    assert json.loads((run_dir / "run.json").read_text())["model"] == str(model)  # run.json kept the run's model
    assert _closed(_plan(runs, model, "--resume", str(run_dir))).resumed
    assert _closed(_plan(runs, other, "--run-id", "r", "--set", "trainer.resume=false")).resumed  # starts over


def test_an_invalid_set_is_refused_and_not_kept_for_the_next_launch(tmp_path: Path) -> None:
    """A mistyped --set failed only in the service that loads it, after the others had started; run.json kept it,
    and a later launch without it re-applied it (an unknown field can never be set back)."""
    from tlt.services.common.config import ConfigError

    model, runs = _fake_model(tmp_path)
    _closed(_plan(runs, model, "--run-id", "r"))
    for bad in ("trainer.lrr=1e-5", "trainer.micro_batch_size=3", "rollout.replicas=0", "reward.workers=-1"):
        with pytest.raises(ConfigError):
            _plan(runs, model, "--run-id", "r", "--set", bad)
        assert bad not in json.loads((runs / "r" / "run.json").read_text())["overrides"]
    assert _closed(_plan(runs, model, "--run-id", "r")).resumed


def test_a_set_of_an_unknown_section_is_refused_by_name(tmp_path: Path) -> None:
    """`--set trainr.lr=1` was silently ignored (no service reads a [trainr] section) and kept in run.json."""
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    for bad, guess in (("trainr.lr=1e-5", "; did you mean 'trainer'?"), ("spec.threshold=8", "")):
        with pytest.raises(ServiceError, match="unknown section") as e:
            _plan(runs, model, "--run-id", "r", "--set", bad)
        assert str(e.value).endswith(f"rollout.spec.FIELD){guess}"), e.value
    assert not (runs / "r" / "run.json").exists()
    _closed(_plan(runs, model, "--run-id", "r", "--set", "rollout.spec.threshold=8"))


def test_a_set_into_a_value_or_a_value_for_a_section_is_refused_by_name(tmp_path: Path) -> None:
    """Each was a traceback (TypeError, AttributeError); `tlt config show --set` refused them cleanly."""
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    for bad, says in (("trainer.lr.x=1", "trainer.lr is a value"), ("rollout.engine.max_num_seqs.x=1", "is a value"),
                      ("rollout.spec=3", r"rollout.spec is a section"), ("rollout.engine=off", "is a section")):
        with pytest.raises(ServiceError, match=says):
            _plan(runs, model, "--run-id", "r", "--set", bad)


def test_a_run_file_that_cannot_be_read_is_refused_in_one_line(tmp_path: Path) -> None:
    """A truncated run.json (it was written in place: a kill or a full disk) or one holding a list was a traceback at
    every later launch of the folder; it is now written whole or not at all, and a bad one is refused by name."""
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    plan = _closed(_plan(runs, model, "--run-id", "r"))
    assert json.loads((plan.run_dir / "run.json").read_text())["preset"] == "cpu-tiny"
    assert not list(plan.run_dir.glob(".*.tmp"))
    for text in ('{"preset": "cpu-ti', "[1, 2]"):
        (plan.run_dir / "run.json").write_text(text)
        for argv in (("--run-id", "r"), ("--resume", str(plan.run_dir))):
            with pytest.raises(ServiceError, match="run.json is not a valid run file"):
                _plan(runs, model, *argv)


def test_the_environment_beats_the_presets_run_section_and_the_command_line_beats_both(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """The preset's [run] went in as the command-line layer, so TLT_RUN__* lost to it (while `tlt config show`
    said the environment's value was in force): the README's order is defaults, preset, environment, command line."""
    model, runs = _fake_model(tmp_path)
    preset = tmp_path / "p.toml"
    preset.write_text("[run]\nsteps = 7\npoll_interval_s = 0.1\n")
    monkeypatch.setenv("TLT_RUN__POLL_INTERVAL_S", "0.5")
    monkeypatch.setenv("TLT_RUN__STEPS", "3")
    plan = _closed(_plan(runs, model, "--run-id", "e", "--preset", str(preset)))
    assert (plan.run.steps, plan.run.poll_interval_s) == (3, 0.5)
    plan = _closed(_plan(runs, model, "--run-id", "f", "--preset", str(preset), "--set", "run.poll_interval_s=0.25",
                         "--steps", "2"))
    assert (plan.run.steps, plan.run.poll_interval_s) == (2, 0.25)


def test_a_preset_file_with_an_unknown_section_is_refused_by_name(tmp_path: Path) -> None:
    """`tlt config show > my.toml`, edit, `tlt run --preset my.toml`: a misspelt [trainr] was copied into the run's
    config.toml and ignored, so the trainer ran on its defaults (`tlt config check` refused the same file)."""
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    preset = tmp_path / "my.toml"
    preset.write_text("[trainr]\nlr = 3e-5\n\n[trainer]\nsteps = 2\n")
    with pytest.raises(ServiceError, match=r"my.toml: unknown section \[trainr\]; the sections are run, .*"
                                           r"; did you mean \[trainer\]\?$"):
        _plan(runs, model, "--run-id", "t", "--preset", str(preset))
    assert not (runs / "t").exists()
    preset.write_text("[trainer]\nsteps = 2\n")
    assert _closed(_plan(runs, model, "--run-id", "t", "--preset", str(preset))).steps == 2


def test_a_set_of_one_key_of_a_map_keeps_the_others(tmp_path: Path) -> None:
    """`tlt run --set sglang.adaptive_steps.1=[1, 3]` wrote {"1": [1, 3]} into the run's preset, which replaced the
    whole default map (buckets 2, 5 and 21 gone), where `tlt config show --set` and TLT_SGLANG__ADAPTIVE_STEPS__1
    set that one key (services/common/config.py)."""
    from tlt.services.common.config import load_config
    from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig

    model, runs = _fake_model(tmp_path)
    plan = _closed(_plan(runs, model, "--run-id", "r", "--set", "sglang.adaptive_steps.1=[1, 3]"))
    steps = load_config(SGLangBackendConfig, "sglang", plan.config_path, environ={}).adaptive_steps
    assert steps == {**SGLangBackendConfig().adaptive_steps, "1": [1, 3]}
    plan = _closed(_plan(runs, model, "--run-id", "r2", "--set", 'sglang.adaptive_steps={"4" = [3]}'))
    assert load_config(SGLangBackendConfig, "sglang", plan.config_path, environ={}).adaptive_steps == {"4": [3]}


def test_a_resumed_launch_shows_only_the_evals_its_trainer_keeps(tmp_path: Path) -> None:
    """Killed after the eval after 4 steps but before checkpoint 4: the resumed trainer drops that eval and runs
    it again; the launch showed the killed run's line as well (two 'held-out accuracy after 4 steps')."""
    from tlt.services.trainer.evaluate import EvalRecord, read_evals
    from tlt.services.trainer.launcher import Launcher

    model, runs = _fake_model(tmp_path)
    run_dir = _closed(_plan(runs, model, "--run-id", "r")).run_dir
    evals = run_dir / "eval.jsonl"
    evals.write_text("".join(json.dumps(EvalRecord(k, k, 0.5, 4, 1, 1.0, 1.0).as_dict()) + "\n" for k in (0, 2, 4)))
    plan = _closed(_plan(runs, model, "--run-id", "r"))
    assert Launcher(plan, quiet=True)._show_evals(0, None) == 0  # no checkpoint: the trainer starts over
    evals.write_text("".join(json.dumps(EvalRecord(k, k, 0.5, 4, 1, 1.0, 1.0).as_dict()) + "\n" for k in (0, 2, 4)))
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step-00000002\n")
    launcher = Launcher(_closed(_plan(runs, model, "--run-id", "r")), quiet=True)
    assert launcher._show_evals(0, None) == 2
    assert [e.after_steps for e in read_evals(evals)] == [0, 2]  # what the resumed trainer keeps (loop.py)


@pytest.mark.parametrize("steps", ["0", "-3", "two"])
def test_run_refuses_a_step_count_below_one(steps: str, capsys) -> None:
    """`tlt run --steps 0` ran the preset's 50 steps: 0 was taken for "not given"."""
    import argparse

    from tlt.services.trainer.launch import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--steps", steps])
    assert e.value.code == 2 and "--steps" in capsys.readouterr().err
    assert parser.parse_args(["--steps", "3"]).steps == 3


def test_a_refused_new_run_leaves_no_folder_behind(tmp_path: Path) -> None:
    """A new run refused for a bad --set left runs/<id>/ holding only its .lock (the folder was made, and
    locked, before the settings were checked)."""
    from tlt.services.common.config import ConfigError

    model, runs = tmp_path / "model", tmp_path / "runs"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="nope"):
        _plan(runs, model, "--run-id", "x", "--set", "trainer.nope=1")
    assert not (runs / "x").exists()
    kept = _plan(runs, model, "--run-id", "y")  # an existing run folder refused the same way is kept
    kept.lock.close()
    with pytest.raises(ConfigError, match="nope"):
        _plan(runs, model, "--run-id", "y", "--set", "trainer.nope=1")
    assert (runs / "y" / "run.json").is_file()


def _clock(monkeypatch, *stamps: str) -> None:
    """Pin the launcher's `<preset>-<time>` stamps to `stamps`, one per call (the last one repeats): 'the same
    second' and 'a later second' without waiting for the wall clock."""
    from tlt.services.trainer import launcher

    left, strftime = list(stamps), time.strftime

    def stamp(fmt: str, *when: object) -> str:
        if fmt != "%Y%m%d-%H%M%S":  # a log line's time
            return strftime(fmt, *when)
        return left.pop(0) if len(left) > 1 else left[0]

    monkeypatch.setattr(launcher.time, "strftime", stamp)


def test_tlt_runs_started_in_the_same_second_each_take_a_new_folder(tmp_path: Path, monkeypatch) -> None:
    """Three `tlt run` with no --run-id at once: the first takes `<preset>`, the other two both picked
    `<preset>-<time>` (one-second stamps) and the third was refused as 'in use by another tlt run', where the
    README says a second run with no --run-id takes a new folder."""
    model, runs = _fake_model(tmp_path)
    _clock(monkeypatch, "20260101-000000")
    plans = [_plan(runs, model) for _ in range(3)]  # each holds its folder's lock: all three run at once
    assert [p.run_dir.name for p in plans] == ["cpu-tiny", "cpu-tiny-20260101-000000", "cpu-tiny-20260101-000000-2"]
    assert not any(p.resumed for p in plans)
    for p in plans:
        p.lock.close()


def test_a_set_of_the_trainers_value_beats_the_run_sections_value_the_run_was_started_with(tmp_path: Path) -> None:
    """Started with --set run.steps=6 (or run.torch_threads=2), resumed with --set trainer.steps=10: the saved
    run.steps went over this launch's trainer.steps ([run] is applied over [trainer]), silently."""
    import tomllib

    model, runs = _fake_model(tmp_path)
    _closed(_plan(runs, model, "--run-id", "r", "--set", "run.steps=6", "--set", "run.torch_threads=2"))
    plan = _closed(_plan(runs, model, "--resume", str(runs / "r"), "--set", "trainer.steps=10",
                         "--set", "trainer.torch_threads=1"))
    assert plan.steps == 10
    assert tomllib.loads(plan.config_path.read_text())["trainer"]["torch_threads"] == 1
    plan = _closed(_plan(runs, model, "--run-id", "r"))  # a later resume keeps this launch's values
    assert plan.steps == 10 and tomllib.loads(plan.config_path.read_text())["trainer"]["torch_threads"] == 1
    overrides = json.loads((runs / "r" / "run.json").read_text())["overrides"]
    assert not [o for o in overrides if o.startswith(("run.steps", "run.torch_threads"))], overrides


def _checkpointed(run_dir: Path, steps: int, exported: bool = False) -> None:
    """The trainer's checkpoint after `steps` steps as prepare_run reads it (the pointer, the folder it names, a
    state file that loads); `exported`: and the trained policy's files (a finished run's)."""
    import torch

    (run_dir / "checkpoints" / f"step-{steps:08d}").mkdir(parents=True, exist_ok=True)
    torch.save({"steps_done": steps}, run_dir / "checkpoints" / f"step-{steps:08d}" / "trainer_state.pt")
    (run_dir / "checkpoints" / "latest").write_text(f"step-{steps:08d}\n")
    if exported:
        (run_dir / "policy").mkdir()
        (run_dir / "policy" / "config.json").write_text("{}")
        (run_dir / "policy" / "model.safetensors").write_bytes(b"")


def test_running_tlt_run_again_continues_an_interrupted_run_in_a_preset_time_folder(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """README: 'Ctrl-C ... Run it again and the trainer continues from its last checkpoint'. With the default
    folder `<preset>` finished, a run works in `<preset>-<time>`; after Ctrl-C there, `tlt run` again started a
    new folder from step 0. It continues the interrupted folder of its preset now (the one launched last), and
    takes a new folder when that one is finished, in use, or of another preset."""
    model, runs = _fake_model(tmp_path)
    _clock(monkeypatch, "20260101-000000", "20260101-000001", "20260101-000002", "20260101-000003")
    _checkpointed(_closed(_plan(runs, model, "--steps", "4")).run_dir, 4, exported=True)  # yesterday's: finished
    second = _plan(runs, model, "--steps", "4")
    assert second.run_dir.name == "cpu-tiny-20260101-000000" and not second.resumed
    _checkpointed(_closed(second).run_dir, 2)  # Ctrl-C after 2 of its 4 steps
    again = _plan(runs, model)
    assert again.run_dir == second.run_dir and again.resumed and again.steps == 4  # the options it was started with
    other = _plan(runs, model)  # while that one runs: a new folder
    assert other.run_dir.name == "cpu-tiny-20260101-000001" and not other.resumed
    _closed(other)
    os.utime(other.run_dir / "run.json", (time.time() + 5, time.time() + 5))
    _closed(again)
    assert _closed(_plan(runs, model)).run_dir == other.run_dir  # the interrupted folder launched last
    _checkpointed(other.run_dir, other.steps, exported=True)  # finished
    assert _closed(_plan(runs, model)).run_dir == second.run_dir
    mine = tmp_path / "cpu-tiny.toml"  # another preset of the same name: never continues cpu-tiny's folder
    mine.write_text((Path(__file__).parents[1] / "deploy" / "configs" / "cpu-tiny.toml").read_text())
    plan = _closed(_plan(runs, model, "--preset", str(mine)))
    assert plan.run_dir not in (second.run_dir, other.run_dir) and not plan.resumed


def test_a_runs_dir_that_cannot_hold_a_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    """A runs_dir under a regular file (or on a read-only mount) was a traceback and rc 1 (an OSError out of the
    folder's mkdir), where every other refused input is one `run_not_started` line and rc 2."""
    import argparse

    from tlt.services.trainer.launch import add_arguments, run
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    runs.write_text("not a folder\n")
    for argv in ((), ("--run-id", "r")):
        with pytest.raises(ServiceError, match=f"cannot make the run folder {runs}/"):
            _plan(runs, model, *argv)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--model", str(model), "--set", f"run.runs_dir={runs}", "--quiet"])) == 2


def test_a_finished_default_folder_whose_config_no_longer_loads_does_not_block_a_new_run(tmp_path: Path) -> None:
    """prepare_run loads the default folder's config.toml only to see whether its trainer is done; a field an
    older TLT wrote there (or a hand edit) made that load's ConfigError refuse every new plain `tlt run`."""
    model, runs = _fake_model(tmp_path)
    old = runs / "cpu-tiny"
    _checkpointed(_closed(_plan(runs, model, "--steps", "4")).run_dir, 4, exported=True)
    (old / "config.toml").write_text("[trainer]\nsteps = 4\nold_field = 1\n")
    plan = _closed(_plan(runs, model))
    assert plan.run_dir.name.startswith("cpu-tiny-") and not plan.resumed


def test_the_launchers_step_count_and_tail_threshold_are_the_ones_the_services_run_with(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """TLT_TRAINER__STEPS / TLT_ROLLOUT__SPEC__THRESHOLD change what the trainer and the rollout run with (the
    launcher folds the environment into config.toml); the launcher read both from the preset, so its progress bar
    counted to the preset's steps and report.html drew the tail at the preset's threshold."""
    model, runs = _fake_model(tmp_path)
    monkeypatch.setenv("TLT_TRAINER__STEPS", "7")
    monkeypatch.setenv("TLT_ROLLOUT__SPEC__THRESHOLD", "5")
    plan = _closed(_plan(runs, model, "--run-id", "r"))
    assert (plan.steps, plan.tail_threshold) == (7, 5)
    assert json.loads((plan.run_dir / "run.json").read_text())["tail_threshold"] == 5
    assert _closed(_plan(runs, model, "--run-id", "r", "--set", "run.tail_threshold=9")).tail_threshold == 9


def test_a_resume_from_another_folder_reads_the_preset_and_model_the_run_was_started_with(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """run.json kept `--preset my.toml` and `--model m` as typed, so a resume from another folder read them relative to
    that folder: it failed ("config file my.toml does not exist"), or silently took another my.toml found there."""
    model, runs = _fake_model(tmp_path)
    first, other = tmp_path / "first", tmp_path / "other"
    for folder, lr in ((first, "3e-5"), (other, "0.123")):
        folder.mkdir()
        (folder / "my.toml").write_text(f"[trainer]\nlr = {lr}\n")
    monkeypatch.chdir(first)
    plan = _closed(_plan(runs, Path("../model"), "--run-id", "r", "--preset", "my.toml"))
    saved = json.loads((plan.run_dir / "run.json").read_text())
    assert saved["preset"] == str(first / "my.toml") and Path(saved["model"]) == model
    monkeypatch.chdir(other)
    import argparse

    from tlt.services.trainer.launch import add_arguments
    from tlt.services.trainer.launcher import prepare_run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    resumed = _closed(prepare_run(parser.parse_args(["--resume", str(runs / "r")])))
    assert resumed.services["trainer"]["lr"] == 3e-5 and Path(resumed.run.model_dir) == model
    assert _closed(_plan(runs, model, "--run-id", "n", "--preset", "cpu-tiny")).run_dir == runs / "n"  # a name
    assert json.loads((runs / "n" / "run.json").read_text())["preset"] == "cpu-tiny"


def test_an_empty_runs_dir_is_refused(tmp_path: Path, monkeypatch) -> None:
    """`--set run.runs_dir=` put the run folder in the current folder (./cpu-tiny), where the CLI refuses empty paths
    elsewhere."""
    model, runs = _fake_model(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="runs_dir"):
        _plan(runs, model, "--set", "run.runs_dir=")
    assert not (tmp_path / "cpu-tiny").exists()


def test_a_gpu_preset_that_drafts_model_free_says_how_to_start_the_drafter_service(tmp_path: Path, capfd) -> None:
    """`tlt run --preset 1gpu` (DEPLOY.md: "starts every service of the preset") started no drafter service: the
    preset drafts model-free (n-gram) until a learned drafter exists, and the warning said only "the rollout does not
    draft with a learned drafter, or no drafter service". It now names the cause and the settings that start one;
    with run.drafter_init set the plan runs the service."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # prepare_run only checks that a model is there
    for preset in ("1gpu", "8gpu"):
        plan = _plan(tmp_path / f"runs-{preset}", model, "--preset", preset)
        plan.lock.close()
        out = "".join(capfd.readouterr())
        assert plan.switches == {"speculation": True, "drafter": False}
        assert "drafter_off" in out and "drafter = 'ngram'" in out and "run.drafter_init=warmup" in out, out
    plan = _plan(tmp_path / "runs-init", model, "--preset", "1gpu", "--set", "run.drafter_init=random")
    plan.lock.close()
    assert plan.switches == {"speculation": True, "drafter": True} and "drafter_off" not in "".join(capfd.readouterr())
    assert plan.services["rollout"]["spec"]["drafter"] == "learned"


def test_a_damaged_last_checkpoint_is_one_line_and_a_plain_run_takes_another_folder(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """A trainer_state.pt cut short (a full disk, a copy) or a `latest` pointer overwritten ended `tlt run` in an
    EOFError / ValueError traceback before it started; in the default folder, every plain `tlt run` (`make run`)
    then did. A resume of it is one line naming the file and the ways on; a plain run leaves it alone (said in a
    warning) and takes a new folder."""
    from tlt.services.trainer.procs import ServiceError

    model, runs = _fake_model(tmp_path)
    _clock(monkeypatch, "20260101-000000", "20260101-000001")
    run_dir = _closed(_plan(runs, model, "--steps", "4")).run_dir  # the default folder, interrupted after 2 steps
    _checkpointed(run_dir, 2)
    (run_dir / "checkpoints" / "step-00000002" / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(ServiceError, match=r"trainer_state.pt cannot be read .*: point .*latest at an earlier"):
        _plan(runs, model, "--resume", str(run_dir))
    assert _closed(_plan(runs, model, "--steps", "4")).run_dir.name == "cpu-tiny-20260101-000000"
    (run_dir / "checkpoints" / "latest").write_text("garbage\n")
    with pytest.raises(ServiceError, match=r"latest names no checkpoint \('garbage'\)"):
        _plan(runs, model, "--resume", str(run_dir))
    (run_dir / "checkpoints" / "latest").write_text("step-00000003\n")  # a plausible name, no such checkpoint
    assert _closed(_plan(runs, model, "--steps", "4")).run_dir != run_dir


def test_a_run_killed_before_its_policy_export_is_continued_not_left(tmp_path: Path, monkeypatch) -> None:
    """The last checkpoint is written before the trained policy is exported: a run killed between them counted as
    finished, a plain `tlt run` took a new folder and the policy was never exported. It is continued (its trainer,
    with no step left, exports the policy); once exported, the run is finished."""
    model, runs = _fake_model(tmp_path)
    _clock(monkeypatch, "20260101-000000")
    run_dir = _closed(_plan(runs, model, "--steps", "4")).run_dir
    _checkpointed(run_dir, 4)  # every step done, no policy/
    again = _closed(_plan(runs, model, "--steps", "4"))
    assert again.run_dir == run_dir and again.resumed
    (run_dir / "policy").mkdir()
    (run_dir / "policy" / "config.json").write_text("{}")
    (run_dir / "policy" / "model.safetensors").write_bytes(b"")
    assert _closed(_plan(runs, model, "--steps", "4")).run_dir.name == "cpu-tiny-20260101-000000"


def test_a_run_from_an_earlier_runs_policy_names_the_drafter_beside_it(tmp_path: Path, capfd) -> None:
    """`tlt run --model runs/<id>/policy` started its online drafter from a random (or warmed-up) one, while the
    drafter trained with that policy sat beside it in runs/<id>/policy-drafter: the plan now says so, with the --set
    that starts from it. Not said once drafter_init names a folder, nor without a policy-drafter."""
    from tlt.model.testing import random_checkpoint
    from tlt.services.drafter.training import new_drafter

    earlier = tmp_path / "runs0" / "first"
    model = random_checkpoint(earlier / "policy")
    new_drafter(model, seed=1).save(earlier / "policy-drafter")
    capfd.readouterr()
    plan = _plan(tmp_path / "runs", model, "--run-id", "a")
    plan.lock.close()
    err = capfd.readouterr().err
    assert "drafter_beside_policy" in err and f"--set run.drafter_init={earlier / 'policy-drafter'}" in err, err
    plan = _plan(tmp_path / "runs", model, "--run-id", "b", "--set", f"run.drafter_init={earlier / 'policy-drafter'}")
    plan.lock.close()
    assert "drafter_beside_policy" not in capfd.readouterr().err
    (earlier / "policy-drafter" / "drafter_config.json").unlink()
    plan = _plan(tmp_path / "runs", model, "--run-id", "c")
    plan.lock.close()
    assert "drafter_beside_policy" not in capfd.readouterr().err
