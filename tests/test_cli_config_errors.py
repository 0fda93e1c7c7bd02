"""A mistaken config value, `--set` or ready file is refused the way the CLI promises: one line naming the field
(one line per field when several are wrong), exit status 2, no traceback; values ZeroMQ or the config loader take
still pass. Runs `tlt.cli.main` in this process, or `python -m tlt.cli` / `python -c` in a subprocess with a
bounded timeout (the ready-file and logging cases). Split from test_cli_errors.py, which keeps the argument,
folder and whole-command cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tlt.cli import main


def test_a_config_file_without_the_commands_section_is_refused(tmp_path: Path, capsys) -> None:
    """`tlt train --config FILE` with no [trainer] in FILE (a typo such as [trainr], or another service's file)
    silently trained with every default; the servers' --preset files likewise."""
    import argparse

    from tlt.services.common.config import ConfigError
    from tlt.services.reward import serve as reward_serve
    from tlt.services.rollout import serve as rollout_serve

    typo = tmp_path / "typo.toml"
    typo.write_text("[trainr]\nsteps = 3\n\n[rollouts]\nreplicas = 1\n\n[rewrd]\nkind = 'math'\n")
    assert main(["train", "--config", str(typo), "--print-config"]) == 2
    err = capsys.readouterr()
    assert "no [trainer] section" in err.out + err.err and "trainr" in err.out + err.err
    for serve, section in ((rollout_serve, "rollout"), (reward_serve, "reward")):
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        argv = ["--preset", str(typo)] + (["--model", "m"] if serve is rollout_serve else [])
        with pytest.raises(ConfigError, match=rf"no \[{section}\] section"):
            serve.build_config(parser.parse_args(argv))
    good = tmp_path / "good.toml"
    good.write_text("[trainer]\nsteps = 3\n")
    assert main(["train", "--config", str(good), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3


def test_a_set_without_a_field_name_says_so(capsys) -> None:
    """`--set =1` was reported as "unknown field '(config)'"."""
    assert main(["train", "--set", "=1", "--print-config"]) == 2
    captured = capsys.readouterr()
    assert "no field name" in captured.out + captured.err


def test_a_server_removes_a_ready_file_left_by_an_earlier_run(tmp_path: Path) -> None:
    """A restarted server left its predecessor's ready file in place until it was ready itself: a script waiting for
    the file (as the README's users and this project's own tests do) read the old, dead ports at once; and a server
    that then failed to start left that file saying it was up."""
    import socket

    stale = tmp_path / "ready.json"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        stale.write_text(json.dumps({"port": 1, "pid": 1}))
        assert main(["reward", "serve", "--port", str(busy.getsockname()[1]), "--ready-file", str(stale)]) == 2
    assert not stale.exists()
    stale.write_text(json.dumps({"http_port": 1, "grpc_port": 2, "pid": 1, "replica_pids": []}))
    assert main(["rollout", "serve", "--model", str(tmp_path / "no-model"), "--ready-file", str(stale)]) == 2
    assert not stale.exists()


def test_a_set_naming_the_commands_own_section_says_to_drop_it(capsys) -> None:
    """`tlt run --set trainer.lr=3e-5` is the documented form; the same --set given to `tlt train` was "unknown
    field 'trainer.lr'" followed by a list of fields holding lr, and `tlt rollout serve --set rollout.replicas=2` was
    "unknown nested override(s)", neither saying what to type instead."""
    import argparse

    from tlt.services.common.config import ConfigError
    from tlt.services.rollout import serve as rollout_serve

    assert main(["train", "--set", "trainer.lr=0.5", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "--set lr=0.5 " in err and "without the section" in err, err
    parser = argparse.ArgumentParser()
    rollout_serve.add_arguments(parser)
    with pytest.raises(ConfigError, match=r"without the section: --set replicas=2 "):
        rollout_serve.build_config(parser.parse_args(["--model", "m", "--set", "rollout.replicas=2"]))
    with pytest.raises(ConfigError, match=r"without the section: --set engine.max_num_seqs=8 "):
        rollout_serve.build_config(parser.parse_args(["--model", "m", "--set", "rollout.engine.max_num_seqs=8"]))


def test_a_refusal_naming_several_fields_prints_one_line_each(capsys, monkeypatch) -> None:
    """The readable log printed a multi-line refusal as one repr: error="invalid [trainer] config:\\n  lr=...\\n
    steps=...", every problem after a literal backslash-n on one long line."""
    monkeypatch.delenv("TLT_LOG_JSON", raising=False)
    assert main(["--log-json", "train", "--set", "lr=fast", "--set", "steps=-3", "--print-config"]) == 2
    record = json.loads(capsys.readouterr().err)  # JSON logs keep the whole message in the one record
    assert record["error"].startswith("invalid [trainer] config:\n  lr='fast'"), record
    assert main(["train", "--set", "lr=fast", "--set", "steps=-3", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "\\n" not in err, err
    lines = err.splitlines()
    assert "bad_config" in lines[0] and "invalid [trainer] config:" in lines[0], err
    assert lines[1].startswith("  lr='fast'") and lines[2].startswith("  steps=-3"), err
    monkeypatch.setenv("TLT_LOG_JSON", "1")  # the environment's choice holds where no --log-json is given
    assert main(["train", "--set", "lr=fast", "--set", "steps=-3", "--print-config"]) == 2
    assert json.loads(capsys.readouterr().err)["error"].startswith("invalid [trainer] config:\n  lr='fast'")


DRAFTER_ENDPOINTS = ("capacity_pub", "capacity_snapshot", "features_bind", "coordinator_bind")  # ZeroMQ
# each service's command, run until its config is loaded: a value that passes goes on to a missing model (drafter,
# rollout: one line, without the field's name) or prints the config (train --print-config)
SERVICE_ARGV = {
    "drafter": ["drafter", "serve", "--model", "{model}", "--workers", "0"],
    "rollout": ["rollout", "serve", "--model", "{model}", "--http-port", "0", "--grpc-port", "0"],
    "trainer": ["train", "--print-config"],
}


@pytest.mark.parametrize("section,field,value", [
    *(("drafter", f, "") for f in (*DRAFTER_ENDPOINTS, "rollout_grpc", "host", "checkpoint_dir")),
    *(("drafter", f, "foo") for f in DRAFTER_ENDPOINTS),  # no transport: a ZMQError traceback, or (capacity_*) a
    ("drafter", "capacity_pub", "tcp://127.0.0.1:*"),  # worker that waited; a wildcard port is for a bind, the drafter
    ("drafter", "features_bind", "tcp://127.0.0.1"),    # connects there
    ("drafter", "capacity_pub", "tcp://*:5701"),  # every interface is for a bind: no host to connect to
    ("drafter", "features_bind", "tcp://127.0.0.1:65536"),  # no TCP port
    ("drafter", "rollout_grpc", "127.0.0.1"),  # no port: failed at the first policy update
    ("drafter", "device", ""),  # failed in torch, in each worker process
    ("drafter", "device", "gpu"),
    ("rollout", "capacity_pub", "foo"),  # a ZMQError traceback as the server started
    ("rollout", "features_push", "127.0.0.1:5703"),  # ... in every replica process
    ("rollout", "engine.device", "gpu"),  # failed in torch, in every replica process
    ("rollout", "backend", "sgl"),
    ("trainer", "rollout_addresses", "[]"),
    ("trainer", "drafter_features_address", "foo"),
    ("trainer", "adam_betas", "[0.9, 1.0]"),  # AdamW's "Invalid beta parameter" as the optimizer was built
])
def test_an_empty_or_malformed_service_value_is_refused_naming_the_field(section, field, value, tmp_path, capsys,
                                                                          monkeypatch) -> None:
    """[drafter] took '' for its endpoints: features_bind / coordinator_bind '' were a ZMQError traceback at start,
    capacity_pub '' turned the coordinator's idle gate off without a word and crashed every worker, rollout_grpc ''
    failed only at the first policy update; [rollout] and [trainer] values likewise failed only in a child process,
    in torch or after a connect timeout. Refused when the config is loaded, from --set and the environment."""
    argv = [a.format(model=tmp_path / "m") for a in SERVICE_ARGV[section]]
    assert main([*argv, "--set", f"{field}={value}"]) == 2
    err = capsys.readouterr()
    assert f"{field}=" in err.out + err.err and "Traceback" not in err.out + err.err, err
    monkeypatch.setenv(f"TLT_{section.upper()}__{field.upper().replace('.', '__')}", value)
    assert main(argv) == 2
    assert f"{field}=" in "".join(capsys.readouterr())


def test_drafter_endpoints_that_zeromq_takes_are_accepted() -> None:
    from tlt.services.common.config import load_config
    from tlt.services.drafter.config import DrafterServiceConfig

    cfg = load_config(DrafterServiceConfig, "drafter", "cpu-tiny", {
        "capacity_pub": "tcp://tlt-rollout-0.tlt-rollout:5701", "capacity_snapshot": "tcp://[::1]:5702",
        "features_bind": "tcp://*:65535", "coordinator_bind": "tcp://127.0.0.1:*",
        "rollout_grpc": "rollout:50051"},
        environ={})
    assert cfg.coordinator_bind == "tcp://127.0.0.1:*" and cfg.features_bind == "tcp://*:65535"
    assert load_config(DrafterServiceConfig, "drafter", None, {"features_bind": "ipc:///tmp/tlt-features",
                                                               "coordinator_bind": "inproc://coordinator"}, environ={})


def test_the_library_used_without_the_cli_logs_at_info_not_debug(tmp_path: Path) -> None:
    """A script that uses a client as a library (RewardClient, RolloutClient) never calls configure_logging;
    structlog's own default then printed every debug line (`[debug] reward_retry ...`) on the user's terminal."""
    code = ("from tlt.services.common.logging import get_logger\n"
            "log = get_logger('lib')\nlog.debug('quiet_please')\nlog.info('shown')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_LOG")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "shown" in out.stderr and "quiet_please" not in out.stderr + out.stdout
    env["TLT_LOG_LEVEL"] = "debug"  # the documented switch still opens them
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "quiet_please" in out.stderr
