"""Prompt text to token ids at the front, bounded, off the event loop (HTTP and gRPC alike).

The front's one event loop serves every HTTP stream, /health and the trainer's gRPC calls. Tokenising on it froze
them all: a 1 MB text prompt takes ~5 s on a slow tokenizer, four of them froze /health for 16 s, only for the
prompts to be refused for their length. And tokenising a text of any size cost ~280 bytes of memory a character
(a 12 MB gRPC prompt took the front to 4.3 GB) before its length was checked. So a text is tokenised on a worker
thread, and one that cannot fit the context is refused without tokenising it whole:

- with a tokenizer known to keep every character of its input (`chars_per_token`: byte-level BPE or byte fallback
  with every byte in the vocabulary, no normalizer, pre-tokenizer or added token that drops characters), a text over
  `limit * longest_token * 4` characters cannot fit (no token covers more characters than the vocabulary's longest
  string; x4 for a normaliser that composes up to four code points into one): refused unread;
- over `PROBE_CHARS_PER_TOKEN * limit` characters, that many are tokenised first, and the tokens no text going on
  past the cut can change (`settled_tokens`: those ending a margin before the cut's trailing white space, of words
  ended there; with BPE, also the cut word's) bound the whole text's: `limit` or more and it is refused. The cut is
  anywhere, not at a space: CJK prose, minified code and base64 have none, and a WordPiece tokenizer tokenised
  2,000,000 CJK characters whole (6 s, 1.2 GB) to refuse them. A tokenizer not known to keep every character
  gets a probe that grows (x4) until it decides or reaches the text's end, then the text is tokenised whole: one
  that drops or fuses input (WordPiece's [UNK] for a long word and dropped white space, a BPE's fused <unk>
  without byte fallback, a normaliser collapsing spaces, an added token taking the spaces beside it) makes a few
  tokens of `"hi" + " " * 5000 + "hi"`, which the unread bound refused at a context of 64. A slow tokenizer (no
  offsets) is probed up to a space or newline, its prefix counted whole.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any, Callable, TypeVar

T = TypeVar("T")

PROBE_CHARS_PER_TOKEN = 8  # real text runs 1-5 characters a token; a probe this long decides almost every refusal
PROBE_MARGIN = 16  # characters before a probe's cut whose tokens the text after it may change (settled_tokens)


class PromptTooLong(ValueError):
    """A text prompt of `tokens` tokens or more (a lower bound) where the context holds fewer than `limit`."""

    def __init__(self, tokens: int, limit: int, chars: int) -> None:
        super().__init__(f"has at least {tokens} tokens ({chars} characters); the context length is {limit}")
        self.tokens, self.limit = tokens, limit


class RequestThreads:
    """The threads requests' own work runs on, off the event loop: tokenising prompts, building responses.

    Not asyncio's default executor: that one also assembles weight pushes and restarts replicas, and a burst of slow
    prompts (a 1 MB text takes seconds) queued a trainer's push behind every one of them. As many threads as the
    default executor would have (cores + 4, at most 32), so requests are served as before."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or min(32, (os.cpu_count() or 1) + 4)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tlt-request")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`await asyncio.to_thread(fn, *args)` on these threads (the caller's context variables go along)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer: Any) -> int:
    """The longest string of the vocabulary (added tokens included): the most characters one token covers."""
    try:
        return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary to list (transformers' base class raises
        return 0  # NotImplementedError; remote-code ones may raise anything): no bound from it, as before


MERGE_SLACK = 4  # NFC / NFKC compose at most four code points into one (a Greek vowel with three marks)

# normalizers and pre-tokenizers that never drop a character nor merge more than MERGE_SLACK into one
_KEEPING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "ByteLevel", "Sequence", "Replace"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts", "Sequence"}


def _parts(spec: dict | None, key: str) -> list[dict]:
    """`spec` and, for a Sequence, its members (nested), as the tokenizer.json lists them."""
    if spec is None:
        return []
    return [spec, *(p for member in spec.get(key) or [] for p in _parts(member, key))]


def keeps_every_character(tokenizer: Any) -> bool:
    """Whether every character of a text is in some token, so a token covers at most its own string's characters
    (MERGE_SLACK x with a composing normaliser). Read from a fast tokenizer's tokenizer.json; False for any other
    or anything unrecognised: such a tokenizer gets no unread bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a slow or remote-code tokenizer: nothing to read, nothing known
        return False
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    normal = _parts(spec.get("normalizer"), "normalizers")
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    if any(n.get("type") not in _KEEPING_NORMALIZERS for n in normal) or any(
            n.get("type") == "Replace" and not _widening(n) for n in normal):
        return False  # BertNormalizer, Strip, StripAccents, Precompiled (collapses spaces), a regex Replace
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return False  # Whitespace, WhitespaceSplit, BertPreTokenizer drop white space
    if any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or []):
        return False  # RoBERTa's <mask>: takes any run of spaces beside it
    if model.get("type") not in ("BPE", "Unigram") or not vocab:
        return False  # WordPiece, WordLevel: an [UNK] for a whole word
    pieces = {p[0] for p in vocab} if isinstance(vocab, list) else set(vocab)  # Unigram: [piece, score] pairs
    if model.get("byte_fallback"):
        return all(f"<0x{b:02X}>" in pieces for b in range(256))
    if model.get("type") == "BPE" and any(p.get("type") == "ByteLevel" for p in pre):
        from tokenizers import pre_tokenizers

        return set(pre_tokenizers.ByteLevel.alphabet()) <= pieces  # else a missing byte is dropped, or <unk>
    return False  # an unknown character is <unk> (fused with its neighbours), or dropped


def _widening(replace: dict) -> bool:
    """A Replace of a fixed string by one no shorter (Metaspace-style ' ' -> '▁'): it removes no character."""
    pattern = (replace.get("pattern") or {}).get("String")
    return pattern is not None and 0 < len(pattern) <= len(replace.get("content") or "")


def chars_per_token(tokenizer: Any) -> int:
    """The most characters one token can cover, or 0 when the tokenizer is not known to keep every character."""
    longest = longest_token_chars(tokenizer)
    return longest * MERGE_SLACK if longest and keeps_every_character(tokenizer) else 0


def encode_bounded(tokenizer: Any, text: str, limit: int, token_chars: int, add_special_tokens: bool = True
                   ) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, or PromptTooLong when `limit` tokens (the
    context length) cannot hold it, decided without tokenising a long text whole where a prefix decides.
    `token_chars`: `chars_per_token` (0: no unread bound). Blocking: run it on a thread."""
    if token_chars and len(text) > limit * token_chars:
        raise PromptTooLong(len(text) // token_chars, limit, len(text))
    window, last = PROBE_CHARS_PER_TOKEN * limit, 0
    while len(text) > window:
        head = settled_tokens(tokenizer, text[:window], add_special_tokens)
        if head is None:  # no offsets to read (a slow tokenizer): the prefix up to white space, counted whole
            cut, head = max(text.rfind(" ", 0, window), text.rfind("\n", 0, window)), 0
            if cut > last:
                head, last = len(tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens)), cut
        if head >= limit:
            raise PromptTooLong(head, limit, len(text))
        if token_chars:  # known to keep every character: the text is at most limit * token_chars long, one probe
            break
        window *= 4  # a tokenizer that may drop input: a longer prefix may still decide
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def settled_tokens(tokenizer: Any, head: str, add_special_tokens: bool = True) -> int | None:
    """How many tokens of `head`, a prefix cut anywhere, any text that starts with it has too (a lower bound on
    that text's length), or None for a tokenizer whose encoding has no words and offsets (a slow one).

    Counted: the tokens that end PROBE_MARGIN characters before `head`'s trailing white space (an added token with
    lstrip takes a whole run of it; a normaliser composes or collapses characters across the cut), of a word (a
    pre-token) ended there. A model splits each word on its own, but the word at the cut may go on past it: its
    tokens count with BPE, whose merges are local (a fused <unk> reaching the cut ends past it; an assumption: a
    vocabulary whose merges chain over more than PROBE_MARGIN characters, a+z, a+az, a+aaz, ..., made up for a
    review, can have a prompt that fits refused; no real one tried, byte-level or SentencePiece, did), and not with
    WordPiece (a word over max_input_chars_per_word, or one with a piece it lacks, is one [UNK] whole) or Unigram
    (the best split of the whole word may be another)."""
    try:  # the model first: a slow tokenizer has none, and is not made to tokenise the probe for nothing
        by_token = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
        enc = tokenizer(head, add_special_tokens=add_special_tokens).encodings[0]
        words, ends = enc.word_ids, [end for _, end in enc.offsets]
    except Exception:  # noqa: BLE001 - a slow or remote-code tokenizer: no words, no offsets
        return None
    settled = max(0, len(head.rstrip()) - PROBE_MARGIN)
    if by_token:
        return sum(1 for end in ends if end <= settled)
    word_end: dict[int, int] = {}
    for word, end in zip(words, ends):
        if word is not None:
            word_end[word] = max(word_end.get(word, 0), end)
    cut_word = max(word_end, default=None)
    return sum(1 for word, end in zip(words, ends)
               if (end if word is None else word_end[word]) <= settled and (word is None or word != cut_word))


class PromptEncoder:
    """`encode_bounded` with `chars_per_token` looked up once (on first use: on a worker thread)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @cached_property
    def token_chars(self) -> int:
        return chars_per_token(self.tokenizer)

    def encode(self, text: str, limit: int, add_special_tokens: bool = True) -> list[int]:
        return encode_bounded(self.tokenizer, text, limit, self.token_chars, add_special_tokens)


def bad_stop_ids(stop_token_ids: tuple[int, ...], vocab: int) -> str | None:
    """Why `stop_token_ids` cannot be used with a vocabulary of `vocab` ids; None when they can. Once a request,
    not once a prompt (2,000 prompts x 200,000 ids froze the front for 50 s)."""
    if any(t >= vocab for t in stop_token_ids):
        return f"stop_token_ids holds ids outside the vocabulary [0, {vocab})"
    return None


def kv_problem(prompt_tokens: int, max_tokens: int | None, context: int, kv_tokens: int, where: str,
               max_tokens_name: str) -> str | None:
    """Why a sequence of `prompt_tokens` + `max_tokens` (unset: the rest of the `context`) cannot fit a replica's KV
    cache of `kv_tokens` tokens a sequence (0: unknown); None when it fits. The replica refuses it too, but only
    once a streamed response has started: the client got 200 and an error event."""
    total = prompt_tokens + (max_tokens if max_tokens is not None else context - prompt_tokens)
    if not kv_tokens or total <= kv_tokens:
        return None
    given = f"{max_tokens_name}={max_tokens}" if max_tokens is not None else (
        f"the default {max_tokens_name} (the rest of the context, {context - prompt_tokens})")
    room = kv_tokens - prompt_tokens
    fix = f"give {max_tokens_name} <= {room}" if room > 0 else "shorten the prompt"
    return (f"{where} ({prompt_tokens} tokens) + {given} does not fit in the KV cache, which holds {kv_tokens} "
            f"tokens a sequence; {fix}, or raise engine.kv_cache_mb / num_kv_blocks")
