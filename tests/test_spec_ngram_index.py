"""NgramSource's per-request index against the sequences' own tokens: every token of a prompt is indexed, the
first included, and a sibling that finishes has its last step's tokens indexed as it is released, so the
siblings still running draft from its whole text. Real Sequences and NgramSource; no engine needed."""

from __future__ import annotations

from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.spec.drafting import NgramSource
from tlt.services.rollout.spec.tree import Arm
from tlt.services.rollout.types import SamplingParams

CHAIN = Arm(3, 1, 4)  # depth 3, topk 1: a chain of up to 3 drafts after the root


def seq(prompt, k=0, rid="r"):
    return Sequence(rid, k, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=8), 8, 0, frozenset())


def drafts(src: NgramSource, s: Sequence) -> list[int]:
    tree, counts = src.draft([s], CHAIN)
    return tree.tokens[0, : int(counts[0])].tolist()


def test_the_prompts_first_token_is_indexed():
    # the last token 7 occurred only as the first: its continuation 1 2 3 is the draft
    assert drafts(NgramSource(1, 3), seq((7, 1, 2, 3, 7))) == [7, 1, 2, 3]
    # the same through a sibling: sibling 1 ends in 4, which only sibling 0's first token was
    src = NgramSource(1, 3)
    src.catch_up([seq((4, 5, 6))])
    assert drafts(src, seq((9, 4), k=1)) == [4, 5, 6]


def test_tokens_appended_between_drafts_are_indexed_once_each():
    src, s = NgramSource(1, 3), seq((5, 6))
    for t in (1, 2, 3, 4):  # decoded a token at a time, drafted before each
        drafts(src, s)
        s.token_ids.append(t)
    s.token_ids.append(1)
    assert drafts(src, s) == [1, 2, 3, 4]
    assert src.groups["r"].seqs[0] == s.token_ids  # the index holds the sequence's text, no token lost or doubled


def test_a_released_siblings_last_tokens_are_drafted_from():
    src = NgramSource(1, 3)
    a, b = seq((5, 6), 0), seq((5, 6), 1)
    src.draft([a, b], CHAIN)
    a.token_ids += [7, 8, 9]  # a's last step emitted 7 8 9 and it finished: never drafted again
    src.release(a)
    b.token_ids += [7]
    assert drafts(src, b) == [7, 8, 9]


def test_releasing_a_forgotten_request_does_not_index_it_again():
    src = NgramSource(1, 3)
    a = seq((5, 6))
    src.catch_up([a])
    src.forget("r")
    src.release(a)  # an abort after the request was forgotten
    assert "r" not in src.groups
