"""Sampler: logits of the rows that emit a token -> token ids (+ logprobs).

    greedy rows (temperature 0):  token = argmax(logits); logprob = log_softmax(logits)[token]
    sampled rows:  q = softmax(filter_logits(logits, temperature, top_k, top_p, min_p))
                   token = inverse CDF of q at u(key, t)   (`accept.draw`; t = the token's position)
                   logprob = log q[token]   (the distribution actually sampled from)

`filter_logits` and `draw` are the ones speculative verification uses
(`tlt.services.rollout.spec`), so plain and speculative sampling draw from
exactly the same distribution. The uniform u(key, t) is counter-based
(`spec/rng.py`): a function of the sequence's key and the token's position
only, no generator state. So a seeded sample is reproducible whatever else is
in the batch, across preemption, and whether its steps speculate or not: the
tree walk draws the token at position t with this same uniform.
Top-k alternatives (`logprobs=k`) come from the same log-distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.spec.accept import draw
from tlt.services.rollout.spec.filters import filter_logits
from tlt.services.rollout.spec.rng import PLAIN, counter_uniforms, key_tensor

__all__ = ["SampleResult", "filter_logits", "sample"]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's logprob when the sequence asked for logprobs
    top_logprobs: list[dict[int, float] | None]  # top-k alternatives when logprobs > 0


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """logits: [B, V] (any float dtype), one row per sequence in `seqs`."""
    b = len(seqs)
    logits = logits.float()
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    want_lp = [s.params.logprobs is not None for s in seqs]
    if not sampled:
        tokens = logits.argmax(-1)
        dist = logits
    else:
        dist = logits.clone() if any(want_lp) else logits
        tokens = logits.argmax(-1)
        rows = torch.tensor(sampled)
        ps = [seqs[i].params for i in sampled]
        filtered = filter_logits(
            logits[rows],
            torch.tensor([p.temperature for p in ps]),
            torch.tensor([p.top_k for p in ps]),
            torch.tensor([p.top_p for p in ps]),
            torch.tensor([p.min_p for p in ps]),
        )
        # the token each row appends sits at position num_tokens: its PLAIN counter uniform (on the logits' device)
        keys = key_tensor([seqs[i].rng_key for i in sampled], logits.device)
        u = counter_uniforms(keys, torch.tensor([seqs[i].num_tokens for i in sampled], device=logits.device), PLAIN)
        tokens[rows] = draw(filtered, u)
        if any(want_lp):
            dist[rows] = filtered
    token_list = tokens.tolist()
    logprobs: list[float | None] = [None] * b
    tops: list[dict[int, float] | None] = [None] * b
    if any(want_lp):
        lp = torch.log_softmax(dist, dim=-1)
        idx = [i for i in range(b) if want_lp[i]]
        chosen = lp[torch.tensor(idx), tokens[idx]].tolist()
        for i, v in zip(idx, chosen):
            logprobs[i] = v
            k = seqs[i].params.logprobs or 0
            if k > 0:
                vals, ids = lp[i].topk(k)
                tops[i] = dict(zip(ids.tolist(), vals.tolist()))
    return SampleResult(token_list, logprobs, tops)
