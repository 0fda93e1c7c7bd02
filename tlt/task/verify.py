"""Exact-answer verification of a model's completion for the synthetic task (the trainer's `reward = "task"`).

It is not a math verifier: `\\boxed{72}` scores 0, and a reference that is not an integer is refused
(the trainer refuses such a data file at start: services/trainer/rewards.py `task_reference_problem`).

The answer is the integer written after the LAST `answer:` marker in the
completion. It must be followed by the end of the text, whitespace, an
end-of-turn token or sentence punctuation, so `answer: 52`, `answer: 52.` and
`answer: 52<|im_end|>` count but `answer: 52x` or `answer: 52.5` do not. A sign is `-`, `+` or the typeset
minus U+2212 (`answer: −7` is -7), as the math verifier reads it.
Values are compared as integers (`answer: 07` equals the reference `7`): the
number is exact, only zero padding may differ.
"""

from __future__ import annotations

import re

from tlt.task.problems import ANSWER_MARKER

# after the digits: the end, white space, a special token, or punctuation that does not continue the number
# (`answer: 7.`, `answer: 7?` and `answer: 7:` are 7; `answer: 7.5`, `answer: 7,000` and `answer: 7:30` are
# not). Digits are ASCII only: `\d` would also take
# other scripts' digits (`answer: ٣`, full-width `３`), which int() parses, so they would score as the number.
# A sign may be `-`, the typeset minus U+2212 or `+`, as the math verifier reads them (boxed.normalize): `answer: −7`
# scored 1 there and 0 here.
_ANSWER = re.compile(re.escape(ANSWER_MARKER) + r"[ \t]*([-+\u2212]?[0-9]+)(?=$|\s|<|[;!?)]|[.,:](?![0-9]))")


def extract_answer(text: str) -> str | None:
    """The number after the last answer marker, or None when the last marker is not followed by one."""
    idx = text.rfind(ANSWER_MARKER)
    if idx < 0:
        return None
    m = _ANSWER.match(text, idx)
    return _ascii_sign(m.group(1)) if m else None


def _ascii_sign(number: str) -> str:
    """`number` with a U+2212 minus as `-` and a leading `+` dropped: `-?[0-9]+`."""
    return number.replace("\u2212", "-").removeprefix("+")


def _canonical_integer(text: str) -> str:
    """`-?[0-9]+` without its zero padding (and `-0` as `0`): the integer's value as a string."""
    s = text.strip()
    digits = s.lstrip("-").lstrip("0") or "0"
    return "-" + digits if s.startswith("-") and digits != "0" else digits


def same_integer(a: str, b: str) -> bool:
    """Integer equality of two `-?[0-9]+` strings, by their canonical strings rather than int().

    int() refuses more than 4300 digits (ValueError), and a policy can write that many after `answer:`;
    the raise failed the step (or, in the reward server, the item) instead of scoring the answer wrong.
    """
    return _canonical_integer(a) == _canonical_integer(b)


def integer_reference(answer: str) -> str | None:
    """The reference as this verifier reads it (int(): ` 007 ` is 7, ` −7` is -7), or None when it is no integer."""
    try:
        return str(int(answer.replace("\u2212", "-")))
    except ValueError:
        return None


NOT_AN_INTEGER = ("reward = 'task' reads only the synthetic task's integer after `answer:`; for your own data "
                  "(\\boxed{} answers, fractions, expressions) use reward = 'grpc' with `tlt reward serve --kind math` "
                  "(the math verifier), or reward = 'python' with your own function")


def verify(completion: str, answer: str) -> bool:
    """True iff the completion's extracted answer equals the reference answer exactly (as an integer).

    A reference that is not an integer is an error whatever the completion wrote (it raised only when the
    completion wrote `answer: <integer>`, so a step failed now and then): this is not a verifier for that data."""
    reference = integer_reference(answer)
    if reference is None:
        raise ValueError(f"reference answer {answer!r} is not an integer: {NOT_AN_INTEGER}")
    got = extract_answer(completion)
    return got is not None and same_integer(got, reference)


def reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """TRL-style reward contract: 1.0 for a verified answer, 0.0 otherwise."""
    if not (len(prompts) == len(completions) == len(answers)):
        raise ValueError(f"lengths differ: {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers")
    return [1.0 if verify(c, a) else 0.0 for c, a in zip(completions, answers)]
