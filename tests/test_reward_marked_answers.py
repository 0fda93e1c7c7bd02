"""The math verifier's reading of `answer:` markers for references the synthetic task's integer reading does not
cover (fractions, decimals): `marked_answer` takes the token after the LAST marker (a completion that revises its
answer is scored on the revision), and a closing parenthesis that closes a `(answer: X)` aside is not part of X.
The real verifier the reward server runs for kind = "math"."""

from __future__ import annotations

import pytest

from tlt.services.reward.verifiers import marked_answer, math_verifier


@pytest.mark.parametrize(("completion", "reference", "correct"), [
    ("first 1/3. On reflection, answer: 1/3 is wrong; answer: 1/2", "1/2", True),  # the revision counts
    ("answer: 1/2. No wait, that is wrong: answer: 1/3", "1/2", False),  # and only the revision
    ("answer: 2.5, then rechecked: answer: 7.5", "7.5", True),
    ("So the result is 7.5 (answer: 7.5)", "7.5", True),  # the aside's `)` is not the answer's
    ("So the result is 7.5 (answer: 7.5).", "7.5", True),
    ("we get 2.5 (answer: 2.5)", "7.5", False),
])
def test_the_last_marked_answer_is_scored(completion: str, reference: str, correct: bool) -> None:
    assert math_verifier("", completion, reference) is correct


def test_marked_answer_tokens() -> None:
    assert marked_answer("answer: 1/3; answer: 1/2") == "1/2"
    assert marked_answer("(answer: 7.5)") == "7.5"
    assert marked_answer("(answer: (7.5))") == "(7.5)"  # only the unbalanced `)` goes
    assert marked_answer("answer: f(x)") == "f(x)"  # a balanced one stays
    assert marked_answer("no marker here") is None
