"""Typed messages inside the rollout service (engine <-> replica <-> servers).

    HTTP / gRPC request -> GenerationRequest -> engine Sequences (n per request)
    engine step -> StepOutput (tokens emitted this step, per sequence)
    finished sequence -> CompletionOutput (what the servers return)

The wire formats (OpenAI JSON, `tlt.v1` protobuf) are converted to and from
these at the server edge; nothing inside the engine sees JSON or protobuf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"      # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"    # cancelled or failed


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one sequence. Defaults match the OpenAI API.

    temperature 0 is greedy. top_k <= 0 disables top-k. Filters apply to the
    target distribution in this order: temperature, top_k, top_p, min_p.
    logprobs: None returns none; 0 returns the chosen token's logprob; k > 0
    also returns the top-k alternatives.
    reproducible (native engine): the tokens plain decoding gives this seed, whatever speculative decoding does;
    the request's learned chains are verified by the tree walk, never by rejection sampling
    (`SpecConfig.chain_sampling`), which accepts fewer drafts at temperature > 0 but lets two runs of a seeded
    request pair token by token (the trainer's evals: common random numbers). Greedy requests are reproducible
    anyway; the SGLang backend ignores it (SGLang's own sampling and speculation decide there).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    return_features: bool = False
    reproducible: bool = False

    MAX_LOGPROBS = 20
    MAX_STOP_TOKEN_IDS = 1024
    MIN_TEMPERATURE = 1e-20  # below it (float32) logits / temperature overflow to inf: NaN probabilities
    TOP_K_LIMIT = 2**31  # any k >= the vocabulary means all of it anyway
    SEED_LIMIT = 2**63  # seeds are int64: gRPC's SamplingParams.seed field and the engine's generators

    def validate(self) -> None:
        """Raise ValueError with a message fit for a 400 response."""
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < self.MIN_TEMPERATURE:  # logits / T would overflow float32: NaN probabilities
            raise ValueError(f"temperature must be 0 (greedy) or at least {self.MIN_TEMPERATURE:g}, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not -self.TOP_K_LIMIT <= self.top_k < self.TOP_K_LIMIT:  # it travels as an int64 tensor
            raise ValueError(f"top_k must be below {self.TOP_K_LIMIT} (<= 0: off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -self.SEED_LIMIT <= self.seed < self.SEED_LIMIT):
            raise ValueError(f"seed must be an integer in the int64 range [-2**63, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.min_p, (int, float)) or not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError(f"stop holds at most 16 strings, got {len(self.stop)}")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:  # each is checked per token; the front checks them
            raise ValueError(f"stop_token_ids holds at most {self.MAX_STOP_TOKEN_IDS} ids, "  # all per request
                             f"got {len(self.stop_token_ids)}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {bad[0]!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and n samples of it (a GRPO group when n > 1)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    # Which of the n samples to run; empty: all. The replica pool re-issues the samples that had not finished when
    # a request's replica died (replicas.py): each keeps its index, so its per-sample seed, and completes once.
    sample_indices: tuple[int, ...] = ()

    @property
    def samples(self) -> tuple[int, ...]:
        """The sample indices this request runs: `sample_indices`, or 0..n-1. ValueError unless they are distinct
        indices below n (checked here, for every backend that honours them)."""
        samples = self.sample_indices or tuple(range(self.n))
        if len(set(samples)) != len(samples) or any(not 0 <= i < self.n for i in samples):
            raise ValueError(f"sample_indices must be distinct indices in [0, n={self.n}), got {list(samples)}")
        return samples


@dataclass(frozen=True)
class Versions:
    """Weight versions that produced a token. drafter -1 means no learned drafter."""

    policy: int = 0
    drafter: int = -1
    # Oldest policy version among a completion's tokens when weights were swapped while it
    # was generating (its tokens then came from policy_min .. policy); None = all from `policy`.
    policy_min: int | None = None


@dataclass
class StepOutput:
    """What one engine step emitted for one sequence."""

    request_id: str
    sample_index: int
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    new_top_logprobs: list[dict[int, float]] | None = None  # with logprobs=k > 0: each new token's alternatives


@dataclass
class SpecCounters:
    verify_steps: int = 0
    accepted_tokens: int = 0  # tokens emitted by verify passes, bonus included
    plain_decode_steps: int = 0


@dataclass
class CompletionOutput:
    """A finished sequence."""

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    versions: Versions
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    spec: SpecCounters = field(default_factory=SpecCounters)
    features: object | None = None  # torch.Tensor [len(token_ids), hidden] fp16 when asked
    replica_id: int = 0
    error: str = ""
