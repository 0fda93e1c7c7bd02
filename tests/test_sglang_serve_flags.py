"""`tlt rollout serve --backend sglang`: the speculative flags reach the replicas, and what they would fail on is
refused before anything starts.

The SGLang replicas read their `[sglang]` section from the preset named by TLT_PRESET plus `TLT_SGLANG__*`
(`sglang_backend/engine.py::resolve_config`). `--drafter`, `--spec` and `--spec-threshold` were only mapped
into `[rollout.spec]`, which the SGLang backend never reads: `--drafter DIR` was dropped and each replica then
failed with "needs a drafter: pass --drafter DIR", and `--spec off` still launched EAGLE.

Nothing here starts SGLang (it needs a CUDA GPU): the checks read the same config a replica would, through
the real `load_config` and `engine_kwargs`, and the CLI runs the real `tlt rollout serve` up to the check
before start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_fakes import replica_config, serve_args
from tlt.cli import main
from tlt.services.common.config import ConfigError
from tlt.services.rollout import serve
from tlt.services.rollout.sglang_backend.launch import engine_kwargs


def _export(folder: Path, arch: str = "Qwen2ForCausalLMEagle") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "qwen2"}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_drafter_and_spec_flags_reach_the_sglang_section(tmp_path: Path) -> None:
    drafter = _export(tmp_path / "eagle")
    cfg = replica_config(serve_args("--drafter", str(drafter), "--spec", "static", "--spec-threshold", "8"))
    assert (cfg.draft_model_path, cfg.adaptive, cfg.spec_batch_threshold) == (str(drafter), False, 8)
    assert engine_kwargs(cfg, "/m", 0)["speculative_draft_model_path"] == str(drafter)

    adaptive = replica_config(serve_args("--drafter", str(drafter), "--spec", "adaptive"))
    assert adaptive.adaptive is True and adaptive.speculative_algorithm == "EAGLE"


def test_spec_off_launches_sglang_without_a_drafter(tmp_path: Path) -> None:
    cfg = replica_config(serve_args("--spec", "off"))
    assert cfg.speculative_algorithm == "none"
    assert "speculative_algorithm" not in engine_kwargs(cfg, "/m", 0)


def test_a_static_arm_becomes_sglangs_draft_shape(tmp_path: Path) -> None:
    drafter = _export(tmp_path / "eagle")
    cfg = replica_config(serve_args("--drafter", str(drafter), "--spec", "static", "--spec-arms", "6_4_16"))
    assert (cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens, cfg.adaptive) == (6, 4, 16, False)
    kw = engine_kwargs(cfg, "/m", 0)
    assert (kw["speculative_num_steps"], kw["speculative_eagle_topk"], kw["speculative_num_draft_tokens"]) == (6, 4, 16)


def test_flags_sglang_cannot_honour_are_refused(tmp_path: Path) -> None:
    drafter = _export(tmp_path / "eagle")
    with pytest.raises(ConfigError, match="adaptive_steps"):  # SGLang's adaptive mode varies only the chain depth
        serve.export_sglang_flags(serve_args("--drafter", str(drafter), "--spec-arms", "8_4_48,8_4_16"), {})
    with pytest.raises(ConfigError, match="plain"):
        serve.export_sglang_flags(serve_args("--drafter", str(drafter), "--spec", "static", "--spec-arms", "plain"), {})
    with pytest.raises(ConfigError, match="--spec off"):  # a drafter with speculation off: one of them is a mistake
        serve.export_sglang_flags(serve_args("--drafter", str(drafter), "--spec", "off"), {})


def test_the_sglang_drafter_is_checked_before_start(tmp_path: Path, monkeypatch) -> None:
    from tlt.model.drafter import DrafterError
    from tlt.services.rollout.config import RolloutConfig

    model = _checkpoint(tmp_path / "model")
    monkeypatch.delenv("TLT_PRESET", raising=False)
    for name in [k for k in __import__("os").environ if k.startswith("TLT_SGLANG__")]:
        monkeypatch.delenv(name)
    config = RolloutConfig(backend="sglang")
    with pytest.raises(ConfigError, match="--drafter") as e:  # EAGLE by default, and no drafter named
        serve.check_before_start(str(model), config)
    assert "--spec off" in str(e.value)

    tlt_drafter = tmp_path / "tlt-drafter"  # TLT's own drafter folder: SGLang reads an export of it
    tlt_drafter.mkdir()
    (tlt_drafter / "drafter_config.json").write_text("{}")
    (tlt_drafter / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("TLT_SGLANG__DRAFT_MODEL_PATH", str(tlt_drafter))
    with pytest.raises(DrafterError, match="tlt drafter export"):
        serve.check_before_start(str(model), config)

    monkeypatch.setenv("TLT_SGLANG__DRAFT_MODEL_PATH", str(tmp_path / "missing"))
    with pytest.raises(DrafterError, match="missing"):
        serve.check_before_start(str(model), config)

    monkeypatch.setenv("TLT_SGLANG__DRAFT_MODEL_PATH", str(_checkpoint(tmp_path / "plain-model")))
    with pytest.raises(DrafterError, match="EAGLE"):  # a model, but not an EAGLE draft model
        serve.check_before_start(str(model), config)

    monkeypatch.setenv("TLT_SGLANG__DRAFT_MODEL_PATH", str(_export(tmp_path / "eagle")))
    serve.check_before_start(str(model), config)
    monkeypatch.setenv("TLT_SGLANG__SPECULATIVE_ALGORITHM", "EAGLE3")
    monkeypatch.setenv("TLT_SGLANG__RETURN_HIDDEN_STATES", "false")
    with pytest.raises(DrafterError, match="speculative_algorithm = 'EAGLE'"):  # our export is not an EAGLE3 model
        serve.check_before_start(str(model), config)
    monkeypatch.delenv("TLT_SGLANG__RETURN_HIDDEN_STATES")
    monkeypatch.delenv("TLT_SGLANG__DRAFT_MODEL_PATH")
    monkeypatch.setenv("TLT_SGLANG__SPECULATIVE_ALGORITHM", "none")
    serve.check_before_start(str(model), config)


def test_rollout_serve_with_sglang_and_no_drafter_exits_2_before_starting(tmp_path: Path, monkeypatch,
                                                                          capsys) -> None:
    monkeypatch.delenv("TLT_PRESET", raising=False)
    for name in [k for k in __import__("os").environ if k.startswith("TLT_SGLANG__")]:
        monkeypatch.delenv(name)
    model = _checkpoint(tmp_path / "model")
    assert main(["rollout", "serve", "--model", str(model), "--backend", "sglang"]) == 2
    err = capsys.readouterr()
    assert "--drafter" in err.out + err.err and "Traceback" not in err.out + err.err


@pytest.mark.parametrize("argv,flag,field", [
    (["--dtype", "float64"], "--dtype", "dtype"),
    (["--max-model-len", "-5"], "--max-model-len", "context_length"),
    (["--max-num-seqs", "-1"], "--max-num-seqs", "max_running_requests"),
])
def test_a_bad_flag_for_the_sglang_replicas_is_named_as_the_flag(argv, flag, field, tmp_path: Path, monkeypatch,
                                                                 capfd) -> None:
    """serve hands these flags to its replicas as TLT_SGLANG__* variables, and the config check before start read them
    back from there: `--dtype float64` was refused as "dtype='float64' (from environment TLT_SGLANG__*)", though the
    user set no variable. Refused naming the flag, exit 2, one bad_config error, before anything starts."""
    monkeypatch.delenv("TLT_PRESET", raising=False)
    for name in [k for k in __import__("os").environ if k.startswith("TLT_SGLANG__")]:
        monkeypatch.delenv(name)
    model = _checkpoint(tmp_path / "model")
    assert main(["rollout", "serve", "--model", str(model), "--backend", "sglang", "--spec", "off", *argv]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("bad_config") == 1, err
    assert f"{field}=" in err and f"(from {flag})" in err and "environment" not in err, err


def test_a_drafter_folder_named_like_a_toml_value_reaches_the_replicas_as_text(tmp_path: Path, monkeypatch) -> None:
    """The flags travel to the SGLang replicas as TLT_SGLANG__* TOML literals: a relative folder whose name TOML
    reads as another type (a dated export, `2024-05-01`) written bare came back a date, and every replica refused its
    [sglang] config after the front had accepted the same flags."""
    monkeypatch.chdir(tmp_path)
    _export(tmp_path / "2024-05-01")
    cfg = replica_config(serve_args("--drafter", "2024-05-01", "--spec", "static"))
    assert (cfg.draft_model_path, cfg.adaptive) == ("2024-05-01", False)


def test_one_arm_without_spec_is_refused_where_the_sglang_section_is_adaptive(tmp_path: Path) -> None:
    """With no --spec the [sglang] section decides the mode, as the replicas will read it: adaptive there (the
    default) chooses only a chain depth, so even one --spec-arms arm is refused, not handed to an adaptive SGLang;
    with adaptive = false in the environment the same arm is the static draft shape."""
    drafter = _export(tmp_path / "eagle")
    with pytest.raises(ConfigError, match="adaptive mode chooses only a chain depth"):
        serve.export_sglang_flags(serve_args("--drafter", str(drafter), "--spec-arms", "6_4_16"), {})
    env = {"TLT_SGLANG__ADAPTIVE": "false"}
    serve.export_sglang_flags(serve_args("--drafter", str(drafter), "--spec-arms", "6_4_16"), env)
    assert (env["TLT_SGLANG__NUM_STEPS"], env["TLT_SGLANG__EAGLE_TOPK"]) == ("6", "4")
