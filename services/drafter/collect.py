"""Target features without the rollout server.

    engine_samples: prompts --the rollout's native engine (every prompt in flight at once, continuous
      batching, return_features)--> responses and the last-layer state (post final norm) that produced
      each response token, from the forward that sampled it --> Sample windows in the rollout's own
      format ([p_last, r_0, .., r_{R-2}], response_start 1: what the online drafter trains on)
    sample_features: one prompt at a time through a KV-cached `transformers` loop, then
      forward(output_hidden_states) --> hidden_states[-1] (transformers applies the final norm before
      appending the last entry: exactly what the lm_head sees) --> Sample windows

Offline warm-up (`tlt drafter warmup`) samples with the engine (~10x faster on a CPU than the
one-prompt loop: Session 42 in BENCHMARKS.md); tests and the drift and preemption benchmarks use
`sample_features`. The trainer side (`source = "trainer"`) pushes the same shape of data from its
old-logprob pass with `push_trainer_features` in `trainer_hook.py`, which builds each sequence with
this module's `features_message`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from tlt.services.drafter.packing import Sample


@torch.no_grad()
def last_hidden(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] -> [B, T, H] last-layer states after the final norm."""
    out = model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True)
    return out.hidden_states[-1]


@torch.no_grad()
def sample_features(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    temperature: float = 0.0, policy_version: int = 0, seed: int = 0, eos_token_id: int | None = None,
                    window_tokens: int = 4096, prefix: str = "s") -> list[Sample]:
    """Generate from each prompt (one at a time: no padding effects) and return its feature Sample."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    out: list[Sample] = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([list(p)])
        past = None
        step_ids = ids
        for _ in range(max_new_tokens):  # plain KV-cached loop: deterministic, no generate() config surprises
            res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()
            if temperature > 0:
                tok = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=g))
            else:
                tok = int(logits.argmax())
            step_ids = torch.tensor([[tok]])
            ids = torch.cat([ids, step_ids], 1)
            if eos_token_id is not None and tok == eos_token_id:
                break
        h = last_hidden(model, ids)[0]
        out.extend(to_samples(f"{prefix}{i}", ids[0], h, len(p), policy_version, window_tokens))
    return out


def engine_samples(model_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float = 0.0, seed: int = 0, window_tokens: int = 4096, prefix: str = "p",
                   progress: Callable[[int], object] | None = None) -> list[Sample]:
    """Each prompt's response from the rollout's native engine (float32, plain decoding) and its features.

    Sequence i is `f"{prefix}{i}-0"` (as `sample_features(..., [p], prefix=f"{prefix}{i}-")` names it), drawn
    at `temperature` with the engine's counter RNG keyed by `seed + i` (`reproducible`), so it does not depend
    on what else is in flight; greedy at temperature 0. A response stops at the model's context, whatever
    `max_new_tokens` says. `progress(k)`: k more responses finished. ConfigError (one line) for a prompt that
    fills the context or a response that cannot fit in the engine's KV cache.
    """
    from tlt.services.common.config import ConfigError
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=256, kv_cache_mb=768))
    limit = engine.max_model_len
    if (longest := max((len(p) for p in prompts), default=0)) >= limit:
        raise ConfigError(f"a prompt has {longest} tokens: no room for a response in the model's context of {limit}")
    requests = [
        GenerationRequest(f"{prefix}{i}", tuple(int(t) for t in p),
                          SamplingParams(temperature=temperature, max_tokens=min(max_new_tokens, limit - len(p)),
                                         seed=(seed + i) % 2**63 if temperature > 0 else None,
                                         reproducible=temperature > 0, return_features=True))
        for i, p in enumerate(prompts)
    ]
    try:
        done = engine.generate(requests, progress=progress)
    except ValueError as e:  # a response that cannot fit in the KV cache (a large model at float32)
        raise ConfigError(f"cannot sample the target for drafter features: {e}; lower --max-new-tokens") from e
    from tlt.services.drafter.buffer import windows
    from tlt.services.rollout.features import feature_sequence

    return [w for i, c in enumerate(done)
            for w in windows(feature_sequence(c, len(c.token_ids), 0, seq_id=f"{prefix}{i}-0"), window_tokens)]


def to_samples(seq_id: str, tokens: torch.Tensor, hidden: torch.Tensor, prompt_len: int, policy_version: int,
               window_tokens: int) -> list[Sample]:
    """A full sequence (prompt + response) and its features -> windows from the response (see buffer.windows)."""
    from tlt.services.drafter.buffer import windows

    seq = features_message(seq_id, tokens, hidden, prompt_len, policy_version)
    return windows(seq, window_tokens)


def features_message(seq_id: str, tokens: torch.Tensor, hidden: torch.Tensor, prompt_len: int,
                     policy_version: int, replica_id: int = -1, group_id: str = "") -> object:
    """`group_id`: the prompt's (its samples are held out together); default: the sequence's own."""
    from tlt.v1 import events_pb2

    h = hidden.detach().to("cpu", torch.float16).contiguous()
    return events_pb2.FeatureSequence(
        seq_id=seq_id, group_id=group_id or seq_id, token_ids=[int(t) for t in tokens.tolist()],
        response_start=prompt_len,
        hidden_size=int(h.shape[-1]), features=np.ascontiguousarray(h.numpy()).tobytes(),
        policy_version=policy_version, replica_id=replica_id)
