"""The synthetic long-tail reasoning task: seeded multi-step modular arithmetic.

A problem starts from a digit and applies k operations (+b, -b with b in
1..9, *d with d in 2..9), all modulo 10. The reference solution writes one
line per step, then an answer marker:

    question: "Compute mod 10: 2 +7 *3 -5"
    solution: "2+7=9\\n9*3=7\\n7-5=2\\nanswer: 2"

Why this task: the answer is checked exactly (`tlt.task.verify`), each step is
learnable by a tiny model (a 260-entry table plus finding the
next operation in the prompt), and difficulty grows with length (every step is one
more chance to slip), so a few CPU minutes of pre-training leave accuracy in
the middle: short problems mostly solved, long ones mostly failed. The number
of steps k follows a truncated zipf law P(k) ~ k^-1.5 on 1..32 (median 2,
p99 about 29), so response length is heavy-tailed: p99/p50 of the response
token length is about 10 on the reference solutions.

The model sees the question as a ChatML user turn (`format_prompt`), the same
text the tokenizer's chat template produces, and answers in the assistant turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache
from itertools import accumulate

MODULUS = 10
MAX_STEPS = 32
ZIPF_ALPHA = 1.5
ADD_RANGE = (1, 9)
MUL_RANGE = (2, 9)
QUESTION_PREFIX = "Compute mod 10:"
ANSWER_MARKER = "answer:"


@dataclass(frozen=True)
class Problem:
    """One problem: the question text (the user turn), its answer, its step count and reference solution."""

    prompt: str
    answer: str
    steps: int
    solution: str


def num(x: int) -> str:
    """Numbers are single digits (the value modulo 10)."""
    return str(x % MODULUS)


@cache
def _step_cdf(max_steps: int = MAX_STEPS, alpha: float = ZIPF_ALPHA) -> tuple[float, ...]:
    weights = [k ** -alpha for k in range(1, max_steps + 1)]
    total = sum(weights)
    return tuple(w / total for w in accumulate(weights))


def step_probabilities(max_steps: int = MAX_STEPS, alpha: float = ZIPF_ALPHA) -> list[float]:
    """P(k) for k = 1..max_steps (truncated zipf): the heavy tail of the response length."""
    cdf = _step_cdf(max_steps, alpha)
    return [c - p for c, p in zip(cdf, (0.0, *cdf[:-1]))]


def sample_steps(rng: random.Random, max_steps: int = MAX_STEPS) -> int:
    """Draw k from the truncated zipf law by inverting its CDF."""
    u = rng.random()
    for k, c in enumerate(_step_cdf(max_steps), start=1):
        if u <= c:
            return k
    return max_steps


def _sample_op(rng: random.Random) -> tuple[str, int]:
    op = rng.choice("+-*")
    lo, hi = MUL_RANGE if op == "*" else ADD_RANGE
    return op, rng.randint(lo, hi)


def apply_op(value: int, op: str, operand: int) -> int:
    if op == "+":
        return (value + operand) % MODULUS
    if op == "-":
        return (value - operand) % MODULUS
    if op == "*":
        return (value * operand) % MODULUS
    raise ValueError(f"unknown operation {op!r}")


def make_problem(start: int, ops: list[tuple[str, int]]) -> Problem:
    """Build the question, the step-by-step solution and the answer for given operations."""
    if not ops:
        raise ValueError("a problem needs at least one operation")
    question = " ".join([QUESTION_PREFIX, num(start), *(f"{op}{b}" for op, b in ops)])
    lines, value = [], start % MODULUS
    for op, b in ops:
        nxt = apply_op(value, op, b)
        lines.append(f"{num(value)}{op}{b}={num(nxt)}")
        value = nxt
    lines.append(f"{ANSWER_MARKER} {num(value)}")
    return Problem(prompt=question, answer=num(value), steps=len(ops), solution="\n".join(lines))


def generate_problems(n: int, seed: int, max_steps: int = MAX_STEPS) -> list[Problem]:
    """n problems, a pure function of (n, seed): the first m of n are the same as generate_problems(m, seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = sample_steps(rng, max_steps)
        start = rng.randrange(MODULUS)
        out.append(make_problem(start, [_sample_op(rng) for _ in range(k)]))
    return out


def format_chat(question: str) -> str:
    """The ChatML text of a single user turn plus the assistant header (= the chat template's output)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def format_prompt(problem: Problem) -> str:
    """The raw text prompt fed to the model for completion-style rollouts (ChatML user turn + assistant header)."""
    return format_chat(problem.prompt)
