"""`tlt run`'s services see the settings the README promises: preset, then the environment, then the command line.

The launcher folds TLT_<SECTION>__* into the run's config.toml under --set and takes them out of its children's
environment (services/trainer/run_env.py); each test loads a section as a child would (`_as_child`). No service is
started: the plans come from `prepare_run` (tests/test_run_plan.py's helpers).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_run_plan import _closed, _fake_model, _plan
from tlt.services.common.config import ConfigError


def _as_child(plan, cls, section: str):  # noqa: ANN001, ANN202 - RunPlan, a config class
    """`section` as a service of this run loads it: config.toml, under the environment `tlt run` gives its children."""
    from tlt.services.common.config import load_config

    env = {k: v for k, v in os.environ.items() if k not in plan.child_unset_env}
    return load_config(cls, section, plan.config_path, environ=env)


def test_the_command_line_beats_the_environment_in_the_services_of_a_run(tmp_path: Path, monkeypatch) -> None:
    """The README's order is preset, environment, command line. The children loaded config.toml (the preset with
    --set, --steps and the run's own paths in it) as their preset and the environment over it, so TLT_TRAINER__STEPS
    beat --steps, TLT_TRAINER__LR beat --set trainer.lr, and TLT_TRAINER__OUTPUT_DIR sent the run's checkpoints and
    metrics out of its folder. The environment is now folded into config.toml under the command line, and the
    children do not read it again; a secret (an API key) stays out of config.toml and reaches them as it was set."""
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.trainer.config import TrainerConfig

    model, runs = _fake_model(tmp_path)
    monkeypatch.setenv("TLT_TRAINER__STEPS", "7")
    monkeypatch.setenv("TLT_TRAINER__LR", "0.5")
    monkeypatch.setenv("TLT_TRAINER__KL_BETA", "0.25")  # no command line: the environment's value
    monkeypatch.setenv("TLT_TRAINER__OUTPUT_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("TLT_ROLLOUT__SPEC__THRESHOLD", "5")
    monkeypatch.setenv("TLT_ROLLOUT__API_KEY", "sk-secret")
    plan = _closed(_plan(runs, model, "--run-id", "r", "--steps", "1", "--set", "trainer.lr=1e-4"))
    trainer = _as_child(plan, TrainerConfig, "trainer")
    assert (trainer.steps, trainer.lr, trainer.kl_beta) == (1, 1e-4, 0.25)
    assert Path(trainer.output_dir) == plan.run_dir and plan.steps == 1
    rollout = _as_child(plan, RolloutConfig, "rollout")
    assert (rollout.spec.threshold, plan.tail_threshold, rollout.api_key) == (5, 5, "sk-secret")
    assert "sk-secret" not in plan.config_path.read_text()
    assert {"TLT_TRAINER__STEPS", "TLT_TRAINER__OUTPUT_DIR"} <= set(plan.child_unset_env)
    assert "TLT_ROLLOUT__API_KEY" not in plan.child_unset_env
    # a secret set on the command line beats the environment's, as any other field
    plan = _closed(_plan(runs, model, "--run-id", "s", "--set", "rollout.api_key=sk-cli"))
    assert _as_child(plan, RolloutConfig, "rollout").api_key == "sk-cli"


def test_a_name_that_looks_like_a_number_reaches_the_services_as_typed(tmp_path: Path) -> None:
    """`tlt run --set rollout.served_model_name=1.10`: config.toml said 1.1, a TOML number, which the rollout read
    back as the name "1.1"."""
    from tlt.services.rollout.config import RolloutConfig

    model, runs = _fake_model(tmp_path)
    plan = _closed(_plan(runs, model, "--run-id", "n", "--set", "rollout.served_model_name=1.10",
                         "--set", "trainer.lr=3.0e-5"))
    assert _as_child(plan, RolloutConfig, "rollout").served_model_name == "1.10"
    assert plan.services["trainer"]["lr"] == 3e-5
    # a text field that may be unset (str | None) alike: [trainer] eval_answer_field = 1.10 named the column "1.1"
    from tlt.services.trainer.config import TrainerConfig

    plan = _closed(_plan(runs, model, "--run-id", "n", "--set", "trainer.eval_answer_field=1.10"))
    assert _as_child(plan, TrainerConfig, "trainer").eval_answer_field == "1.10"


def test_a_bad_environment_variable_is_refused_naming_where_such_values_come_from(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Folded into the run's sections, a misspelt TLT_TRAINER__LRR was refused as "from command line"."""
    model, runs = _fake_model(tmp_path)
    monkeypatch.setenv("TLT_TRAINER__LRR", "1")
    with pytest.raises(ConfigError, match=r"unknown field 'lrr' \(from the preset, TLT_\* variables or --set\); "
                                          r"did you mean 'lr'\?"):
        _plan(runs, model, "--run-id", "v")
    assert not (runs / "v").exists()


def test_a_nested_section_given_whole_in_the_environment_updates_it_field_by_field(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """TLT_ROLLOUT__SPEC='{"threshold": 8}' replaced the preset's [rollout.spec] (its drafter, buckets and arms
    gone) once folded into config.toml; a service loading it updates the section field by field (README)."""
    from tlt.services.rollout.config import RolloutConfig

    model, runs = _fake_model(tmp_path)
    monkeypatch.setenv("TLT_ROLLOUT__SPEC", '{"threshold": 8}')
    spec = _as_child(_closed(_plan(runs, model, "--run-id", "w")), RolloutConfig, "rollout").spec
    monkeypatch.delenv("TLT_ROLLOUT__SPEC")
    preset = _as_child(_closed(_plan(runs, model, "--run-id", "p")), RolloutConfig, "rollout").spec
    assert spec.threshold == 8 and preset.threshold != 8
    assert (spec.drafter, spec.bucket_thresholds, spec.bucket_arms) == (preset.drafter, preset.bucket_thresholds,
                                                                     preset.bucket_arms)
