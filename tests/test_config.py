"""Config loading: layers (defaults -> preset -> environment -> CLI) and the errors users see.

Uses a small config class defined here, so the test does not depend on any
service's config. Presets are written to temporary TOML files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from tlt.services.common.config import (
    ConfigError,
    ServiceConfig,
    cli_overrides,
    env_overrides,
    load_config,
    preset_path,
)


class DemoConfig(ServiceConfig):
    """A tiny service config for the tests."""

    port: int = Field(50099, description="TCP port the demo server listens on")
    host: str = Field("127.0.0.1", description="address to bind")
    ratio: float = Field(0.5, ge=0.0, le=1.0, description="fraction of work done, between 0 and 1")
    names: list[str] = Field(default_factory=list, description="names to greet")


def _preset(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "demo.toml"
    p.write_text(text)
    return p


def test_defaults_without_preset() -> None:
    cfg = load_config(DemoConfig, "demo", environ={})
    assert cfg == DemoConfig()
    assert cfg.port == 50099


def test_config_is_frozen() -> None:
    cfg = load_config(DemoConfig, "demo", environ={})
    with pytest.raises(ValidationError):
        cfg.port = 1  # type: ignore[misc]


def test_layers_later_wins(tmp_path: Path) -> None:
    preset = _preset(tmp_path, '[demo]\nport = 1000\nhost = "0.0.0.0"\nratio = 0.1\n[other]\nport = 7\n')
    cfg = load_config(DemoConfig, "demo", preset, environ={})
    assert (cfg.port, cfg.host, cfg.ratio) == (1000, "0.0.0.0", 0.1)

    env = {"TLT_DEMO__PORT": "2000", "TLT_DEMO__NAMES": '["a", "b"]', "TLT_OTHER__PORT": "9"}
    cfg = load_config(DemoConfig, "demo", preset, environ=env)
    assert (cfg.port, cfg.host, cfg.names) == (2000, "0.0.0.0", ["a", "b"])

    cfg = load_config(DemoConfig, "demo", preset, overrides=cli_overrides(["port=3000", "host=localhost"]), environ=env)
    assert (cfg.port, cfg.host, cfg.ratio) == (3000, "localhost", 0.1)


def test_env_override_parsing() -> None:
    env = {"TLT_DRAFTER_WORKER__BATCH_SIZE": "4", "TLT_DRAFTER_WORKER__NAME": "plain text", "TLT_X__Y": "1"}
    assert env_overrides("drafter-worker", env) == {"batch_size": 4, "name": "plain text"}


def test_cli_override_parsing() -> None:
    assert cli_overrides(["a=1", "b = 2.5", "c=true", "d=hello world", 'e=["x"]', "f=x=y"]) == {
        "a": 1,
        "b": 2.5,
        "c": True,
        "d": "hello world",
        "e": ["x"],
        "f": "x=y",
    }
    with pytest.raises(ConfigError, match="must look like field=value"):
        cli_overrides(["port"])


def test_unknown_field_names_the_known_ones(tmp_path: Path) -> None:
    preset = _preset(tmp_path, "[demo]\nprot = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", preset, environ={})
    msg = str(e.value)
    assert "unknown field 'prot'" in msg
    assert f"preset {preset}" in msg
    assert "host, names, port, ratio" in msg


def test_bad_type_says_field_source_and_description() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", environ={"TLT_DEMO__PORT": "not-a-port"})
    msg = str(e.value)
    assert "port='not-a-port'" in msg
    assert "environment TLT_DEMO__*" in msg
    assert "TCP port the demo server listens on" in msg

    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", overrides=cli_overrides(["ratio=3"]), environ={})
    msg = str(e.value)
    assert "ratio=3" in msg and "command line" in msg and "between 0 and 1" in msg


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    preset = _preset(tmp_path, '[demo]\nport = "x"\nratio = -1\nbogus = 2\n')
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", preset, environ={})
    msg = str(e.value)
    assert "port=" in msg and "ratio=" in msg and "'bogus'" in msg


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", "no-such-preset", environ={})
    msg = str(e.value)
    assert "unknown preset 'no-such-preset'" in msg
    assert "cpu-tiny" in msg


def test_missing_preset_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        preset_path(tmp_path / "absent.toml")


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    preset = _preset(tmp_path, "[demo]\nport = = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(DemoConfig, "demo", preset, environ={})
    assert str(preset) in str(e.value)
    assert "not valid TOML" in str(e.value)


def test_a_folder_an_empty_name_or_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    # each escaped as a traceback (IsADirectoryError, UnicodeDecodeError) from every --preset / --config; a blank
    # name was looked up as the preset '  '
    utf16 = tmp_path / "utf16.toml"
    utf16.write_bytes("[demo]\nport = 3\n".encode("utf-16"))
    for preset, says in ((tmp_path, "is a folder"), ("", "empty"), ("  ", "empty"), (utf16, "not UTF-8")):
        with pytest.raises(ConfigError, match=says):
            load_config(DemoConfig, "demo", preset, environ={})


def test_section_not_a_table(tmp_path: Path) -> None:
    preset = _preset(tmp_path, "demo = 3\n")
    with pytest.raises(ConfigError, match=r"\[demo\]"):
        load_config(DemoConfig, "demo", preset, environ={})


def test_shipped_preset_is_valid_toml() -> None:
    path = preset_path("cpu-tiny")
    assert path.name == "cpu-tiny.toml"
    cfg = load_config(DemoConfig, "demo-section-absent-from-preset", "cpu-tiny", environ={})
    assert cfg == DemoConfig()


class _Inner(ServiceConfig):
    threshold: int = Field(32, description="a nested field")
    mode: str = Field("adaptive", description="another one")


class _Outer(ServiceConfig):
    replicas: int = Field(1, description="a top-level field")
    spec: _Inner = Field(default_factory=_Inner, description="a nested section, [outer.spec] in a preset")


def test_env_reaches_a_nested_section_and_keeps_its_other_fields(tmp_path: Path) -> None:
    # TLT_<SECTION>__<SUB>__<FIELD>: was refused as the unknown field 'spec__threshold'
    preset = _preset(tmp_path, '[outer]\nreplicas = 2\n[outer.spec]\nmode = "static"\nthreshold = 16\n')
    cfg = load_config(_Outer, "outer", preset, environ={"TLT_OUTER__SPEC__THRESHOLD": "8"})
    assert (cfg.replicas, cfg.spec.threshold, cfg.spec.mode) == (2, 8, "static")  # mode kept from the preset
    cfg = load_config(_Outer, "outer", preset, overrides={"spec": {"mode": "off"}},
                      environ={"TLT_OUTER__SPEC__THRESHOLD": "8"})
    assert (cfg.spec.threshold, cfg.spec.mode) == (8, "off")  # each layer updates, none replaces the table
    with pytest.raises(ConfigError, match="unknown field 'spec.bogus'"):
        load_config(_Outer, "outer", preset, environ={"TLT_OUTER__SPEC__BOGUS": "1"})


def test_unknown_nested_field_names_the_nested_sections_fields(tmp_path: Path) -> None:
    # a typo in [outer.spec] listed the fields of [outer] (replicas, spec), none of them the one meant
    preset = _preset(tmp_path, "[outer.spec]\nthreshhold = 16\n")
    with pytest.raises(ConfigError) as e:
        load_config(_Outer, "outer", preset, environ={})
    msg = str(e.value)
    assert "unknown field 'spec.threshhold'" in msg, msg
    assert "did you mean 'threshold'?" in msg and "known fields of [outer.spec]: mode, threshold" in msg, msg
    with pytest.raises(ConfigError, match=r"did you mean 'port'\? known fields of \[demo\]: host, names"):
        load_config(DemoConfig, "demo", _preset(tmp_path, "[demo]\nprot = 1\n"), environ={})


def test_a_number_given_for_a_string_field_is_that_string() -> None:
    # overrides are parsed as TOML literals: `2024` became an int and a str field refused it
    cfg = load_config(DemoConfig, "demo", overrides=cli_overrides(["host=2024"]), environ={"TLT_DEMO__NAMES": "[7]"})
    assert cfg.host == "2024" and cfg.names == ["7"]


@pytest.mark.parametrize("text", ["1.10", "7e2", "0x1F", "1_000", "+5", "inf", "007.50"])
def test_a_number_given_for_a_string_field_keeps_the_text_typed(text: str) -> None:
    """`--set rollout.served_model_name=1.10` served the model as "1.1" (and 7e2 as "700.0"): the override was read
    as a TOML number and the number written back as text, so clients asking for "1.10" were refused. A number field
    given the same text still reads it as the number."""
    cfg = load_config(DemoConfig, "demo", overrides=cli_overrides([f"host={text}"]), environ={})
    assert cfg.host == text
    assert load_config(DemoConfig, "demo", environ={"TLT_DEMO__HOST": text}).host == text
    assert load_config(DemoConfig, "demo", overrides=cli_overrides(["ratio=0.250"]), environ={}).ratio == 0.25
    assert load_config(DemoConfig, "demo", overrides=cli_overrides(["port=0x1F"]), environ={}).port == 31
    from tlt.services.common.config import own_section_hint  # the fix a wrong --set is told to type keeps it too

    assert f"--set host={text} " in own_section_hint("demo", "demo.host", cli_overrides([f"x={text}"])["x"])


class _Maps(ServiceConfig):
    steps: dict[str, list[int]] = Field(default_factory=lambda: {"1": [1, 3], "2": [1]},
                                        description="a dict-valued field (a value, not a section)")
    spec: _Inner = Field(default_factory=_Inner, description="a nested section beside it")


def test_a_keyed_env_var_sets_one_key_of_a_dict_field_and_keeps_the_others(tmp_path: Path) -> None:
    # TLT_<SECTION>__<FIELD>__<KEY>: replaced the whole default map with {"1": [5]}, dropping "2"
    cfg = load_config(_Maps, "maps", environ={"TLT_MAPS__STEPS__1": "[5]", "TLT_MAPS__STEPS__9": "[9]"})
    assert cfg.steps == {"1": [5], "2": [1], "9": [9]}
    preset = _preset(tmp_path, '[maps]\nsteps = {"1" = [2], "7" = [7]}\n')  # a preset's map replaces the default
    assert load_config(_Maps, "maps", preset, environ={}).steps == {"1": [2], "7": [7]}
    cfg = load_config(_Maps, "maps", preset, environ={"TLT_MAPS__STEPS__7": "[8]"})
    assert cfg.steps == {"1": [2], "7": [8]}  # the key set on top of the preset's map, not of the default


def test_a_whole_field_env_var_or_set_replaces_a_dict_field(tmp_path: Path) -> None:
    preset = _preset(tmp_path, '[maps]\nsteps = {"1" = [2], "7" = [7]}\n')
    # a TOML inline table was merged into the preset's map; the JSON object (what compose files write) was
    # refused as a string
    for whole in ('{"9" = [9]}', '{"9": [9]}', ' {"9":[9]} '):
        assert load_config(_Maps, "maps", preset, environ={"TLT_MAPS__STEPS": whole}).steps == {"9": [9]}, whole
    cfg = load_config(_Maps, "maps", preset, overrides=cli_overrides(['steps={"4" = [4]}']),
                      environ={"TLT_MAPS__STEPS__1": "[5]"})
    assert cfg.steps == {"4": [4]}
    # a nested section still merges field by field, whichever way its fields come
    preset = _preset(tmp_path, '[maps.spec]\nthreshold = 16\n')
    cfg = load_config(_Maps, "maps", preset, environ={"TLT_MAPS__SPEC": '{"mode": "off"}'})
    assert (cfg.spec.mode, cfg.spec.threshold) == ("off", 16)
    # both ways at once in one layer: which won depended on the order of the environment
    with pytest.raises(ConfigError, match="TLT_MAPS__STEPS__1: 'steps' is given whole by another variable"):
        load_config(_Maps, "maps", environ={"TLT_MAPS__STEPS__1": "[5]", "TLT_MAPS__STEPS": '{"9": [9]}'})
    with pytest.raises(ConfigError, match="steps="):  # not JSON either: still the string, refused by the field
        load_config(_Maps, "maps", environ={"TLT_MAPS__STEPS": '{"9": [9]'})


def test_the_sglang_adaptive_steps_map_takes_one_key_from_the_environment() -> None:
    from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig

    default = SGLangBackendConfig().adaptive_steps
    cfg = load_config(SGLangBackendConfig, "sglang", environ={"TLT_SGLANG__ADAPTIVE_STEPS__1": "[1, 3]"})
    assert cfg.adaptive_steps == {**default, "1": [1, 3]} and len(default) > 1
    cfg = load_config(SGLangBackendConfig, "sglang", environ={"TLT_SGLANG__ADAPTIVE_STEPS": '{"1": [1, 3]}'})
    assert cfg.adaptive_steps == {"1": [1, 3]}


def test_a_rule_across_fields_is_reported_without_dumping_the_whole_section() -> None:
    """A model-level rule (eval_problems > 0 with your own data_path needs eval_data_path) was reported as
    `(config)={...every field of the section...} (from defaults): Value error, ...`: one unreadable line that
    blamed the defaults for values the user had given."""
    from tlt.services.trainer.config import TrainerConfig

    with pytest.raises(ConfigError) as e:
        load_config(TrainerConfig, "trainer", "cpu-tiny", {"data_path": "/tmp/d.jsonl"}, environ={})
    text = str(e.value)
    assert "(config)=" not in text and "'lr_schedule'" not in text and "Value error" not in text
    assert "eval_problems > 0 with your own data_path needs eval_data_path" in text
    assert "command line" in text and "preset" in text  # where the section's values came from


def test_a_misspelt_environment_variable_is_named_not_silently_ignored() -> None:
    """TLT_ROLOUT__REPLICAS=2 (a misspelt section) and TLT_ROLLOUT_REPLICAS=2 (one underscore) were read by
    nothing, silently: the server ran with 1 replica and nothing said why."""
    from tlt.services.common.config import unknown_environment

    env = {"TLT_ROLOUT__REPLICAS": "2", "TLT_ROLLOUT_REPLICAS": "2", "TLT_TRAINR__LR": "1e-5", "TLT_COLOUR": "1",
           "TLT_ROLLOUT__REPLICAS": "2", "TLT_SGLANG__ADAPTIVE_STEPS__1": "[1]", "TLT_PRESET": "1gpu",
           "TLT_AUTH_TOKEN": "x", "TLT_LOG_JSON": "1", "PATH": "/bin", "TLTX__Y": "1"}
    problems = unknown_environment(env)
    assert len(problems) == 4, problems  # the known sections' variables, the plain ones and non-TLT ones pass
    text = "\n".join(problems)
    assert "TLT_ROLOUT__REPLICAS" in text and "did you mean TLT_ROLLOUT__" in text
    assert "TLT_ROLLOUT_REPLICAS" in text and "TLT_ROLLOUT__REPLICAS" in text.split("TLT_ROLLOUT_REPLICAS", 1)[1]
    assert "TLT_TRAINR__LR" in text and "TLT_TRAINER__" in text
    assert "TLT_COLOUR" in text


def test_tlt_warns_of_a_misspelt_environment_variable(monkeypatch, capsys) -> None:
    from tlt.cli import main

    monkeypatch.setenv("TLT_ROLOUT__REPLICAS", "2")
    assert main(["config", "show", "run"]) == 0
    err = capsys.readouterr().err
    assert "unknown_environment" in err and "TLT_ROLOUT__REPLICAS" in err


def test_true_or_false_for_a_number_is_refused() -> None:
    # pydantic reads true as 1 for an int field: `steps = true` loaded as one step, and `config show` wrote 1
    with pytest.raises(ConfigError, match="true is not a number"):
        load_config(DemoConfig, "demo", overrides=cli_overrides(["port=true"]), environ={})
    with pytest.raises(ConfigError, match="false is not a number"):
        load_config(DemoConfig, "demo", environ={"TLT_DEMO__RATIO": "false"})
    assert load_config(DemoConfig, "demo", overrides=cli_overrides(["port=3"]), environ={}).port == 3
    # inside a list, a tuple or a dict's values too (the engine's decode_graph_buckets, the bandit's thresholds)
    for kv in ("buckets=[true, 2]", "pair=[1, false]", "steps={\"a\" = [2, true]}", "ratio_or_none=true"):
        with pytest.raises(ConfigError, match="is not a number"):
            load_config(Numbers, "demo", overrides=cli_overrides([kv]), environ={})
    ok = load_config(Numbers, "demo", overrides=cli_overrides(["buckets=[1, 2]", "flags=[true]", "either=true"]),
                     environ={})
    assert (ok.buckets, ok.flags, ok.either) == ((1, 2), [True], True)


class Numbers(ServiceConfig):
    buckets: tuple[int, ...] = Field((), description="batch sizes")
    pair: tuple[int, float] = Field((1, 1.0), description="a pair")
    steps: dict[str, list[int]] = Field(default_factory=dict, description="steps by name")
    ratio_or_none: float | None = Field(None, description="a ratio")
    flags: list[bool] = Field(default_factory=list, description="flags")
    either: bool | int = Field(0, description="a flag or a count")


@pytest.mark.parametrize("section, field, value", [
    ("trainer", "lr", "inf"), ("trainer", "kl_beta", "inf"), ("trainer", "grad_clip", "inf"),
    ("trainer", "temperature", "inf"), ("trainer", "entropy_coef", "inf"), ("rollout", "update_timeout_s", "inf"),
])
def test_an_infinite_number_is_refused_naming_the_field(section, field, value) -> None:
    """`gt=0` / `ge=0` bounds let inf through (NaN fails the comparison): `--set trainer.lr=inf` loaded, and one step
    turned every weight to NaN without an error."""
    from tlt.services.common.config_cmd import config_class

    with pytest.raises(ConfigError, match=rf"{field}.*finite number"):
        load_config(config_class(section), section, overrides={field: float(value)})


def test_a_group_of_one_sample_is_refused() -> None:
    """n_samples = 1 was accepted and trained nothing: every group of one is flat (advantage 0), every step's
    gradient 0 (and dynamic sampling rolled out its every round for nothing)."""
    from tlt.services.trainer.config import TrainerConfig

    with pytest.raises(ConfigError, match=r"n_samples=1: .*use n_samples >= 2"):
        load_config(TrainerConfig, "trainer", overrides={"n_samples": 1, "mini_batch_size": 8, "micro_batch_size": 4})


def test_set_strips_the_spaces_around_its_field_and_its_text() -> None:
    """`--set "host = localhost"` (spaces as in a TOML file) set the host ' localhost', a name no socket resolves; and
    `--set " =1"` was taken as the blank field ' ' instead of being refused for its missing field name."""
    assert cli_overrides(["host = localhost", "name= plain text "]) == {"host": "localhost", "name": "plain text"}
    with pytest.raises(ConfigError, match="has no field name"):
        cli_overrides([" =1"])


def test_an_environment_variable_is_read_only_under_its_own_prefix() -> None:
    """Only TLT_<SECTION>__* configures a section: a variable that merely contains the prefix (a script's saved
    OLD_TLT_DEMO__PORT) was read as a field of [demo]."""
    assert env_overrides("demo", {"OLD_TLT_DEMO__PORT": "1", "TLT_DEMO__PORT": "2"}) == {"port": 2}


def test_a_number_from_the_environment_is_its_text_without_the_spaces_around_it() -> None:
    """`TLT_DEMO__HOST=1.10 ` (an env file's line with a trailing space) gave the string field "1.10 ": a served model
    name clients asking for "1.10" do not match. The number's text is taken as TOML reads it, without the spaces."""
    assert load_config(DemoConfig, "demo", environ={"TLT_DEMO__HOST": " 1.10 "}).host == "1.10"


def test_a_plain_text_from_the_environment_is_read_without_the_spaces_around_it_as_set_reads_it() -> None:
    """`TLT_DEMO__HOST=localhost ` (an env file's trailing space) gave the host 'localhost ', a name no socket
    resolves, where `--set host=localhost ` and a number's text were stripped. A quoted TOML string keeps its
    spaces, for a value that needs them."""
    assert load_config(DemoConfig, "demo", environ={"TLT_DEMO__HOST": " localhost \t"}).host == "localhost"
    assert load_config(DemoConfig, "demo", environ={"TLT_DEMO__HOST": '" spaced "'}).host == " spaced "


def test_a_dict_field_given_whole_after_its_keys_is_refused() -> None:
    """TLT_MAPS__STEPS__1 and TLT_MAPS__steps (names that differ in case, so the whole one sorts after the keyed
    one): the whole map silently dropped the keyed variable's value instead of being refused as a clash."""
    with pytest.raises(ConfigError, match="TLT_MAPS__steps: 'steps' is given key by key by other variables"):
        load_config(_Maps, "maps", environ={"TLT_MAPS__STEPS__1": "[5]", "TLT_MAPS__steps": '{"9": [9]}'})


def test_a_null_in_a_nested_sections_json_leaves_that_field_as_the_layers_below_set_it(tmp_path: Path) -> None:
    """TLT_OUTER__SPEC='{"threshold": 8, "mode": null}' (a compose map with a field left empty): the null reached
    the field and the whole section was refused as mode=None, instead of keeping the preset's mode."""
    preset = _preset(tmp_path, '[outer.spec]\nmode = "static"\n')
    cfg = load_config(_Outer, "outer", preset, environ={"TLT_OUTER__SPEC": '{"threshold": 8, "mode": null}'})
    assert (cfg.spec.threshold, cfg.spec.mode) == (8, "static")


def test_a_bad_nested_value_names_the_layer_that_gave_it(tmp_path: Path) -> None:
    """A bad [outer.spec] field from the environment was blamed on "defaults" (its origin was looked up by the
    nested field's name, which no layer sets at the top), leaving the user to look for it everywhere else."""
    preset = _preset(tmp_path, "[outer]\nreplicas = 2\n")
    with pytest.raises(ConfigError, match=r"spec\.threshold='x' \(from environment TLT_OUTER__\*\)"):
        load_config(_Outer, "outer", preset, environ={"TLT_OUTER__SPEC__THRESHOLD": "x"})


def test_only_a_set_naming_the_section_with_a_dot_is_told_to_drop_it(tmp_path: Path) -> None:
    """The "named without the section" hint is for `--set demo.port=1` only: `--set demox=1` (a field that merely
    starts with the section's name) was told to type `--set demox=1` again, and a preset's quoted key
    "demo.port" was told about --set, neither getting the unknown field and the fields [demo] knows."""
    with pytest.raises(ConfigError, match=r"unknown field 'demox' \(from command line\); known fields of \[demo\]"):
        load_config(DemoConfig, "demo", overrides={"demox": 1}, environ={})
    preset = _preset(tmp_path, '[demo]\n"demo.port" = 1\n')
    with pytest.raises(ConfigError, match=r"unknown field 'demo.port' \(from preset .*known fields of \[demo\]"):
        load_config(DemoConfig, "demo", preset, environ={})
    with pytest.raises(ConfigError, match="named without the section: --set port=1 "):
        load_config(DemoConfig, "demo", overrides={"demo.port": 1}, environ={})


def test_a_variable_naming_a_longer_word_than_a_section_is_not_taken_for_one() -> None:
    """TLT_RUNS_DIR (not a variable TLT reads) was reported as [run]'s with one underscore too few, its fix given as
    TLT_RUN___DIR; only TLT_RUN_<FIELD> is that mistake."""
    from tlt.services.common.config import unknown_environment

    (runs,) = unknown_environment({"TLT_RUNS_DIR": "x"})
    assert "not a variable TLT reads" in runs, runs
    (run,) = unknown_environment({"TLT_RUN_STEPS": "3"})
    assert "two underscores after its section: TLT_RUN__STEPS" in run, run


def test_an_empty_file_given_as_a_commands_own_config_is_refused(tmp_path: Path) -> None:
    """`tlt train --config empty.toml` (a file saved before anything was written to it) has no [demo] either, and
    must be refused as a file without the section: it was taken as a valid config of every default."""
    with pytest.raises(ConfigError, match=r"has no \[demo\] section \(its sections: none\)"):
        load_config(DemoConfig, "demo", _preset(tmp_path, ""), environ={}, require_section=True)
    assert load_config(DemoConfig, "demo", _preset(tmp_path, ""), environ={}) == DemoConfig()
