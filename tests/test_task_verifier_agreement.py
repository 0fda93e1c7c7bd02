"""The synthetic task's verifier (tlt/task/verify.py, `reward = "task"`, `tlt model eval`) and the math verifier
(services/reward/verifiers.py, `tlt reward serve --kind math`) on the same integer answers.

`answer: −7` (U+2212, the typeset minus sign some tokenizers and chat templates produce) scored 1 with the math
verifier (its normalisation reads the sign) and 0 with the task verifier (ASCII `-` only), so one run's reward
and its eval disagreed; `answer: +7` likewise. Both read them now, and agree on every case below.
"""

from __future__ import annotations

import pytest

from tlt.services.reward.verifiers import math_verifier
from tlt.task import verify
from tlt.task.verify import extract_answer

MINUS = "\u2212"


@pytest.mark.parametrize("completion, reference, right", [
    (f"answer: {MINUS}7", "-7", True),
    (f"answer: {MINUS}7.", "-7", True),
    (f"answer:{MINUS}07<|im_end|>", "-7", True),
    (f"answer: {MINUS}7", "7", False),
    (f"answer: {MINUS}0", "0", True),
    ("answer: +7", "7", True),
    ("answer: +7", "-7", False),
    ("answer: -7", f"{MINUS}7", True),  # a reference written with the typeset minus
    (f"answer: {MINUS}7", f"{MINUS}7", True),
    (f"answer: {MINUS}{MINUS}7", "7", False),
    (f"answer: {MINUS}-7", "-7", False),
    ("answer: +-7", "-7", False),
    (f"answer: {MINUS}7.5", "-7", False),
    ("answer: 7", "7", True),
    ("answer: -7", "-7", True),
])
def test_task_and_math_verifiers_agree(completion, reference, right) -> None:
    assert verify(completion, reference) is right
    assert math_verifier("", completion, reference) is right


def test_the_read_answer_is_in_ascii() -> None:
    assert extract_answer(f"so answer: {MINUS}12") == "-12"
    assert extract_answer("so answer: +12") == "12"


def test_the_task_reward_takes_a_typeset_minus_reference() -> None:
    from tlt.task.verify import integer_reference

    assert integer_reference(f" {MINUS}007 ") == "-7" and integer_reference(f"{MINUS}{MINUS}7") is None
