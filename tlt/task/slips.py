"""Where a completion of the synthetic task first leaves the reference derivation.

The reference solution is one line `a{op}b=c` per operation, then `answer: c`.
`first_slip` walks a completion's lines against it and names the first
difference, so an eval can say what a model gets wrong, not only how often:

    none          every line right and the answer the last result (a clean derivation)
    carry         a line's left operand is not the running value (the start digit, or the last line's result)
    read          a line's operation or operand is not the question's next one (`5 *4` written `5*7`)
    arithmetic    the line's result is wrong for what it wrote (`7-9=6`)
    early_answer  the answer comes before every operation has a line
    extra_line    a line after the last operation
    answer        the answer is not the last line's result
    format        a line of neither form
    no_answer     the completion ends without an answer line

A completion with a slip can still reach the right answer (mod 10 forgives some
slips), so the share of `none` is at most the accuracy, not equal to it.
"""

from __future__ import annotations

import re

from tlt.task.problems import ANSWER_MARKER, Problem, apply_op
from tlt.task.verify import extract_answer, same_integer

SLIPS = ("none", "carry", "read", "arithmetic", "early_answer", "extra_line", "answer", "format", "no_answer")

_LINE = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)")


def reference_steps(problem: Problem) -> tuple[int, list[tuple[str, int]]]:
    """The start value and the (operation, operand) list of `problem`, read from its reference solution."""
    start, ops = None, []
    for line in problem.solution.split("\n"):
        m = _LINE.fullmatch(line)
        if m:
            start = int(m[1]) if start is None else start
            ops.append((m[2], int(m[3])))
    if start is None:
        raise ValueError(f"not a synthetic-task solution: {problem.solution!r}")
    return start, ops


def first_slip(problem: Problem, completion: str) -> str:
    """The first place `completion` leaves `problem`'s reference derivation: one of SLIPS."""
    return _first_slip(*reference_steps(problem), completion)


def _first_slip(value: int, ops: list[tuple[str, int]], completion: str) -> str:
    lines = [line.strip() for line in completion.split("\n") if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith(ANSWER_MARKER):
            if i < len(ops):
                return "early_answer"
            got = extract_answer(line)  # the verifier's reading of the answer, so `none` implies a verified answer
            return "none" if got is not None and same_integer(got, str(value)) else "answer"
        if i >= len(ops):
            return "extra_line"
        m = _LINE.fullmatch(line)
        if m is None:
            return "format"
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        if a != value:  # checked first: a line that gets both wrong counts as carry
            return "carry"
        if (op, b) != ops[i]:
            return "read"
        if c != apply_op(a, op, b):
            return "arithmetic"
        value = c
    return "no_answer"


def slip_shares(problems: list[Problem], completions: list[list[str]]) -> dict[str, float]:
    """Share of every completion (problem i's are completions[i]) by its first slip, over SLIPS in order."""
    counts = dict.fromkeys(SLIPS, 0)
    for problem, texts in zip(problems, completions, strict=True):
        start, ops = reference_steps(problem)  # once per problem, not per sample
        for text in texts:
            counts[_first_slip(start, ops, text)] += 1
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}
