r"""Reward kinds: a verifier decides whether a completion is correct against a reference answer.

A `Verifier` is `(prompt, completion, reference) -> bool`; the server turns the
verdict into reward 1.0 (correct) or 0.0. It must be pure and thread-safe: the
server calls it from several worker threads at once. Adding a kind means
adding a function to `KINDS`.

`math`: the answer is the content of the last `\boxed{...}` when the
completion has one (general math), otherwise the number after the synthetic
task's `answer:` marker (`tlt.task.extract_answer`). Integer answers compare
as integers, exactly like `tlt.task.verify` (`07` equals `7`); everything else
goes through `boxed.equivalent`'s normalisation.
"""

from __future__ import annotations

from collections.abc import Callable

from tlt.services.reward.boxed import equivalent, last_boxed
from tlt.task import extract_answer, verify

Verifier = Callable[[str, str, str], bool]


def _is_int(text: str) -> bool:
    t = text.strip()
    return t.lstrip("-").isdigit() and t.count("-") <= 1


def math_verifier(prompt: str, completion: str, reference: str) -> bool:
    """Exact-answer check: `\\boxed{}` answers for general math, `answer: N` for the synthetic task."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return equivalent(boxed, reference)
    if extract_answer(completion) is None:
        return False
    if _is_int(reference):
        return verify(completion, reference.strip())
    return equivalent(extract_answer(completion) or "", reference)


KINDS: dict[str, Verifier] = {
    "math": math_verifier,
}


def get_verifier(kind: str) -> Verifier:
    if kind not in KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; choose one of {sorted(KINDS)}")
    return KINDS[kind]
