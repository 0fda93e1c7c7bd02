"""Stop conditions checked after each emitted token, in this order:

    stop_token_ids -> eos (unless ignore_eos) -> stop strings -> max_tokens -> context limit

Stop strings are matched on the detokenised output (the checkpoint's HF
tokenizer, incrementally and after the prompt's last tokens: engine/detok.py);
only the tail that could contain a new match is searched. The
completion's text is cut before the stop string (OpenAI semantics); the
token that completed it stays in token_ids (its logprob is part of the rollout).
"""

from __future__ import annotations

from tlt.services.rollout.engine.detok import CLEANUP_HOLDBACK, IncrementalText
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.types import FinishReason


def check_stop(seq: Sequence, token: int, tokenizer, max_model_len: int) -> FinishReason | None:
    if token in seq.stop_ids or token in seq.eos_ids:
        return FinishReason.STOP
    if seq.params.stop and _stop_string(seq, tokenizer):
        return FinishReason.STOP
    if seq.num_output >= seq.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def _stop_string(seq: Sequence, tokenizer) -> bool:
    # incremental (each token's decode independent of the output's length) and after the prompt's last tokens
    # (a SentencePiece decoder strips the first token's space): engine/detok.py
    if seq.detok is None:
        seq.detok = IncrementalText(tokenizer, seq.token_ids[: seq.prompt_len])
    detok = seq.detok
    if not detok.push(seq.token_ids[seq.prompt_len + detok.fed:]):  # (output_ids copies the whole output)
        return False  # no new stable text (half a character): nothing new to search
    text = detok.cleaned()  # matched in the text the completion returns: cleaned, where decode cleans
    # each string from where a match of its own length could end past the text checked (from the longest one's
    # start, one long stop string made every token search the whole output again)
    checked = seq.stop_checked_len
    hits = [p for p in (text.find(s, max(0, checked - len(s) + 1)) for s in seq.params.stop) if p >= 0]
    if hits:
        seq.text = text[: min(hits)]
        return True
    seq.stop_checked_len = max(0, len(text) - CLEANUP_HOLDBACK) if detok.cleanup else len(text)
    return False
