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

Held back, so that `text` only grows and is always a prefix of one decode of the whole output:

- a trailing U+FFFD (half of a multi-byte character the next token may complete; byte-level BPE): the text
  before it is taken at once, so a stop string that ends inside a token which also opens the next character is
  found at that token, not once the character is whole;
- a trailing run of byte pieces (`<0x..>`, byte-fallback tokenizers: Llama 2, Mistral, TinyLlama): Hugging Face's
  ByteFallback decoder decodes a run whole, as UTF-8 when it is valid and else as one U+FFFD a piece, so the
  "日" three pieces made turns into "����" when a stray byte follows. The run is taken when a piece of text ends
  it (or the stream does). Meanwhile `held` is its text if the output ended here (whole characters only): the
  stop check searches it, since a stop string found there ends the output there. The run is followed
  incrementally (`_Run`): however long it grows, no token decodes more than the window.

`flush` takes what is still held at the end of the stream.

Windows decode without transformers' `clean_up_tokenization_spaces` (" 's" -> "'s", " ." -> "."), which rewrites
text already decoded when the next token comes (" it '" then "s": " it's"): the window's earlier text was then no
prefix of the new, and the text stopped growing for good. `text` is the raw text; `clean` applies the tokenizer's
cleanup, as one `decode` would, to whatever reads it (the stop check, the stream, the completion), and its last
`CLEANUP_HOLDBACK` characters may still change when more text comes.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded before the output (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
MAX_CONTEXT_TOKENS = 32  # past trailing special tokens, at most this many
CLEANUP_HOLDBACK = 5  # cleaned characters later text may still rewrite (the longest pattern: " n't", " 've")


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


_PIECES: weakref.WeakKeyDictionary[Any, tuple[dict[int, int], frozenset[int]]] = weakref.WeakKeyDictionary()


def _find_byte_pieces(tokenizer: Any) -> tuple[dict[int, int], frozenset[int]]:
    special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
    convert, unk = getattr(tokenizer, "convert_tokens_to_ids", None), getattr(tokenizer, "unk_token_id", None)
    if convert is None:
        return {}, special
    ids = convert([f"<0x{b:02X}>" for b in range(256)])
    pieces = {i: b for b, i in enumerate(ids) if i is not None and i != unk and i not in special}
    if not pieces:
        return {}, special
    i, b = next(iter(pieces.items()))  # decoded as a byte (U+FFFD alone when it opens a character), not as "<0x..>"
    return (pieces if _decode(tokenizer, [i]) == (chr(b) if b < 0x80 else "\ufffd") else {}), special


def byte_pieces(tokenizer: Any) -> tuple[dict[int, int], frozenset[int]]:
    """A byte-fallback tokenizer's byte pieces (`<0xE6>` id -> 0xE6; {} for any other tokenizer) and its special
    ids, once per tokenizer (one that takes no weak reference: every time)."""
    try:
        if (found := _PIECES.get(tokenizer)) is None:
            found = _PIECES[tokenizer] = _find_byte_pieces(tokenizer)
        return found
    except TypeError:
        return _find_byte_pieces(tokenizer)


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
    characters after it too), and ending before a byte-fallback run (the output's first byte pieces would join it:
    one run, decoded whole). None when the prompt ends inside a character (its U+FFFD would take the output's
    first bytes: the output's text is then its own, as the engine always had it)."""
    pieces, special = byte_pieces(tokenizer)
    end = len(prompt)
    while pieces and end > 0 and (prompt[end - 1] in pieces or prompt[end - 1] in special):
        end -= 1
    start = max(0, end - CONTEXT_TOKENS)
    while start > 0 and end - start < MAX_CONTEXT_TOKENS and not _decode(tokenizer, prompt[start:end]):
        start -= 1
    for _ in range(3):  # a UTF-8 character has at most 3 continuation bytes
        if start > 0 and _decode(tokenizer, prompt[start:end]).startswith("\ufffd"):
            start -= 1
    context = list(prompt[start:end])
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


class _Run:
    """A byte-fallback run not ended yet, followed byte by byte: the characters it has made while it is valid
    UTF-8 so far (once invalid it stays invalid: its pieces will be U+FFFD each, whatever follows)."""

    def __init__(self, start: int) -> None:
        self.start = start  # its first token's index in `ids`
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.text = ""
        self.valid = True

    def feed(self, byte: int) -> None:
        if self.valid:
            try:
                self.text += self.decoder.decode(bytes((byte,)))
            except UnicodeDecodeError:
                self.valid = False

    @property
    def whole(self) -> bool:
        """Valid and no character left open: the run's text were the output to end here."""
        return self.valid and not self.decoder.getstate()[0]


class IncrementalText:
    """The text of a growing output, `text` (stable characters only), fed token by token or step by step."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.cleanup = cleans_up(tokenizer)  # decided once: `cleaned` is read at every token
        self.pieces, self.special = byte_pieces(tokenizer)
        self.ids: list[int] = _context(tokenizer, prompt)
        self.context_len = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.read_len = len(_decode(tokenizer, self.ids))  # the window's text up to read_offset
        self.taken = 0  # characters of the window past read_offset already in `text` (before a trailing U+FFFD)
        self.run: _Run | None = None  # the output's trailing byte-fallback run, while nothing has ended it
        self.text = ""

    @property
    def fed(self) -> int:
        """Output tokens pushed so far."""
        return len(self.ids) - self.context_len

    def cleaned(self) -> str:
        """`text` as the tokenizer's `decode` returns it (its space cleanup, where it has one: then the last
        CLEANUP_HOLDBACK characters may still change)."""
        return self.tokenizer.clean_up_tokenization(self.text) if self.cleanup else self.text

    def held(self) -> str:
        """What would follow `text` if the output ended here, and cannot be taken yet: an open byte-fallback
        run's characters, when it is valid so far and ends on a whole character ("" otherwise)."""
        run = self.run
        if run is None or not run.whole or not run.text:
            return ""
        if self.text or self.context_len:
            return run.text
        # nothing before the run: a SentencePiece decoder's strip may take its first space, as one decode would
        return _decode(self.tokenizer, self.ids[self.prefix_offset:])[self.read_len + self.taken:]

    def _track(self, token: int) -> None:
        if token in self.pieces:
            if self.run is None:
                self.run = _Run(len(self.ids) - 1)
            self.run.feed(self.pieces[token])
        elif token not in self.special:  # (a special token the decode skips does not end a run)
            self.run = None

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; the text they made stable ("" while a character, a byte run or a merge is still open)."""
        for t in new_ids:
            self.ids.append(t)
            if self.pieces:
                self._track(t)
        end = len(self.ids) if self.run is None else self.run.start
        if end <= self.read_offset:
            return ""
        after = _decode(self.tokenizer, self.ids[self.prefix_offset:end])
        # By length, as vLLM: where `after` does not extend the window's earlier text, a prefix check froze the
        # text for good; this goes on past it. A trailing U+FFFD may be half a character: the text before it is
        # stable (a UTF-8 decode changes only its last, open character when bytes follow).
        settled = not after.endswith("\ufffd")
        stable = after[self.read_len:len(after) if settled else len(after) - 1]
        new = stable[self.taken:]
        self.text += new
        self.taken += len(new)
        if settled and len(after) > self.read_len:
            self.prefix_offset, self.read_offset = self.read_offset, end
            self.read_len = len(_decode(self.tokenizer, self.ids[self.prefix_offset:self.read_offset]))
            self.taken = 0
        return new

    def flush(self) -> str:
        """The end of the stream: the text still held (a U+FFFD that nothing completed stays one, a byte run
        decodes whole)."""
        if self.read_offset == len(self.ids):
            return ""
        after = _decode(self.tokenizer, self.ids[self.prefix_offset:])
        new = after[self.read_len + self.taken:]
        self.text += new
        self.prefix_offset = self.read_offset = len(self.ids)
        self.read_len = self.taken = 0
        self.run = None
        return new
