"""The synthetic long-tail reasoning task: seeded problems, exact-answer verifier, JSONL export.

    from tlt.task import generate_problems, format_prompt, verify
    probs = generate_problems(100, seed=0)
    verify(completion_text, probs[0].answer)
"""

from tlt.task.problems import (
    MAX_STEPS,
    Problem,
    format_chat,
    format_prompt,
    generate_problems,
    make_problem,
    step_probabilities,
)
from tlt.task.verify import extract_answer, reward, verify

__all__ = [
    "MAX_STEPS",
    "Problem",
    "extract_answer",
    "format_chat",
    "format_prompt",
    "generate_problems",
    "make_problem",
    "reward",
    "step_probabilities",
    "verify",
]
