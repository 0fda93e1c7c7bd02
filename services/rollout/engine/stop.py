"""Stop conditions checked after each emitted token, in this order:

    stop_token_ids -> eos (unless ignore_eos) -> stop strings -> max_tokens -> context limit

Stop strings are matched on the detokenised output (the checkpoint's HF
tokenizer, incrementally and after the prompt's last tokens: engine/detok.py);
only the tail that could contain a new match is searched. A stop string is
found at the token that completes it: the text before a trailing half
character is searched at once (a token that ends "👍" and opens the next
emoji), and so are a byte-fallback run's characters as they would read were
the output to end there; at the last token (max_tokens, context limit) the
whole text is. The completion's text is cut before the stop string (OpenAI
semantics); the token that completed it stays in token_ids (its logprob is
part of the rollout) and is the last one. A stop token (stop_token_ids, eos)
likewise stays in token_ids, and its text is left out of the completion's
(engine._completion), plain text or not, as vLLM v1 and SGLang leave it out.
"""

from __future__ import annotations

from tlt.services.rollout.engine.detok import CLEANUP_HOLDBACK, IncrementalText
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.types import FinishReason


def check_stop(seq: Sequence, token: int, tokenizer, max_model_len: int) -> FinishReason | None:
    if token in seq.stop_ids or token in seq.eos_ids:
        return FinishReason.STOP
    last = seq.num_output >= seq.max_tokens or seq.num_tokens >= max_model_len
    if seq.params.stop and _stop_string(seq, tokenizer, last):
        return FinishReason.STOP
    return FinishReason.LENGTH if last else None


def _stop_string(seq: Sequence, tokenizer, last: bool) -> bool:
    # incremental (each token's decode independent of the output's length) and after the prompt's last tokens
    # (a SentencePiece decoder strips the first token's space): engine/detok.py
    if seq.detok is None:
        seq.detok = IncrementalText(tokenizer, seq.token_ids[: seq.prompt_len])
    detok = seq.detok
    new = detok.push(seq.token_ids[seq.prompt_len + detok.fed:])  # (output_ids copies the whole output)
    if last:  # the output ends at this token: what the detokenizer still holds is its text now
        new += detok.flush()
    text = detok.cleaned()  # matched in the text the completion returns: cleaned, where decode cleans
    hits: list[int] = []
    if new:
        # each string from where a match of its own length could end past the text checked (from the longest
        # one's start, one long stop string made every token search the whole output again)
        checked = seq.stop_checked_len
        hits = [p for p in (text.find(s, max(0, checked - len(s) + 1)) for s in seq.params.stop) if p >= 0]
        seq.stop_checked_len = max(0, len(text) - CLEANUP_HOLDBACK) if detok.cleanup else len(text)
    if not hits and (held := detok.held()):
        # a byte-fallback run's characters, which stay only if the output ends here: a stop string in them ends it
        # here (one that ends before them was found above; the run grows, so its search is never longer than it)
        at = max(0, len(text) - max(len(s) for s in seq.params.stop) + 1)
        tail = text[at:] + held
        hits = [at + p for p in (tail.find(s) for s in seq.params.stop) if p >= 0]
        text += held
    if hits:
        seq.text = text[: min(hits)]
        return True
    return False
