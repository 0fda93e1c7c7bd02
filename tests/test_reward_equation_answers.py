r"""An answer written as an equation (`x = 5`) against the math verifier (services/reward/boxed.py).

The leading `x =` was dropped from both sides, so `\boxed{y=5}` scored 1 against the reference `x=5`: a wrong
variable was rewarded. The rule now is math-verify's (its `sympy_expr_eq`): the left side is dropped only when
the other answer is a bare value (`x=5` against 5, either way round); two equations compare whole, so the
variable must match. MATH's `strip_string` (and graders copied from it) drop it from both sides; that is the
leak this closes. Pure functions: nothing to fake.
"""

from __future__ import annotations

import pytest

from tlt.services.reward.boxed import equivalent, normalize
from tlt.services.reward.verifiers import math_verifier


@pytest.mark.parametrize("completion, reference, right", [
    (r"\boxed{y=5}", "x=5", False),  # the wrong variable
    (r"\boxed{y = 5}", "x = 5", False),
    (r"\boxed{x_2=5}", "x_1=5", False),
    (r"\boxed{x_{2}=5}", "x_{1}=5", False),
    (r"\boxed{x=5}", "x=5", True),
    (r"\boxed{x = \frac{1}{2}}", "x=0.5", True),  # same variable, same rational value
    (r"\boxed{x_{1}=5}", "x_1=5", True),
    (r"\boxed{x=5}", "5", True),  # an equation against a bare value: its right side is the answer
    (r"\boxed{5}", "x=5", True),
    (r"\boxed{y=5}", "5", True),
    (r"\boxed{x=6}", "x=5", False),
    (r"\boxed{x=5}", "y=6", False),
])
def test_an_equation_answer_needs_the_right_variable(completion, reference, right) -> None:
    assert math_verifier("", completion, reference) is right


def test_the_bare_value_is_still_the_normal_form() -> None:
    assert normalize(r"$x = 1,234$") == "1234"
    assert equivalent("X=5", "x=5")  # letters compare without case, as everywhere in this module
    assert not equivalent("y=5", "x=5") and not equivalent("x=5", "y=5")
