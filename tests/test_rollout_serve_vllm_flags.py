"""`tlt rollout serve` takes the flags a vLLM user types: `--port`, `--served-model-name`, `--api-key`,
`--max-model-len`, `--dtype`, `--max-num-seqs` (vLLM's `vllm serve` names), mapped onto the [rollout] fields they mean. Before, each was
`unrecognized arguments`, and a deployment script moved over from vLLM failed at its first line.

Real parts: the real argument parser and config loader; one real server on 127.0.0.1 for the key."""

from __future__ import annotations

import argparse

import httpx
import pytest

from rollout_helpers import ServerThread, tiny_checkpoint


def _args(*argv: str) -> argparse.Namespace:
    from tlt.services.rollout.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_vllm_flags_set_the_fields_they_mean(monkeypatch) -> None:
    from tlt.services.rollout.serve import build_config

    monkeypatch.delenv("TLT_API_KEY", raising=False)
    cfg = build_config(_args("--port", "8123", "--served-model-name", "qwen-rl", "--api-key", "sk-abc",
                             "--max-model-len", "512", "--dtype", "bfloat16", "--max-num-seqs", "48"))
    assert (cfg.http_port, cfg.served_model_name, cfg.api_key, cfg.engine.max_model_len) == (
        8123, "qwen-rl", "sk-abc", 512)
    assert (cfg.engine.dtype, cfg.engine.max_num_seqs) == ("bfloat16", 48)
    assert build_config(_args("--http-port", "8124")).http_port == 8124  # the TLT name still works
    defaults = build_config(_args())
    assert defaults.api_key == "" and defaults.served_model_name in ("", None)


def test_a_key_given_on_the_command_line_is_required(tmp_path) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    from tlt.services.rollout.serve import build_config

    cfg = build_config(_args("--api-key", "sk-abc", "--served-model-name", "qwen-rl"))
    with ServerThread(model, replicas=1, api_key=cfg.api_key, served_model_name=cfg.served_model_name) as s:
        body = {"model": "qwen-rl", "prompt": "1+1=", "max_tokens": 2}
        assert httpx.post(f"{s.base_url}/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{s.base_url}/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer sk-abc"})
        assert r.status_code == 200 and r.json()["model"] == "qwen-rl", r.text


@pytest.mark.parametrize("argv", [("--max-model-len", "-5"), ("--port", "-1"), ("--port", "70000"),
                                  ("--dtype", "auto"), ("--max-num-seqs", "0")])
def test_bad_values_are_one_line(argv) -> None:
    from tlt.services.common.config import ConfigError
    from tlt.services.rollout.serve import build_config

    with pytest.raises(ConfigError):
        build_config(_args(*argv))


def test_tlt_flags_set_their_own_field_and_a_toml_keeps_what_no_flag_gives(tmp_path, monkeypatch) -> None:
    """`--replicas`, `--grpc-port`, `--insecure-local` and `--drafter` each set the [rollout] field they name, and
    only it (`--grpc-port` is not the HTTP port; `--drafter DIR` is the learned drafter in DIR, not a path the
    n-gram drafter ignores); a preset's values stay where no flag is given."""
    from tlt.services.rollout.serve import build_config

    for name in ("TLT_ROLLOUT__REPLICAS", "TLT_ROLLOUT__GRPC_PORT", "TLT_ROLLOUT__HTTP_PORT",
                 "TLT_ROLLOUT__INSECURE_LOCAL"):
        monkeypatch.delenv(name, raising=False)
    cfg = build_config(_args("--replicas", "3", "--grpc-port", "50123", "--insecure-local", "--drafter", "dr"))
    assert (cfg.replicas, cfg.grpc_port, cfg.http_port, cfg.insecure_local) == (3, 50123, 8000, True)
    assert (cfg.spec.drafter, cfg.spec.drafter_path) == ("learned", "dr")
    preset = tmp_path / "p.toml"
    preset.write_text("[rollout]\nreplicas = 2\nhttp_port = 8200\ngrpc_port = 50200\ninsecure_local = true\n"
                      "[rollout.spec]\nthreshold = 8\n")
    kept = build_config(_args("--preset", str(preset), "--http-port", "8300"))
    assert (kept.replicas, kept.http_port, kept.grpc_port, kept.insecure_local, kept.spec.threshold) == (
        2, 8300, 50200, True, 8)
