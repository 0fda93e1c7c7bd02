"""Prompt text to token ids at the front, bounded, off the event loop (HTTP and gRPC alike).

The front's one event loop serves every HTTP stream, /health and the trainer's gRPC calls. Tokenising on it froze
them all: a 1 MB text prompt takes ~5 s on a slow tokenizer, four of them froze /health for 16 s, only for the
prompts to be refused for their length. And tokenising a text of any size cost ~280 bytes of memory a character
(a 12 MB gRPC prompt took the front to 4.3 GB) before its length was checked. So a text is tokenised on a worker
thread, and one that cannot fit the context is refused without tokenising it whole:

- over `limit * longest_token * 2` characters it cannot fit (no token covers more characters than the vocabulary's
  longest token string; x2 for normalisers that merge characters): refused unread;
- over `PROBE_CHARS_PER_TOKEN * limit` characters, the text up to a whitespace there is tokenised first; a
  pre-tokenizer splits at whitespace, so those tokens are the whole text's first ones, and if they are already
  `limit` or more the text is refused.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any, Callable, TypeVar

T = TypeVar("T")

PROBE_CHARS_PER_TOKEN = 8  # real text runs 1-5 characters a token; a probe this long decides almost every refusal


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


def encode_bounded(tokenizer: Any, text: str, limit: int, token_chars: int, add_special_tokens: bool = True
                   ) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`, or PromptTooLong when `limit` tokens (the
    context length) cannot hold it, decided without tokenising a long text whole. Blocking: run it on a thread."""
    if token_chars and len(text) > limit * token_chars * 2:
        raise PromptTooLong(len(text) // (token_chars * 2), limit, len(text))
    probe = PROBE_CHARS_PER_TOKEN * limit
    if len(text) > probe:
        cut = max(text.rfind(" ", 0, probe), text.rfind("\n", 0, probe))
        if cut > 0:
            head = len(tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens))
            if head >= limit:
                raise PromptTooLong(head, limit, len(text))
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=add_special_tokens)]


class PromptEncoder:
    """`encode_bounded` with the tokenizer's longest token looked up once (on first use: on a worker thread)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @cached_property
    def token_chars(self) -> int:
        return longest_token_chars(self.tokenizer)

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
