"""`tlt rollout serve` takes vLLM's flags with the values `vllm serve` takes: `--dtype half|float` (vLLM's aliases of
float16 / float32) and `--max-model-len 1k` / `32K` (vLLM's `human_readable_int`: k, m, g, t are powers of 1000, K, M,
G, T powers of 1024). Each was refused before any server started. Several `--served-model-name`s or `--api-key`s
(vLLM answers to any of them) are refused in one line naming the flag, not 'unrecognized arguments'.

Real parts: the real argument parser and config loader; nothing is started."""

from __future__ import annotations

import argparse

import pytest

from tlt.services.common.config import ConfigError
from tlt.services.rollout.serve import add_arguments, build_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def _config(*argv: str):
    return build_config(_parser().parse_args(["--model", "m", *argv]))


@pytest.mark.parametrize("given,dtype", [("half", "float16"), ("float", "float32"), ("float16", "float16"),
                                         ("bfloat16", "bfloat16"), ("float32", "float32")])
def test_vllms_dtype_names(given: str, dtype: str) -> None:
    assert _config("--dtype", given).engine.dtype == dtype


@pytest.mark.parametrize("given,tokens", [("1k", 1000), ("1K", 1024), ("32K", 32768), ("25.6k", 25600),
                                          ("2048", 2048), ("1m", 1_000_000)])
def test_vllms_max_model_len_suffixes(given: str, tokens: int) -> None:
    assert _config("--max-model-len", given).engine.max_model_len == tokens


@pytest.mark.parametrize("given", ["1.5K", "lots", "auto"])
def test_a_max_model_len_vllm_would_not_read_is_a_usage_error(given: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--model", "m", "--max-model-len", given])
    assert e.value.code == 2 and "--max-model-len" in capsys.readouterr().err


def test_the_native_engine_has_no_auto_dtype() -> None:
    with pytest.raises(ConfigError, match="auto"):
        _config("--dtype", "auto")


@pytest.mark.parametrize("flag", ["--served-model-name", "--api-key"])
def test_several_names_or_keys_are_refused_naming_the_flag(flag: str, monkeypatch) -> None:
    monkeypatch.delenv("TLT_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=f"{flag} a b: .*one"):
        _config(flag, "a", "b")
    assert _config("--served-model-name", "a").served_model_name == "a"
    assert _config("--api-key", "a").api_key == "a"
