"""One degenerate completion over `[reward] max_item_bytes` (256 KiB) against a real reward server.

A long run of long tokens can pass the limit; the server answered that item ok=false and the trainer's
GrpcRewards failed the whole step on it. An item over the limit because of its completion is now scored
`oversized_reward` (0.0: the verifier's minimum) unchecked, with a warning and `tlt_reward_oversized_total`;
the step goes on. An item whose prompt, reference and metadata alone pass the limit is a data row too big for
the server, as before: ok=false, and the step fails naming it.
"""

from __future__ import annotations

import pytest

from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.services.trainer.rewards import GrpcRewards, RewardError

DEGENERATE = " the" * (80 << 10)  # 320 KiB: a long run of one token, over the default 256 KiB


def _never_called(prompt: str, completion: str, reference: str) -> bool:
    raise AssertionError(f"the verifier ran on an item of {len(completion)} characters")


def _score(config: RewardConfig, items: list[tuple[str, str, str, str]], verifier=None):
    with RewardServer(config, verifier) as server:
        source = GrpcRewards(server.address, concurrency=2, timeout_s=10, retries=0)
        try:
            batch = source.begin()
            for key, prompt, completion, answer in items:
                batch.submit(key, prompt, completion, answer)
            return batch.results(), server.metrics.render().decode()
        finally:
            source.close()


def test_a_degenerate_completion_scores_the_minimum_and_the_step_goes_on() -> None:
    config = RewardConfig(port=0, workers=2, grace_s=0.5)
    assert config.max_item_bytes == 256 << 10
    out, metrics = _score(config, [("long", "What is 3+4?", "answer: 7" + DEGENERATE, "7"),
                                   ("good", "What is 3+4?", r"so \boxed{7}", "7")])
    assert (out["long"].reward, out["long"].correct) == (0.0, False)
    assert (out["good"].reward, out["good"].correct) == (1.0, True)
    assert "tlt_reward_oversized_total 1.0" in metrics
    assert 'tlt_reward_scored_total{correct="false"} 1.0' in metrics


def test_the_minimum_is_configurable_and_the_verifier_never_runs_on_it() -> None:
    config = RewardConfig(port=0, workers=1, grace_s=0.5, max_item_bytes=1000, oversized_reward=-1.0)
    out, _ = _score(config, [("long", "q", "x" * 2000, "7")], verifier=_never_called)
    assert (out["long"].reward, out["long"].correct) == (-1.0, False)


def test_a_data_row_over_the_limit_still_fails_the_step_naming_it() -> None:
    config = RewardConfig(port=0, workers=1, grace_s=0.5, max_item_bytes=1000)
    with pytest.raises(RewardError, match="prompt, reference and metadata"):
        _score(config, [("row", "q" * 2000, "answer: 7", "7")])


def test_oversized_reward_must_fit_the_reward_field() -> None:
    """The bound is float32's largest value (FLOAT32_MAX, as the server checks the rewards it sends): it was 3.4e38,
    refusing 3.402e38, which the 32-bit field holds."""
    for bad in (float("inf"), float("nan"), 3.41e38, -3.41e38):
        with pytest.raises(ValueError, match="oversized_reward"):
            RewardConfig(oversized_reward=bad)
    assert RewardConfig(oversized_reward=-3.402e38).oversized_reward == -3.402e38


def test_the_limit_counts_bytes_so_a_multibyte_completion_is_over_it() -> None:
    """max_item_bytes is bytes: 700 characters of `é` are 1400 bytes, over a limit of 1000, and never reach the
    verifier; 490 of them (980 bytes with the rest of the item) are under it and scored."""
    config = RewardConfig(port=0, workers=1, grace_s=0.5, max_item_bytes=1000, oversized_reward=-1.0)
    out, metrics = _score(config, [("wide", "q", "\u00e9" * 700 + " answer: 3", "3")], verifier=_never_called)
    assert (out["wide"].reward, out["wide"].correct) == (-1.0, False)
    assert "tlt_reward_oversized_total 1.0" in metrics
    config = RewardConfig(port=0, workers=1, grace_s=0.5, max_item_bytes=1000)
    out, _ = _score(config, [("under", "q", "\u00e9" * 490 + " answer: 3", "3")])
    assert (out["under"].reward, out["under"].correct) == (1.0, True)


def test_the_bound_an_oversized_reward_is_refused_with_is_one_it_takes() -> None:
    """The error named the bound rounded to 8 digits, 3.4028235e+38, itself over FLOAT32_MAX: a user setting the
    value the message named was refused again. It names FLOAT32_MAX exactly now, a value the option takes."""
    import re

    with pytest.raises(ValueError, match="oversized_reward") as refused:
        RewardConfig(oversized_reward=3.41e38)
    named = float(re.search(r"32-bit float \(([^)]+)\)", str(refused.value)).group(1))
    assert RewardConfig(oversized_reward=named).oversized_reward == named
