"""Offline acceptance length: how far a drafter's greedy chain would get against stored rollouts.

For every start point t of a stored sequence (tokens x_0..x_{n-1}, target features h_0..h_{n-1}),
the engine would have verified x_{t+1} with feature h_t and drafted a chain:

    d_1 = argmax lm_head(D(x_{t+1}, h_t))             h'_{t+1} = D(x_{t+1}, h_t)
    d_k = argmax lm_head(D(d_{k-1}, h'_{t+k-1}))      (the drafter feeds on its own features)

with the drafter's attention over the true pairs (x_{j+1}, h_j), j <= t (its KV cache of verified
tokens) and the chain's own earlier nodes. Greedy acceptance length = 1 + the number of leading
drafts equal to the actual next tokens (d_k == x_{t+k+1}); the 1 is the target's bonus token. A
draft whose actual token lies past the stored sequence is not counted (the chain is truncated).

The score (`mean_accept_length`) walks each sample as a rollout does: a verify step starts where the
previous one ended (t -> t + its accept length), so positions inside an accepted run are never start
points. Averaged over every start point instead, an easy stretch counted once per token of it where
the rollout verifies it once (an audit: 1.519 over every start, 1.369 in the rollout over the same
sequences, 1.386 walked).

`chain_drafts` runs all start points of a sequence at once: one forward of the true pairs into a
KV cache, then one forward per depth over every start point's next node, each node seeing only
its own prefix and ancestors (prefix_mask). `accept_lengths` is the pure scoring rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tlt.model.drafter import Drafter, DrafterCache
from tlt.services.drafter.packing import Sample


def accept_lengths(drafts: torch.Tensor, actual: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """drafts, actual [S, K] token ids, valid [S, K] bool -> [S] = 1 + leading matches among valid drafts."""
    hit = (drafts == actual) & valid
    return 1 + hit.long().cumprod(dim=1).sum(dim=1)


@torch.no_grad()
def chain_drafts(drafter: Drafter, tokens: torch.Tensor, features: torch.Tensor, depth: int,
                 first_start: int = 0, should_stop: Callable[[], bool] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [n], features [n, H] -> (drafts [S, K], actual [S, K], valid [S, K]) for starts first_start..n-3.
    Raises EvaluationInterrupted when `should_stop()` is true before one of its drafter passes."""
    n = int(tokens.shape[0])
    starts = torch.arange(max(first_start, 0), n - 2)
    s = int(starts.numel())
    if s <= 0:
        empty = torch.zeros(0, depth, dtype=torch.long)
        return empty, empty, empty.bool()
    dtype = next(drafter.parameters()).dtype
    device = next(drafter.parameters()).device
    pairs = n - 1
    cache = DrafterCache(drafter.cfg, rows=1, capacity=pairs + s * depth, dtype=dtype, device=device)
    ids = tokens[1:].long().to(device)[None]
    h = drafter(ids, features[:-1].to(device, dtype)[None], torch.arange(1, n, device=device)[None], cache=cache)
    prev_h = h[0, starts.to(device)]  # h'_{t+1} for every start t
    drafts = torch.empty(s, depth, dtype=torch.long)
    key = torch.arange(pairs + s * depth, device=device)
    st = starts.to(device)
    for k in range(1, depth + 1):
        d = drafter.compute_logits(prev_h).argmax(-1)
        drafts[:, k - 1] = d.cpu()
        if k == depth:
            break
        if should_stop is not None and should_stop():  # a depth's pass is ~1/depth of a sample's work
            raise EvaluationInterrupted(f"stopped at depth {k} of a sample")
        p = pairs + s * (k - 1)  # cache length before this depth's nodes
        kk = key[:p]
        true_ok = (kk[None, :] <= st[:, None]) & (kk[None, :] < pairs)
        node = kk - pairs  # index among earlier nodes: depth (node // s) + 1, start index node % s
        own = (kk[None, :] >= pairs) & ((node % s)[None, :] == torch.arange(s, device=device)[:, None])
        prefix = (true_ok | own)[None]
        tree = torch.eye(s, dtype=torch.bool, device=device)[None]
        out = drafter(d[None], prev_h[None], (st + 1 + k)[None], cache=cache, prefix_mask=prefix, tree_mask=tree)
        prev_h = out[0]
    offs = torch.arange(1, depth + 1)
    idx = starts[:, None] + 1 + offs[None, :]  # actual token for draft k of start t: x_{t+k+1}
    valid = idx < n
    actual = tokens.long()[idx.clamp(max=n - 1)]
    return drafts, actual, valid


def walked_lengths(lens: torch.Tensor) -> torch.Tensor:
    """Per-start accept lengths [S] -> those of the steps a rollout takes from start 0: each starts where the
    previous one ended (lengths are >= 1, so the walk always advances)."""
    vals, out, t = lens.tolist(), [], 0
    while t < len(vals):
        out.append(vals[t])
        t += max(int(vals[t]), 1)
    return torch.tensor(out, dtype=torch.long)


class EvaluationInterrupted(Exception):
    """`should_stop` said so between two drafter passes: the evaluation gave its CPU back (see RolloutIdle)."""


def mean_accept_length(drafter: Drafter, samples: Iterable[Sample], depth: int,
                       should_stop: Callable[[], bool] | None = None) -> tuple[float, int]:
    """Mean greedy acceptance length (tokens per verify step) over the steps a rollout would take through the
    response part of each sample (`walked_lengths` from its first response position), and the number of steps.
    Each sample (a window: buffer.windows) is walked on its own from its first start.
    Raises EvaluationInterrupted when `should_stop()` is true before a sample or one of its drafter passes (a sample
    of 256 tokens at depth 6 is tens of ms of CPU on the tiny model: a rollout that started meanwhile waited for it)."""
    total, count = 0.0, 0
    for smp in samples:
        if should_stop is not None and should_stop():
            raise EvaluationInterrupted(f"stopped after {count} verify steps")
        tokens = torch.from_numpy(smp.tokens.astype("int64"))
        feats = torch.from_numpy(smp.features.astype("float32"))
        drafts, actual, valid = chain_drafts(drafter, tokens, feats, depth, first_start=max(smp.response_start - 1, 0),
                                             should_stop=should_stop)
        if drafts.numel():
            lens = walked_lengths(accept_lengths(drafts, actual, valid))
            total += float(lens.sum())
            count += int(lens.numel())
    return (total / count if count else 0.0), count


def same_objects(a: list, b: list) -> bool:
    """The same sample objects in the same order (a cached list keeps them alive, so no id is reused): the held-out
    set a score was computed on (the coordinator's serving score is reused for it)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
