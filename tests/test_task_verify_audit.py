"""The synthetic task's answer checking (tlt/task/verify.py), behaviours a mutation audit found no test held.

`verify` decides the reward of `reward = "task"` and what `tlt model eval` counts as solved, and the reward
server's math verifier reads a bare integer answer through the same `extract_answer` / `same_integer`. Each test
below failed with one mutation of verify.py (audit W-n in its docstring) and passes on the real module. The
expected values are written by hand, not computed with the module.
"""

from __future__ import annotations

import pytest

from tlt.services.reward.verifiers import math_verifier
from tlt.task import extract_answer, reward, verify
from tlt.task.verify import same_integer


@pytest.mark.parametrize("completion", ["answer:  7", "answer:\t7", "answer: \t 7", "answer:\t\t7<|im_end|>"])
def test_any_run_of_spaces_or_tabs_may_separate_the_marker_from_the_number(completion):
    """`answer:` then two spaces, a tab, or a mix of both before the number still scores: a model that pads its
    answer line must not lose the reward. (audit W-4: at most one space; W-5: spaces only, no tab)"""
    assert extract_answer(completion) == "7"
    assert verify(completion, "7") is True
    assert verify(completion, "8") is False


@pytest.mark.parametrize("completion", ["answer:\n7", "answer:\r\n7", "answer: \n 7"])
def test_a_number_on_the_line_after_the_marker_is_no_answer(completion):
    """The number must be on the marker's own line. The slip report (tlt/task/slips.py) reads a completion line
    by line and takes a bare `answer:` line for a wrong answer, and the reward server's math verifier reads no
    answer there either; a verifier that skipped the newline would score 1 what both call wrong.
    (audit W-3: any white space, newlines included, after the marker)"""
    assert extract_answer(completion) is None
    assert verify(completion, "7") is False
    assert math_verifier("", completion, "7") is False


@pytest.mark.parametrize("completion", ["(answer: 7)", "so (answer: 7) it is", "answer: 7!", "answer: 7!!"])
def test_a_closing_parenthesis_or_an_exclamation_mark_ends_the_number(completion):
    """`)` and `!` are sentence punctuation after the answer, as the module docstring promises and as the math
    verifier reads them (its `(answer: 7)` rule): without them a correct answer in an aside or an exclamation
    scored 0 here and 1 on the reward server. (audit W-13: `)` dropped; W-17: `!` dropped)"""
    assert extract_answer(completion) == "7"
    assert verify(completion, "7") is True
    assert math_verifier("", completion, "7") is True


@pytest.mark.parametrize(("a", "b", "same"), [
    ("7", "007", True),
    ("007", "7", True),
    ("-7", "-07", True),
    ("0", "-0", True),
    ("0", "-000", True),
    ("7", " 7 ", True),
    ("7", "-7", False),
    ("70", "7", False),
])
def test_same_integer_compares_the_values_of_both_sides(a, b, same):
    """same_integer canonicalises both of its arguments (zero padding, `-0`, surrounding white space): the
    reward server passes the reference as the data file wrote it, not through int(). (audit W-25: only the
    first side canonicalised; W-24: surrounding white space kept)"""
    assert same_integer(a, b) is same


@pytest.mark.parametrize("reference", ["07", " 7 ", "7\n"])
def test_the_reward_server_scores_a_padded_integer_reference(reference):
    """A reference written `07`, ` 7 ` or with a trailing newline is the integer 7 on the reward server (`tlt
    reward serve --kind math`), as it is for reward = "task" (integer_reference reads it with int()): the correct
    `answer: 7` scores 1, a wrong one 0. (audit W-24, W-25, through the server's verifier)"""
    assert verify("answer: 7", reference) is True
    assert math_verifier("", "answer: 7", reference) is True
    assert math_verifier("", "answer: 8", reference) is False


def test_reward_refuses_prompts_of_another_length():
    """The TRL-style reward takes one prompt per completion; a prompt list of another length means the caller
    paired the wrong rows and must be an error, not a silent score. (audit W-32: only completions vs answers
    checked)"""
    with pytest.raises(ValueError, match="lengths differ"):
        reward(["p"], ["answer: 1", "answer: 2"], ["1", "2"])
    with pytest.raises(ValueError, match="lengths differ"):
        reward(["p", "q", "r"], ["answer: 1", "answer: 2"], ["1", "2"])
    assert reward(["p", "q"], ["answer: 1", "answer: 3"], ["1", "2"]) == [1.0, 0.0]
