"""Each token's text and bytes as OpenAI's logprobs show them, and where each starts in a choice's text.

    token id -> token_text / token_text_and_bytes      (logprobs' `token`, `bytes`)
    token ids -> TextOffsets.feed -> offsets             (completions' `text_offset`, chat's `bytes`)

A token is read as it reads inside a text (after an anchor token, so a SentencePiece decoder's stripped leading
space is kept); a byte piece of a multi-byte character shows its vocabulary string and carries the byte(s) it
stands for. Offsets count characters as the text decodes the tokens' UTF-8 bytes. Used by openai_convert.py.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tlt.services.rollout.engine.detok import byte_pieces, clean


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's text; a byte piece of a multi-byte character (which decodes to U+FFFD alone)
    is shown by its vocabulary string instead, so different tokens never share a key."""
    return token_text_and_bytes(tokenizer, token_id)[0]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Qwen, Llama 3, ...), reversed: vocabulary character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(rest)}}


BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens
ANCHOR_SCAN = 1000  # the first ids searched for an anchor token (`_Reading`)


@dataclass(frozen=True)
class _Reading:
    """How one tokenizer's tokens are read one by one: each decoded after `anchor`, a plain token whose text
    (`anchor_text`) is then cut off. A SentencePiece decoder (Llama 2, Mistral, TinyLlama) strips the first token's
    leading space, so `▁Paris` decoded alone read "Paris" in a text " Paris"; after the anchor the strip falls on
    it, as engine/detok.py decodes a choice's text after the prompt's last tokens. Special tokens are decoded alone
    (`<|im_end|>`, their display string)."""

    anchor: tuple[int, ...]  # (): none found, tokens are decoded alone
    anchor_text: str
    special: frozenset[int]
    # token id -> (text, bytes, characters) as `_token_read` reads it: fixed per tokenizer, so each token is decoded
    # once per process (a response's logprobs read each token twice: its text and its offset)
    read: dict[int, tuple[str, bytes, int]] = field(default_factory=dict, compare=False)


_READINGS: weakref.WeakKeyDictionary[Any, _Reading] = weakref.WeakKeyDictionary()


def _raw_decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _find_reading(tokenizer: Any) -> _Reading:
    """The first of the first ANCHOR_SCAN ids that is no special token and no byte piece, and decodes alone to
    printable text without spaces around it (a whole character, which no later byte joins)."""
    special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
    for i in range(min(len(tokenizer), ANCHOR_SCAN)):
        if i in special or _BYTE_FALLBACK.fullmatch(tokenizer.convert_ids_to_tokens(i) or ""):
            continue
        text = _raw_decode(tokenizer, [i])
        if text and text.isprintable() and "\ufffd" not in text and text.strip() == text:
            return _Reading((i,), text, special)
    return _Reading((), "", special)


def _reading(tokenizer: Any) -> _Reading:
    """`_find_reading`, once per tokenizer (a tokenizer that takes no weak reference: every time)."""
    try:
        if (found := _READINGS.get(tokenizer)) is None:
            found = _READINGS[tokenizer] = _find_reading(tokenizer)
        return found
    except TypeError:
        return _find_reading(tokenizer)


def _token_alone(tokenizer: Any, token_id: int, reading: _Reading) -> str:
    """The token's text as it reads inside a text (`_Reading`), cleaned up as the choice's text is; where the
    anchor's text is no prefix of the pair's, its decode alone."""
    if reading.anchor and token_id not in reading.special:
        whole = _raw_decode(tokenizer, [*reading.anchor, token_id])
        if whole.startswith(reading.anchor_text):
            return clean(tokenizer, whole[len(reading.anchor_text):])
    return tokenizer.decode([token_id])


