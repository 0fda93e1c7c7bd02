"""[rollout.spec] checks of the adaptive mode's buckets (SpecConfig._check): what can never run is refused in one line.

- A bucket none of whose drafting arms fits `verify_token_budget` at the bucket's smallest batch size only ever
  decoded plainly (every step counted as over_budget); static mode's budget check refused the same budget.
- An arm named twice in a bucket (`8_4_16,8_4_16`, or `08_4_16`, the same arm once parsed) was explored twice as
  often as the others and listed twice in the bandit's status.
- A bucket that starts above `threshold` never runs (SD is off at those batch sizes): a warning, not a refusal, as
  lowering the threshold of a preset with its buckets (`--spec-threshold 4` on cpu-tiny's 1, 2-4, >=5) is a
  deliberate tweak that should not need the bucket lists rewritten.

Real parts: the config classes, `tlt config check` and `tlt rollout serve`'s config building, in this process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tlt.services.common.config import ConfigError
from tlt.services.rollout.spec.config import SpecConfig

REPO = Path(__file__).resolve().parents[1]


def _refusal(**fields) -> str:
    with pytest.raises(ValueError) as e:
        SpecConfig(**fields)
    return str(e.value)


def test_a_bucket_whose_arms_never_fit_the_budget_is_refused():
    msg = _refusal(mode="adaptive", threshold=16, verify_token_budget=3, bucket_thresholds=(1, 2, 5),
                   bucket_arms=(("8_4_16",), ("8_4_16",), ("8_4_16",)))
    assert "bucket 1" in msg and "8_4_16" in msg and "verify_token_budget = 3" in msg
    # the bucket's smallest batch decides: 4_1_5 fits at batch 2 (10 tokens) but not at 5 (25)
    msg = _refusal(mode="adaptive", threshold=16, verify_token_budget=12, bucket_thresholds=(1, 2, 5),
                   bucket_arms=(("4_1_5",), ("4_1_5", "plain"), ("4_1_5", "plain")))
    assert "bucket >=5" in msg and "bucket 2-4" not in msg
    # one arm that fits is enough; a bucket of only "plain" speculates by choice, not by a budget mistake
    SpecConfig(mode="adaptive", threshold=16, verify_token_budget=12, bucket_thresholds=(1, 2, 5),
               bucket_arms=(("8_4_16", "4_1_5"), ("4_1_5",), ("plain",)))
    SpecConfig(mode="adaptive", threshold=16, verify_token_budget=0, bucket_thresholds=(1, 2, 5),  # 0: no limit
               bucket_arms=(("8_4_16",),) * 3)
    # a bucket that never runs is not held to the budget
    SpecConfig(mode="adaptive", threshold=4, verify_token_budget=12, bucket_thresholds=(1, 2, 5),
               bucket_arms=(("4_1_5",), ("4_1_5",), ("8_4_16",)))
    # the built-in ladder and arms, which the user did not write: a small budget means "plain where nothing fits",
    # as it always did (review: threshold 32 refused any budget below 105, naming bucket arms never set)
    SpecConfig(mode="adaptive", threshold=32, verify_token_budget=64)


@pytest.mark.parametrize("arms,named", [(("8_4_16", "4_1_5", "8_4_16"), "8_4_16"), (("8_4_16", "08_4_16"), "8_4_16"),
                                        (("plain", "4_1_5", "plain"), "plain")])
def test_an_arm_named_twice_in_a_bucket_is_refused(arms, named):
    msg = _refusal(bucket_thresholds=(1, 5), bucket_arms=(("4_1_5",), arms))
    assert f"arm {named} is named twice in bucket >=5" in msg, msg
    SpecConfig(bucket_thresholds=(1, 5), bucket_arms=(("8_4_16",), ("8_4_16", "4_1_5")))  # the same arm in two buckets


def test_buckets_above_the_threshold_are_named_in_a_warning():
    cfg = SpecConfig(threshold=4, bucket_thresholds=(1, 2, 5, 9), bucket_arms=(("4_1_5",),) * 4)
    line = cfg.unused_buckets()
    assert line is not None and "5-8" in line and ">=9" in line and "threshold = 4" in line and "\n" not in line
    three = (("4_1_5",),) * 3
    assert SpecConfig(threshold=5, bucket_thresholds=(1, 2, 5), bucket_arms=three).unused_buckets() is None
    assert SpecConfig(mode="static", threshold=4, bucket_thresholds=(1, 2, 5), bucket_arms=three).unused_buckets() is None
    # the built-in ladder (1, 2-4, 5-20, >=21) is cut by whatever threshold is set: nothing written to warn about
    assert SpecConfig(threshold=8).unused_buckets() is None


def test_rollout_serve_refuses_duplicate_arms_in_one_line():
    from tlt.services.rollout.serve import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match=r"arm 8_4_16 is named twice in buckets 1, 2-4, >=5 ") as e:
        build_config(parser.parse_args(["--model", "m", "--spec-arms", "8_4_16,4_1_5,8_4_16"]))
    assert "[rollout.spec] (from command line): arm 8_4_16 is named twice" in str(e.value)


@pytest.mark.parametrize("preset", sorted(str(p.relative_to(REPO)) for p in (REPO / "deploy" / "configs").glob("*.toml")))
def test_every_preset_still_loads(preset):
    from tlt.services.common.config_cmd import check

    assert check(str(REPO / preset)) >= 1
