"""Output text from token ids: incrementally, in a short window, with the prompt's last tokens as context.

    context = the prompt's last CONTEXT_TOKENS ids          (never part of the returned text)
    push(new ids) -> decode(ids[prefix:]) minus decode(ids[prefix:read])   (the new, stable text)

Two reasons, both as vLLM's detokenizer does it:

- Cost: the stop-string check decoded the whole output at every token (quadratic: ~1 ms a token per sequence
  at 4k tokens, 70 ms of CPU a step at batch 64 on the engine's loop). The window makes each token's decode
  independent of the length.
- Correctness: SentencePiece tokenizers (Llama 2, Mistral, TinyLlama) decode with `Strip(" ", 1, 0)`, which drops
  the first token's leading space, so an output decoded on its own lost the space the model wrote (`"▁Observation"`
  -> "Observation"): a stop string " Observation:" at the start of the output was never found, and prompt +
  completion lost a space. With the prompt's last tokens before it, the strip falls on the context.

Text is taken only when it does not end in U+FFFD (half of a multi-byte character the next token completes) and
is longer than what the window decoded before; `flush` takes what is still held at the end of the stream.

Windows decode without transformers' `clean_up_tokenization_spaces` (" 's" -> "'s", " ." -> "."), which rewrites
text already decoded when the next token comes (" it '" then "s": " it's"): the window's earlier text was then no
prefix of the new, and the text stopped growing for good. `text` is the raw text; `clean` applies the tokenizer's
cleanup, as one `decode` would, to whatever reads it (the stop check, the stream, the completion), and its last
`CLEANUP_HOLDBACK` characters may still change when more text comes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded before the output (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
MAX_CONTEXT_TOKENS = 32  # past trailing special tokens, at most this many
CLEANUP_HOLDBACK = 5  # cleaned characters later text may still rewrite (the longest pattern: " n't", " 've")


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def cleans_up(tokenizer: Any) -> bool:
    """Whether the tokenizer's `decode` cleans up spaces by default (older tokenizers; Qwen, Llama, Mistral: no).
    As transformers 5 decides it: a BPE model's cleanup is skipped (it would corrupt BPE text) unless forced."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    force = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if force is None or backend is None:  # a transformers without the BPE exception, or a slow tokenizer
        return True
    return bool(force) or type(backend.model).__name__ != "BPE"


def clean(tokenizer: Any, text: str) -> str:
    """`text` as the tokenizer's own `decode` would return it (its space cleanup, where it has one)."""
    return tokenizer.clean_up_tokenization(text) if cleans_up(tokenizer) else text


def _context(tokenizer: Any, prompt: Sequence[int]) -> list[int]:
    """The prompt's last tokens to decode the output after: at least CONTEXT_TOKENS, more while they decode to no
    text (special tokens, which the decode skips: the strip would fall on the output again), starting on a
    character's first byte (a byte-fallback run cut inside a character decodes to U+FFFD throughout, whole
    characters after it too). None when the prompt ends inside a character (its U+FFFD would take the output's
    first bytes: the output's text is then its own, as the engine always had it)."""
    start = max(0, len(prompt) - CONTEXT_TOKENS)
    while start > 0 and len(prompt) - start < MAX_CONTEXT_TOKENS and not _decode(tokenizer, prompt[start:]):
        start -= 1
    for _ in range(3):  # a UTF-8 character has at most 3 continuation bytes
        if start > 0 and _decode(tokenizer, prompt[start:]).startswith("\ufffd"):
            start -= 1
    context = list(prompt[start:])
    text = _decode(tokenizer, context)
    return [] if text.endswith("\ufffd") else context


def continuation_text(tokenizer: Any, prompt: Sequence[int], output: Sequence[int]) -> str:
    """The text `output` adds after `prompt` (one decode), cleaned as the tokenizer's `decode` cleans. Where the
    context's text is not a prefix of the whole's, the output on its own."""
    context = _context(tokenizer, prompt)
    if not context:
        return clean(tokenizer, _decode(tokenizer, output))
    before, whole = _decode(tokenizer, context), _decode(tokenizer, [*context, *output])
    return clean(tokenizer, whole[len(before):] if whole.startswith(before) else _decode(tokenizer, output))


class IncrementalText:
    """The text of a growing output, `text` (stable characters only), fed token by token or step by step."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.cleanup = cleans_up(tokenizer)  # decided once: `cleaned` is read at every token
        self.ids: list[int] = _context(tokenizer, prompt)
        self.context_len = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    @property
    def fed(self) -> int:
        """Output tokens pushed so far."""
        return len(self.ids) - self.context_len

    def cleaned(self) -> str:
        """`text` as the tokenizer's `decode` returns it (its space cleanup, where it has one: then the last
        CLEANUP_HOLDBACK characters may still change)."""
        return self.tokenizer.clean_up_tokenization(self.text) if self.cleanup else self.text

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; the text they made stable ("" while a character or a merge is still open)."""
        self.ids.extend(new_ids)
        before = _decode(self.tokenizer, self.ids[self.prefix_offset:self.read_offset])
        after = _decode(self.tokenizer, self.ids[self.prefix_offset:])
        # By length, as vLLM: where `after` does not extend `before` (a stray byte after a byte-fallback character
        # turns the whole run into U+FFFD), a prefix check froze the text for good; this goes on past it.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before):]
            self.text += new
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """The end of the stream: the text still held (a U+FFFD that nothing completed stays one)."""
        if self.read_offset == len(self.ids):
            return ""
        before = _decode(self.tokenizer, self.ids[self.prefix_offset:self.read_offset])
        after = _decode(self.tokenizer, self.ids[self.prefix_offset:])
        new = after[len(before):]
        self.text += new
        self.prefix_offset = self.read_offset = len(self.ids)
        return new
