"""Response-token logprobs (and entropy) from lm_head in chunks of tokens: memory O(chunk x V), not O(B x R x V).

    model forward, lm_head given no rows -> h: [B, keep, H] (what lm_head would see)
    -> the real response tokens' rows [N, H] -> per chunk of `chunk_tokens` rows:
       z = lm_head(h_chunk).float() / T -> logp = z[x] - logsumexp(z), H = logsumexp(z) - sum(softmax(z) * z)
    -> scattered back to [B, R] (zero on padding)

The full-logits path held the [B, R, V] logits, a float32 copy and the logsumexp's temporaries, about 17.5 bytes
per response token per vocabulary entry: 42-83 GiB for one micro-batch of the GPU presets (4 x 4096-8192 tokens,
vocabulary 152,064; BENCHMARKS.md "Trainer memory"). Each chunk runs under activation checkpointing
(torch.utils.checkpoint, non-reentrant): the forward keeps only the chunk's input rows, and the backward
recomputes that chunk's logits, so the backward's peak is one chunk's too. The values are the full-logits path's
(the same ops on the same rows); padding rows are never computed.

The lm_head's input is taken with a forward pre-hook that hands lm_head zero rows: the model runs its own forward
(DeepSpeed's ZeRO-3 hooks, gradient checkpointing, final norm as usual) and builds [B, 0, V] logits. The chunks call
the lm_head module itself, so its ZeRO-3 hooks gather the weight there as they do for a recomputed layer.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

# Response tokens (over the micro-batch's rows) whose logits exist at once. At a vocabulary of 152,064 a chunk's
# float32 logits are 0.6 GiB; the forward and backward hold a few such [chunk, V] tensors at a time.
DEFAULT_CHUNK_TOKENS = 1024

# Config fields of models whose forward changes the logits after lm_head (Gemma 2's soft-capping, Cohere's and
# Granite's scaling): those keep the full-logits path.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def chunkable_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The lm_head of `model` (a HF causal LM, or a DeepSpeed engine around one) when its logits are lm_head(h)."""
    hf = getattr(model, "module", model)  # DeepSpeedEngine.module
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    config = getattr(hf, "config", None)
    if not isinstance(head, torch.nn.Linear) or config is None:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_POSTPROCESSING):
        return None
    return head


@contextlib.contextmanager
def head_input(head: torch.nn.Module):
    """Within: every call of `head` records its input in the yielded list and computes on zero rows of it."""
    seen: list[torch.Tensor] = []

    def hand_no_rows(module, args):
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(hand_no_rows)
    try:
        yield seen
    finally:
        handle.remove()


def _token_stats(head: torch.nn.Module, temperature: float, with_entropy: bool, entropy_grad: bool,
                 h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[n] logprobs of `ids` (and entropies) from [n, H] rows: the full-logits path's maths on n rows."""
    z = head(h).float() / temperature  # [n, V]
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return (logp,)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():  # as grpo.entropy_from_logits
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, entropy


def chunked_token_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    first: int,
    response_index: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, R] logprobs (and entropy) of the response tokens; `hidden` [B, keep, H] holds positions first.. on."""
    b, r = response_ids.shape
    real = response_mask.reshape(-1).nonzero().squeeze(-1)  # flat [B*R] places of real tokens
    rows = hidden[real // r, response_index.reshape(-1)[real] - first]  # [N, H]
    ids = response_ids.reshape(-1)[real]
    recompute = torch.is_grad_enabled() and rows.requires_grad
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, rows.shape[0], chunk_tokens) or [0]:  # one (empty) chunk keeps the graph when N = 0
        args = (head, temperature, with_entropy, entropy_grad,
                rows[start : start + chunk_tokens], ids[start : start + chunk_tokens])
        parts.append(checkpoint(_token_stats, *args, use_reentrant=False) if recompute else _token_stats(*args))

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(b * r).index_copy(0, real, values).view(b, r)

    logp = scatter(torch.cat([p[0] for p in parts]))
    entropy = scatter(torch.cat([p[1] for p in parts])) if with_entropy else None
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()
    return logp, entropy
