r"""Reward kinds: a verifier decides whether a completion is correct against a reference answer.

A `Verifier` is `(prompt, completion, reference) -> bool`; the server turns the
verdict into reward 1.0 (correct) or 0.0. It must be pure and thread-safe: the
server calls it from several worker threads at once. Adding a kind means
adding a function to `KINDS`.

`math`: the answer is the content of the last `\boxed{...}` when the
completion has one (general math); otherwise, for an integer reference, the
integer `tlt.task.verify` reads after the last `answer:` marker (the eval's
reading), and failing that the whole token after the marker (`marked_answer`:
`answer: 7.5` is 7.5, not 7). Integer answers compare as integers (`07`
equals `7`); everything else goes through `boxed.equivalent`'s normalisation.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tlt.services.reward.boxed import equivalent, last_boxed
from tlt.task.problems import ANSWER_MARKER
from tlt.task.verify import extract_answer, same_integer

Verifier = Callable[[str, str, str], bool]


_INT = re.compile(r"-?[0-9]+")  # ASCII digits: str.isdigit() and int() also take other scripts' ('٣' is 3)


def _is_int(text: str) -> bool:
    return _INT.fullmatch(text.strip()) is not None


_MARKED = re.compile(re.escape(ANSWER_MARKER) + r"[ \t]*([^\s<]+)")  # `<`: a special token right after it


def marked_answer(completion: str) -> str | None:
    """The whole token after the last `answer:` marker, sentence punctuation after it dropped, or None.

    Not `tlt.task.extract_answer`'s integer, which reads no number in `answer: 7.5` or `answer: 7,000`."""
    idx = completion.rfind(ANSWER_MARKER)
    m = _MARKED.match(completion, idx) if idx >= 0 else None
    if m is None:
        return None
    token = m.group(1).rstrip(".,;:!?")
    if token.endswith(")") and token.count(")") > token.count("("):  # `(answer: 7)`
        token = token[:-1].rstrip(".,;:!?")
    return token or None


def math_verifier(prompt: str, completion: str, reference: str) -> bool:
    """Exact-answer check: `\\boxed{}` answers for general math, `answer: N` for the synthetic task."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return equivalent(boxed, reference)
    if _is_int(reference) and (number := extract_answer(completion)) is not None:
        # the synthetic task's own reading (tlt.task.verify, which `tlt model eval` and reward = "task" use) of a
        # bare integer answer: `answer: 9?` scored 1 here and 0 there. Still different: a \boxed{} answer (read
        # first here, never there) and what the task reads no number in (`7,000`, `9%`, `$9$`), compared as math
        return same_integer(number, reference)
    answer = marked_answer(completion)
    if answer is None:
        return False
    if _is_int(reference) and _is_int(answer):
        return same_integer(answer, reference)  # not int(): it raises past 4300 digits
    return equivalent(answer, reference)


KINDS: dict[str, Verifier] = {
    "math": math_verifier,
}


def get_verifier(kind: str) -> Verifier:
    if kind not in KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; choose one of {sorted(KINDS)}")
    return KINDS[kind]
