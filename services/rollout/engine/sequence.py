"""Sequence: one sample of one request as the engine tracks it.

A request with n samples becomes n Sequences sharing the prompt. A sequence
owns its token list (prompt + output), how many of those tokens already have
K/V in the cache (`num_computed`), its block table, its 64-bit RNG key
(from (seed, sample_index); an API request of several prompts, one
GenerationRequest each, seeds prompt i's with prompt_seed(seed, i)); the
uniform of the token at position t is a
function of (key, t) alone, `tlt.services.rollout.spec.rng`, so sampling is
reproducible whatever else is in the batch and whether or how a step
speculates) and what it has produced: logprobs, features, versions.

Invariant: `num_computed <= num_tokens`; the scheduler gives a sequence
`num_tokens - num_computed` new tokens to compute (a prefill chunk, or exactly
one when decoding) and a token is sampled when that reaches `num_tokens`.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

from tlt.services.rollout.types import FinishReason, SamplingParams, SpecCounters

if TYPE_CHECKING:  # the servers import prompt_seed from here: their process does not load torch
    import torch

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its KV freed; recomputed on admission)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = (
        "request_id", "sample_index", "params", "token_ids", "prompt_len", "max_tokens", "num_computed",
        "block_table", "status", "arrival", "rng_key", "logprobs", "top_logprobs", "features",
        "policy_versions", "finish_reason", "text", "stop_checked_len", "detok", "eos_ids", "stop_ids",
        "num_preemptions", "spec",
    )

    def __init__(
        self,
        request_id: str,
        sample_index: int,
        prompt: tuple[int, ...],
        params: SamplingParams,
        max_tokens: int,
        seed: int,
        eos_ids: frozenset[int],
    ) -> None:
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.token_ids: list[int] = list(prompt)
        self.prompt_len = len(prompt)
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.arrival = next(_arrival)
        # counter-based sampling key (no generator state: see tlt.services.rollout.spec.rng); None when greedy
        self.rng_key: int | None = None if params.greedy else seed_for(seed, sample_index)
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs else None
        self.features: list[torch.Tensor] | None = [] if params.return_features else None  # [n, H] fp16 chunks, one per step
        self.policy_versions: tuple[int, int] | None = None  # (oldest, newest) over the steps that ran it
        self.finish_reason: FinishReason | None = None
        self.text: str | None = None  # output text cut before the stop string that finished it
        self.stop_checked_len = 0
        self.detok: Any = None  # the output's incremental text (engine/detok.py), made by the first stop-string check
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.stop_ids = frozenset(params.stop_token_ids)
        self.num_preemptions = 0
        self.spec = SpecCounters()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def record_version(self, policy: int) -> None:
        v = self.policy_versions
        self.policy_versions = (policy, policy) if v is None else (min(v[0], policy), max(v[1], policy))

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}#{self.sample_index}, {self.status.value}, tokens={self.num_tokens}, computed={self.num_computed})"


def seed_for(seed: int, sample_index: int) -> int:
    """RNG key (64 bits) of sample `sample_index` of a request seeded with `seed` (stable across runs; a request
    of several prompts seeds each with its own, prompt_seed below, so their samples do not share keys).

    Taken modulo 2**64 for every seed, negative ones included (modulo 2**63 - 1 gave each negative seed
    the stream of some positive one). The multiplier is odd, so for one sample index any two int64 seeds
    (or any two uint64 seeds) get different keys; the samples of one request never share one (7919 is
    odd, and sample indices are far below 2**64 / 7919)."""
    return (seed * 1_000_003 + sample_index * 7919 + 1) % 2**64


_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / the golden ratio, odd


def prompt_seed(seed: int | None, prompt_index: int) -> int | None:
    """The seed prompt `prompt_index` of a seeded request of several prompts (a BatchGenerate, a /v1/completions
    with a list of prompts) samples with; None for an unseeded request (the engine draws one per prompt).

    One seed for all of them gave every prompt the same random numbers (seed_for(seed, i) for its sample i), so
    the prompts' samples were correlated, and the same prompt twice came back twice alike. Prompt 0 keeps `seed`
    itself, so a one-prompt request samples as a Generate with that seed does (and as before); prompt i >= 1 gets
    splitmix64's output i for the state `seed` (a full 64-bit mix), as an int64 like the seeds clients send
    (SamplingParams.SEED_LIMIT). For one prompt index any two seeds get different ones (the mix is a bijection
    of 64 bits). The GenerationRequest carries it, so a replica death's re-dispatch keeps it (replicas.py)."""
    if seed is None or prompt_index == 0:
        return seed
    z = (seed + prompt_index * _GOLDEN) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z  # two's complement: the int64 range [-2**63, 2**63)


def prompt_params(params: Any, prompt_index: int) -> Any:
    """`params` (a SamplingParams) with the seed of prompt `prompt_index` of its request (prompt_seed): what the
    gRPC and HTTP servers give each prompt's GenerationRequest."""
    from dataclasses import replace

    return replace(params, seed=prompt_seed(params.seed, prompt_index))
