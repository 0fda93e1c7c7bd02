"""Exact-answer verification of a model's completion for the synthetic task.

The answer is the integer written after the LAST `answer:` marker in the
completion. It must be followed by the end of the text, whitespace, an
end-of-turn token or sentence punctuation, so `answer: 52`, `answer: 52.` and
`answer: 52<|im_end|>` count but `answer: 52x` or `answer: 52.5` do not.
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
_ANSWER = re.compile(re.escape(ANSWER_MARKER) + r"[ \t]*(-?[0-9]+)(?=$|\s|<|[;!?)]|[.,:](?![0-9]))")


def extract_answer(text: str) -> str | None:
    """The number after the last answer marker, or None when the last marker is not followed by one."""
    idx = text.rfind(ANSWER_MARKER)
    if idx < 0:
        return None
    m = _ANSWER.match(text, idx)
    return m.group(1) if m else None


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


def verify(completion: str, answer: str) -> bool:
    """True iff the completion's extracted answer equals the reference answer exactly (as an integer)."""
    got = extract_answer(completion)
    if got is None:
        return False
    return same_integer(got, str(int(answer)))  # int(): a reference that is not an integer is still an error


def reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """TRL-style reward contract: 1.0 for a verified answer, 0.0 otherwise."""
    if not (len(prompts) == len(completions) == len(answers)):
        raise ValueError(f"lengths differ: {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers")
    return [1.0 if verify(c, a) else 0.0 for c, a in zip(completions, answers)]
