"""SpecConfig validation messages and the SD on/off switch with hysteresis."""

from __future__ import annotations

import pytest

from tlt.services.common.config import ConfigError, load_config
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.switch import SpecSwitch
from tlt.services.rollout.spec.tree import Arm


def test_defaults_are_valid_and_parse():
    c = SpecConfig()
    assert c.mode == "adaptive" and c.threshold == 32 and c.drafter == "ngram"
    assert c.arms()[0][0] == Arm(8, 4, 48)
    c = load_config(SpecConfig, "spec", overrides={"threshold": 8, "bucket_thresholds": [1, 4],
                                                     "bucket_arms": [["8_4_32"], ["4_1_5"]]})
    assert c.arms() == ((Arm(8, 4, 32),), (Arm(4, 1, 5),))


@pytest.mark.parametrize("overrides,needle", [
    ({"bucket_arms": [["8_4_48"]]}, "one arm list per bucket"),
    ({"static_arm": "8_4"}, "steps_topk_drafttokens"),
    ({"static_arm": "2_1_9"}, "exceeds"),
    ({"bucket_thresholds": [1, 1, 5, 21]}, "strictly increasing"),
    ({"drafter": "learned"}, "drafter_path"),
    ({"ngram_min": 5}, "ngram_min"),
    ({"mode": "sometimes"}, "mode"),
])
def test_bad_values_say_how_to_fix(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(SpecConfig, "spec", overrides=overrides)


def test_switch_hysteresis():
    sw = SpecSwitch(threshold=4, hysteresis_steps=3)
    seq = [8, 4, 3, 2, 2, 5, 1, 1, 1, 1]
    got = [sw.update(b) for b in seq]
    # on after 3 consecutive steps <= 4 (steps 2..4), off at once at 5, on again after 3 more
    assert got == [False, False, False, True, True, False, False, False, True, True]
    assert sw.switches == 3


def test_rollout_serve_set_and_environment_both_reach_a_nested_section(monkeypatch) -> None:
    # `--set spec.x` / `--drafter` copied the preset's whole [rollout.spec] onto the command-line layer, which
    # then beat every TLT_ROLLOUT__SPEC__* variable (docker-compose passes --set spec.drafter=...)
    import argparse

    from tlt.services.rollout.serve import build_config

    monkeypatch.setenv("TLT_ROLLOUT__SPEC__THRESHOLD", "8")
    monkeypatch.setenv("TLT_ROLLOUT__ENGINE__KV_CACHE_MB", "64")
    args = argparse.Namespace(overrides=["spec.drafter=ngram", "engine.max_num_seqs=32"], spec="static", drafter=None,
                              preset="cpu-tiny")
    cfg = build_config(args)
    assert (cfg.spec.threshold, cfg.spec.mode, cfg.spec.drafter) == (8, "static", "ngram")
    assert (cfg.engine.kv_cache_mb, cfg.engine.max_num_seqs, cfg.engine.max_model_len) == (64, 32, 1024)  # 1024: preset
    assert "plain" in cfg.spec.bucket_arms[0]  # the preset's arms kept


def test_rollout_serve_names_its_preset_for_the_sglang_replicas(tmp_path) -> None:
    # the SGLang backend's replicas read [sglang] from TLT_PRESET; `tlt rollout serve --preset P` (and tlt run)
    # did not set it, so P's [sglang] values were silently replaced by defaults
    from tlt.services.common.config import load_config
    from tlt.services.rollout.serve import export_preset
    from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig

    env: dict = {}
    export_preset("1gpu", env)
    cfg = load_config(SGLangBackendConfig, "sglang", env["TLT_PRESET"], environ={})
    assert cfg.mem_fraction_static == 0.45  # the 1gpu preset's value, not the default
    export_preset(None, env)  # no --preset: an inherited TLT_PRESET (compose, k8s) stays
    assert env["TLT_PRESET"].endswith("1gpu.toml")


def test_static_arm_must_fit_the_verify_token_budget_at_the_threshold():
    # static mode ignored verify_token_budget: 8_4_48 at batch 64 verified 3072 tokens a step under a budget of
    # 2048. Static speculates only while batch <= threshold, so the arm must fit the budget at the threshold.
    with pytest.raises(ConfigError, match="verify_token_budget"):
        load_config(SpecConfig, "spec", overrides={"mode": "static", "static_arm": "8_4_48", "threshold": 64})
    with pytest.raises(ConfigError, match="verify_token_budget"):
        load_config(SpecConfig, "spec", overrides={"mode": "static", "static_arm": "8_4_16", "threshold": 32,
                                                   "verify_token_budget": 511})
    ok = [{"static_arm": "8_4_32", "threshold": 64},  # 32 x 64 = 2048: at the budget
          {"static_arm": "8_4_48", "threshold": 64, "verify_token_budget": 0},  # 0: no limit
          {"static_arm": "8_4_16", "threshold": 32, "verify_token_budget": 512}]
    for o in ok:
        assert load_config(SpecConfig, "spec", overrides={"mode": "static", **o}).static_arm == o["static_arm"]
    # adaptive mode never runs the static arm (its bandit skips arms over the budget); off runs nothing
    for mode in ("adaptive", "off"):
        load_config(SpecConfig, "spec", overrides={"mode": mode, "static_arm": "8_4_48", "threshold": 64})


def _serve_args(*argv: str):
    import argparse

    from tlt.services.rollout.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_rollout_serve_takes_the_threshold_and_arms_as_flags() -> None:
    # the interface the SD issue names: `tlt rollout serve ... --spec-threshold 32 --spec-arms 8_4_48,8_4_32,...`;
    # both were reachable only as `--set spec.threshold=...` / a TOML list of lists
    from tlt.services.rollout.serve import build_config

    cfg = build_config(_serve_args("--spec", "adaptive", "--spec-threshold", "16", "--spec-arms", "8_4_16,4_1_5,plain"))
    assert cfg.spec.threshold == 16
    assert cfg.spec.bucket_arms == (("8_4_16", "4_1_5", "plain"),) * len(cfg.spec.bucket_thresholds)
    # one list per bucket, `/` between buckets (cpu-tiny has 3 buckets: 1, 2-4, >= 5)
    assert cfg.spec.bucket_thresholds == (1, 2, 5)
    cfg = build_config(_serve_args("--spec-arms", "12_1_13,8_1_9/8_1_9/4_1_5,plain"))
    assert cfg.spec.bucket_arms == (("12_1_13", "8_1_9"), ("8_1_9",), ("4_1_5", "plain"))
    # static mode runs one arm: --spec-arms names it
    cfg = build_config(_serve_args("--spec", "static", "--spec-arms", "4_1_5"))
    assert (cfg.spec.mode, cfg.spec.static_arm) == ("static", "4_1_5")


@pytest.mark.parametrize("argv,needle", [
    (("--spec", "static", "--spec-arms", "4_1_5,8_1_9"), "static mode runs one arm"),
    (("--spec-arms", "8_4_16/4_1_5"), "one arm list per bucket"),
    (("--spec-arms", "8_x_4"), "steps_topk_drafttokens"),
    (("--spec-arms", "8_4_16,,4_1_5"), "empty arm"),
    (("--spec-threshold", "0"), "threshold"),
    (("--spec", "off", "--drafter", "d"), "--drafter d with --spec off"),
])
def test_rollout_serve_refuses_bad_spec_flags_with_the_fix(argv, needle) -> None:
    from tlt.services.rollout.serve import build_config

    with pytest.raises(ConfigError, match=needle):
        build_config(_serve_args(*argv))


@pytest.mark.parametrize("argv,message", [
    (("--spec-arms", "0_1_2,8_1_9"), "--spec-arms '0_1_2,8_1_9': arm 0_1_2: steps and topk must be >= 1"),
    (("--spec", "static", "--spec-arms", "8_4_1000"), "--spec-arms '8_4_1000': arm 8_4_1000: draft_tokens 1000"),
])
def test_a_bad_arm_in_spec_arms_is_refused_in_the_flags_words(argv, message) -> None:
    """An arm SpecConfig refuses was reported as 'invalid [rollout] config:' followed by the whole [rollout.spec]
    section as a dict, the arm's own error at the end of the line; now the flag and the arm's error alone."""
    from tlt.services.rollout.serve import build_config

    with pytest.raises(ConfigError) as e:
        build_config(_serve_args(*argv))
    assert str(e.value).startswith(message) and "bucket_thresholds" not in str(e.value), str(e.value)


def test_switch_counts_decode_steps_only():
    # a step with prefill in it never counts toward switching on (nor breaks the run), but a batch over the
    # threshold switches SD off whatever the step computes
    sw = SpecSwitch(threshold=4, hysteresis_steps=2)
    got = [sw.update(b, decode) for b, decode in [(9, True), (1, False), (1, False), (2, True), (3, False),
                                                   (3, True), (3, False), (5, False), (2, True), (2, True)]]
    assert got == [False, False, False, False, False, True, True, False, False, True]
    assert sw.switches == 3


def test_the_hysteresis_guards_only_against_a_batch_that_was_above_the_threshold():
    """A fresh engine's first small batch (a tail-only workload, a server's first requests) speculates from its
    first decode step; it waited `hysteresis_steps` plain steps (10 at the GPU presets), though no bigger batch had
    run. After a step above the threshold the wait holds as before."""
    sw = SpecSwitch(threshold=4, hysteresis_steps=10)
    got = [sw.update(b, decode) for b, decode in [(3, False), (3, True), (2, True), (6, True)] + [(2, True)] * 10]
    assert got == [False, True, True, False] + [False] * 9 + [True]
    assert sw.switches == 3


def test_a_rule_across_a_nested_sections_fields_is_reported_without_the_section_dumped() -> None:
    """`--set spec.static_arm=0_1_2`: SpecConfig's own check (a model validator) failed on the whole [rollout.spec]
    dict, which was printed before its words ("spec={'mode': ..., 'bucket_arms': [[...]], ...} (from command
    line): Value error, arm 0_1_2: ..."); now the section's name and the rule's words."""
    from tlt.services.rollout.serve import build_config

    with pytest.raises(ConfigError) as e:
        build_config(_serve_args("--set", "spec.static_arm=0_1_2", "--set", "spec.mode=static"))
    assert "[rollout.spec] (from command line): arm 0_1_2: steps and topk must be >= 1" in str(e.value)
    assert "bucket_arms" not in str(e.value) and "Value error" not in str(e.value), str(e.value)
