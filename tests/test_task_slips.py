"""`tlt.task.slips.first_slip` against hand-built completions of one hand-built problem."""

from __future__ import annotations

import pytest

from tlt.task import make_problem
from tlt.task.slips import SLIPS, first_slip, reference_steps, slip_shares

# Compute mod 10: 5 *4 -7 +3  ->  5*4=0 / 0-7=3 / 3+3=6 / answer: 6
P = make_problem(5, [("*", 4), ("-", 7), ("+", 3)])


def test_the_problem_is_what_the_cases_assume():
    assert P.prompt == "Compute mod 10: 5 *4 -7 +3"
    assert P.solution == "5*4=0\n0-7=3\n3+3=6\nanswer: 6"
    assert reference_steps(P) == (5, [("*", 4), ("-", 7), ("+", 3)])


@pytest.mark.parametrize(("completion", "slip"), [
    ("5*4=0\n0-7=3\n3+3=6\nanswer: 6", "none"),
    ("5*4=0\n0-7=3\n3+3=6\nanswer: 6<|im_end|>", "none"),
    ("  5*4=0\n\n0-7=3\n3+3=6\nanswer:6\n", "none"),  # blank lines and spacing do not count
    ("5*7=5\n5-7=8\n8+3=1\nanswer: 1", "read"),  # the operand misread
    ("5*4=0\n0+7=7\n7+3=0\nanswer: 0", "read"),  # the operation misread
    ("6*4=4\n4-7=7\n7+3=0\nanswer: 0", "carry"),  # the start digit misread
    ("5*4=0\n1-7=4\n4+3=7\nanswer: 7", "carry"),  # the last result not carried
    ("5*4=0\n0-7=7\n7+3=0\nanswer: 0", "arithmetic"),
    ("5*4=0\n0-7=3\nanswer: 3", "early_answer"),
    ("5*4=0\n0-7=3\n3+3=6\n6+1=7\nanswer: 7", "extra_line"),
    ("5*4=0\n0-7=3\n3+3=6\nanswer: 3", "answer"),
    ("5*4=0\nzero minus seven\n", "format"),
    ("5*4=0\n0-7=3\n3+3=6", "no_answer"),
    ("", "no_answer"),
])
def test_first_slip_by_hand(completion, slip):
    assert first_slip(P, completion) == slip


def test_a_line_wrong_twice_is_a_carry_slip():
    assert first_slip(P, "7*9=3\n3-7=6\n6+3=9\nanswer: 9") == "carry"


def test_a_slip_can_still_reach_the_right_answer():
    # 5*4=0 misread as 5*2=0: a read slip whose result happens to be right, and so is the answer
    assert first_slip(P, "5*2=0\n0-7=3\n3+3=6\nanswer: 6") == "read"


def test_shares_cover_every_completion_in_slips_order():
    shares = slip_shares([P, P], [["5*4=0\n0-7=3\n3+3=6\nanswer: 6", ""], ["5*4=0\n0-7=7\n7+3=0\nanswer: 0", ""]])
    assert list(shares) == list(SLIPS)
    assert shares["none"] == 0.25 and shares["no_answer"] == 0.5 and shares["arithmetic"] == 0.25
    assert abs(sum(shares.values()) - 1.0) < 1e-12
    assert slip_shares([], []) == {}
    with pytest.raises(ValueError):
        slip_shares([P], [])  # one list of completions per problem


def test_a_problem_without_a_derivation_is_refused():
    from tlt.task import Problem

    with pytest.raises(ValueError, match="not a synthetic-task solution"):
        reference_steps(Problem("q", "1", 1, "no lines here"))
