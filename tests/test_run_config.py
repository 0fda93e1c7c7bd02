"""`tlt run`'s per-run service sections (run_config.resolve_services, to_toml) and its [run] section's bounds: the
endpoints each service is told to use must be the ones its peer listens on, and [run] values of 0 leave the
services' own. Pure functions on hand-written preset dicts; no process is started."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tlt.services.common.config import ConfigError, load_config
from tlt.services.trainer.run_config import RunConfig, resolve_services, to_toml


def _preset(spec: dict, drafter: dict | None = None) -> dict:
    return {"rollout": {"spec": spec}, "trainer": {"steps": 7, "torch_threads": 1}, "drafter": drafter or {},
            "reward": {}}


def test_the_drafter_service_is_pointed_at_the_endpoints_the_rollout_uses(tmp_path: Path) -> None:
    """The drafter connects to the rollout's gRPC port for policy updates, to its capacity publisher and snapshot
    socket, and binds the features socket the rollout pushes to (the default source: the rollout, not the trainer);
    its checkpoints go to the run folder's drafter/, the trainer asks the reward service's port, and no two sockets
    share a port. A drafter told another port waited on a socket nobody served (or loaded the first policy update
    only at a timeout), checkpoints written to the run folder itself mixed with the trainer's, and a trainer sent
    to another port for rewards failed its first step."""
    services, switches = resolve_services(_preset({"drafter": "learned", "drafter_path": "d"}),
                                          RunConfig(model_dir="m"), tmp_path)
    assert switches == {"speculation": True, "drafter": True}
    rollout, drafter = services["rollout"], services["drafter"]
    assert drafter["rollout_grpc"] == f"127.0.0.1:{rollout['grpc_port']}" != f"127.0.0.1:{rollout['http_port']}"
    assert (drafter["capacity_pub"], drafter["capacity_snapshot"]) == (rollout["capacity_pub"],
                                                                       rollout["capacity_snapshot"])
    assert drafter["capacity_pub"] != drafter["capacity_snapshot"]
    assert drafter["features_bind"] == rollout["features_push"]
    assert "drafter_features_address" not in services["trainer"]
    assert drafter["checkpoint_dir"] == str(tmp_path / "drafter")
    assert services["trainer"]["reward_address"] == f"127.0.0.1:{services['reward']['port']}"
    ports = [rollout["http_port"], rollout["grpc_port"], services["reward"]["port"], drafter["status_port"],
             *(int(drafter[k].rsplit(":", 1)[1]) for k in ("capacity_pub", "capacity_snapshot", "features_bind",
                                                           "coordinator_bind"))]
    assert len(set(ports)) == 8, ports  # every socket of the run its own port: two binds on one failed the start


def test_run_values_of_zero_leave_the_trainers_own(tmp_path: Path) -> None:
    """[run] steps = 0 and torch_threads = 0 mean "the [trainer] section's" (their descriptions): steps 0 was
    written over the trainer's 7, a run that trained no step."""
    services, _ = resolve_services(_preset({"mode": "off"}), RunConfig(model_dir="m"), tmp_path)
    assert (services["trainer"]["steps"], services["trainer"]["torch_threads"]) == (7, 1)
    services, _ = resolve_services(_preset({"mode": "off"}), RunConfig(model_dir="m", steps=3), tmp_path)
    assert services["trainer"]["steps"] == 3


def test_the_trainer_trains_the_runs_model_and_the_run_section_stays_out_of_the_services(tmp_path: Path) -> None:
    """`tlt run --model DIR` serves DIR in the rollout, so the trainer must train DIR too: it kept the preset's
    [trainer] model_dir (a policy the rollout does not serve, its updates pushed into another model). The preset's
    [run] is the launcher's, not a service's: it was copied into config.toml, where it contradicted the run's own
    values (steps = 0 beside --steps 3)."""
    preset = {**_preset({"mode": "off"}), "run": {"steps": 0, "model_dir": "preset-model"}}
    preset["trainer"]["model_dir"] = "preset-model"
    services, _ = resolve_services(preset, RunConfig(model_dir="m", steps=3), tmp_path)
    assert services["trainer"]["model_dir"] == "m" and "run" not in services
    assert "run" not in tomllib.loads(to_toml(services)) and "run" in preset  # the caller's preset left as it was

def test_a_rollout_spec_beats_an_old_presets_engine_spec(tmp_path: Path) -> None:
    """An old preset's [rollout.engine.spec] under a [rollout.spec] (`tlt run --set rollout.spec.mode=off` over such
    a preset) is only the fallback: the engine's adaptive mode won, and the baseline the user asked for speculated."""
    preset = _preset({"mode": "off"})
    preset["rollout"]["engine"] = {"spec": {"mode": "adaptive", "drafter": "learned", "drafter_path": "d"}}
    services, switches = resolve_services(preset, RunConfig(model_dir="m"), tmp_path)
    assert switches == {"speculation": False, "drafter": False}
    assert services["rollout"]["spec"]["mode"] == "off" and "spec" not in services["rollout"]["engine"]


def test_a_null_field_is_left_out_of_the_run_config_file(tmp_path: Path) -> None:
    """`tlt run --set 'rollout.spec={"threshold": 8, "mode": null}'` (a JSON map with a field left empty) put a
    None in the rollout's section: writing config.toml failed with a TypeError traceback. The field is left out, so
    the service takes its default, as load_config skips a null."""
    services, _ = resolve_services(_preset({"threshold": 8, "mode": None}), RunConfig(model_dir="m"), tmp_path)
    written = tomllib.loads(to_toml(services))
    assert written["rollout"]["spec"] == {"threshold": 8}


def test_a_warmup_of_fewer_than_eight_problems_is_refused() -> None:
    """The warm-up holds out 1 problem in 8 to score the drafter: drafter_warmup_problems = 7 held out none, and the
    warm-up's before/after acceptance was measured on nothing."""
    with pytest.raises(ConfigError, match=r"drafter_warmup_problems=7 .*greater than or equal to 8"):
        load_config(RunConfig, "run", overrides={"drafter_warmup_problems": 7}, environ={})
    run = load_config(RunConfig, "run", overrides={"drafter_warmup_problems": 8}, environ={})
    assert run.drafter_warmup_problems == 8


def test_a_baseline_run_names_no_drafter_the_run_never_makes(tmp_path: Path) -> None:
    """`tlt run --baseline` with run.drafter_init = warmup: the launcher makes drafter-init only when the run
    speculates, so the rollout must not be told to load it. It was ([rollout.spec] drafter = learned, drafter_path =
    runs/<id>/drafter-init, a folder that never came)."""
    preset = _preset({"mode": "adaptive", "drafter": "ngram"})
    services, switches = resolve_services(preset, RunConfig(model_dir="m", speculation=False, drafter_init="warmup"),
                                          tmp_path)
    assert switches == {"speculation": False, "drafter": False}
    assert services["rollout"]["spec"] == {"mode": "off", "drafter": "ngram"}


@pytest.mark.parametrize("field, value", [("poll_interval_s", 0), ("drafter_warmup_epochs", 0)])
def test_a_run_value_that_would_do_nothing_is_refused(field: str, value: int) -> None:
    """poll_interval_s = 0 sampled the rollout's status in a busy loop (a core taken from the run it measures), and
    a warm-up of 0 epochs started the rollout from an untrained drafter labelled as warmed up."""
    with pytest.raises(ConfigError, match=rf"{field}={value} "):
        load_config(RunConfig, "run", overrides={field: value}, environ={})