def token_text_and_bytes(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    """The token's text (as `token_text`) and its own UTF-8 bytes: OpenAI's `bytes`, which clients join to
    rebuild a character split over several tokens. A byte piece's bytes are the byte(s) its vocabulary string
    stands for (`<0xE4>`, or GPT-2's byte alphabet), not the encoding of that string (which joined gave mojibake)."""
    text, raw, _ = _token_read(_reading(tokenizer), tokenizer, token_id)
    return text, list(raw)


def _token_read(reading: _Reading, tokenizer: Any, token_id: int) -> tuple[str, bytes, int]:
    """The token's text, its bytes (`token_text_and_bytes`) and the characters they decode to where they are whole
    UTF-8 on their own (-1 where they are not: a part of a character, or bytes no character has)."""
    if (known := reading.read.get(token_id)) is None:
        text, raw = _text_and_bytes(tokenizer, token_id, reading)
        try:
            chars = len(bytes(raw).decode())
        except UnicodeDecodeError:
            chars = -1
        known = reading.read[token_id] = (text, bytes(raw), chars)
    return known


def _text_and_bytes(tokenizer: Any, token_id: int, reading: _Reading) -> tuple[str, list[int]]:
    text = _token_alone(tokenizer, token_id, reading)
    if "\ufffd" in text:  # a byte piece shows its vocabulary string; any other token (U+FFFD its own) its text
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return piece, [int(m.group(1), 16)]
        if all(ch in BYTE_LEVEL for ch in piece):
            return piece, [BYTE_LEVEL[ch] for ch in piece]
    return text, list(text.encode())


# lead byte -> (continuation bytes it needs, the bytes its second may be: narrower than 80-BF after E0, ED, F0, F4,
# the Unicode Standard's table 3-7: no overlong form, surrogate or code point past U+10FFFF); C0, C1, F5-FF lead none
_CONTINUATION = range(0x80, 0xC0)
_SECOND = {0xE0: range(0xA0, 0xC0), 0xED: range(0x80, 0xA0), 0xF0: range(0x90, 0xC0), 0xF4: range(0x80, 0x90)}
_LEADS = {b: (1 if b < 0xE0 else 2 if b < 0xF0 else 3, _SECOND.get(b, _CONTINUATION)) for b in range(0xC2, 0xF5)}


class TextOffsets:
    """Where each token starts in the choice's text (the completions API's `text_offset`), in characters, and its
    bytes (the chat API's `bytes`), fed token by token (a stream feeds each chunk's tokens in turn).

    Counted over the tokens' UTF-8 bytes as the text decodes them (tokenizers' `from_utf8_lossy`, Python's
    `decode(errors="replace")`), not over their display strings: a token's offset is where the character its first
    byte belongs to starts. A byte piece of a multi-byte character (`日` is three GPT-2 pieces) adds one character,
    not three, and one that goes on a character (0x97 after 0xE6) points at it; bytes that make no character are
    one U+FFFD per maximal invalid part (the Unicode Standard's practice): 0xE1 then "n" reads U+FFFD, "n" (the
    "n" points past the U+FFFD), 0xF0 0x8C two U+FFFD (0xF0's second byte is 0x90-0xBF), and a character cut off
    at the end one (not CPython's incremental decoder: it holds 0xED 0xA0, no character's start). A special token
    (`<|im_end|>`) adds nothing, as the text is decoded without them; after an open character it waits for the
    next byte, which says whether that character ends before it. A byte-fallback tokenizer's run of `<0x..>`
    pieces decodes whole (engine/detok.py): as its bytes when they are valid UTF-8, else one U+FFFD a piece, whose
    bytes each piece then carries; so a run's tokens are counted when it ends (a piece of text, or `final`), and
    `feed` returns the offsets of the tokens counted so far.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.reading = _reading(tokenizer)
        self.pieces, special = byte_pieces(tokenizer)
        self.special = set(special)
        self.chars = 0  # characters the bytes so far have made (not the open one)
        self.need = 0  # bytes still due to the open character (0: none is open)
        self.next = _CONTINUATION  # the bytes that go on the open character
        self.waiting = 0  # special tokens after the open character, not counted yet
        self.run: list[int] = []  # a byte-fallback run not ended yet
        self.fed = 0  # tokens fed
        self.raw: list[bytes] = []  # each counted token's bytes

    def feed(self, token_ids: list[int], text: str | None = None, final: bool = True) -> list[int]:
        """The offsets of `token_ids` (the next tokens; of those before them that a run or an open character held,
        first; with `final` False, not of those still held at the end); `text` (the whole choice's): clamped to
        its length, for tokens past a stop string that cut it."""
        offsets: list[int] = []
        self.fed += len(token_ids)
        for t in token_ids:
            if t in self.pieces or (self.run and t in self.special):
                self.run.append(t)
                continue
            if self.run:
                self._end_run(offsets)
            self._count(*self._bytes(t), offsets)
        if final:
            if self.run:
                self._end_run(offsets)
            if self.need:  # cut off: the open character is one U+FFFD
                self.chars, self.need = self.chars + 1, 0
            offsets += [self.chars] * self.waiting
            self.waiting = 0
        return offsets if text is None else [min(o, len(text)) for o in offsets]

    def _bytes(self, t: int) -> tuple[bytes, int]:
        return (b"", 0) if t in self.special else _token_read(self.reading, self.tokenizer, t)[1:]

    def _end_run(self, offsets: list[int]) -> None:
        try:
            bytes(self.pieces[t] for t in self.run if t in self.pieces).decode()
            valid = True
        except UnicodeDecodeError:
            valid = False
        for t in self.run:
            self._count(*(self._bytes(t) if valid or t in self.special else ("\ufffd".encode(), 1)), offsets)
        self.run = []

    def _count(self, raw: bytes, whole: int, offsets: list[int]) -> None:
        """Count a token's bytes; `whole`: the characters they make on their own (-1: not whole UTF-8)."""
        self.raw.append(raw)
        chars, need, nxt = self.chars, self.need, self.next
        if need:
            if not raw:
                self.waiting += 1
                return
            if raw[0] not in nxt:  # the open character ends before this token: one U+FFFD
                chars, need = chars + 1, 0
        if self.waiting:
            offsets += [chars] * self.waiting
            self.waiting = 0
        offsets.append(chars)
        if not need and whole >= 0:
            self.chars, self.need = chars + whole, 0
            return
        for b in raw:  # as a UTF-8 decoder reads them: one U+FFFD for each maximal part no character has
            if need:
                if b in nxt:
                    need, nxt = need - 1, _CONTINUATION
                    chars += not need
                    continue
                chars, need = chars + 1, 0
            if (lead := _LEADS.get(b)) is None:
                chars += 1
            else:
                need, nxt = lead
        self.chars, self.need, self.next = chars, need, nxt
