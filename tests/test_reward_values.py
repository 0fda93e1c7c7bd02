"""What a reward function's value may be: a finite number that fits float32, else the step's RewardError.

A huge Python int (10**400) or a Fraction of huge parts overflowed inside the check itself: OverflowError, not a
RewardError, so `tlt train` printed a traceback and the reward server answered that item "verifier failed".
In-process (`FunctionRewards`) and through a real `RewardServer` on 127.0.0.1.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from tlt.services.trainer.rewards import FunctionRewards, RewardError

HUGE = [10**400, -(10**400), Fraction(10**400, 3), 2**128, 10**5000]


@pytest.mark.parametrize("value", HUGE, ids=["int", "negative int", "fraction", "2**128", "past repr's 4300 digits"])
def test_a_value_too_large_for_float32_is_the_steps_reward_error(value) -> None:
    batch = FunctionRewards([lambda prompts, completions, **kw: [value]]).begin()
    batch.submit("k0", "p", "c", "1")
    with pytest.raises(RewardError, match=r"a finite number \(float32\) is required"):
        batch.results()


def test_small_ints_and_fractions_still_score() -> None:
    batch = FunctionRewards([lambda prompts, completions, **kw: [3, Fraction(1, 4)]]).begin()
    batch.submit("a", "p", "c", "1")
    batch.submit("b", "p", "c", "1")
    assert {k: r.reward for k, r in batch.results().items()} == {"a": 3.0, "b": 0.25}


def test_served_a_huge_int_answers_that_item_ok_false_with_the_same_words(tmp_path, monkeypatch) -> None:
    from tlt.services.reward.client import RewardClient
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer
    from tlt.v1 import reward_pb2

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "huge_reward.py").write_text("def score(completions, **kw):\n    return [10 ** 400]\n")
    config = RewardConfig(kind="python", function="huge_reward:score", port=0, workers=1)
    with RewardServer(config) as server, RewardClient(server.address, timeout_s=10, retries=0) as client:
        result, = client.score([reward_pb2.ScoreRequest(id="a", completion="x", reference="1")])
    assert not result.ok and "a finite number (float32) is required" in result.error, result
