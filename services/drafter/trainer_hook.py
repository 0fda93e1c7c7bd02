"""The trainer as a feature source (`[drafter] source = "trainer"`): reuse the old-logprob forward.

    trainer old-logprob pass (hidden states of prompt + response, post final norm)
        --push_trainer_features--> FeatureBatch(source="trainer") --PUSH (never blocks)--> drafter

TLT reuses this pass instead of asking the rollout for features (TLT.md section 6). Call it from
the trainer after computing old logprobs with hidden states; it costs one fp16 copy per sequence
and never waits: with a slow or absent drafter the batch is dropped and counted by the pusher.

    pusher = FeaturePusher(cfg.features_bind, token=cfg.control_token)  # the drafter's PULL endpoint; its token
    push_trainer_features(pusher, token_ids, hidden, prompt_lens, policy_version)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tlt.services.common.events import FeatureSink
from tlt.services.drafter.collect import features_message
from tlt.v1 import events_pb2


def push_trainer_features(pusher: FeatureSink, token_ids: Sequence[Sequence[int]], hidden: Sequence[torch.Tensor],
                          prompt_lens: Sequence[int], policy_version: int, max_tokens: int = 4096,
                          id_prefix: str = "trainer", groups: Sequence[str] | None = None) -> bool:
    """token_ids[i] (prompt + response), hidden[i] [len, H] (post-norm last layer) -> one FeatureBatch.

    Sequences are cut to `max_tokens` from the start of the response (the prompt's last token kept). `groups`: each
    sequence's prompt (its samples are held out together by the drafter's buffer).
    Returns True when the batch was sent, False when it was dropped (counted by the pusher).
    """
    if not (len(token_ids) == len(hidden) == len(prompt_lens)):
        raise ValueError("token_ids, hidden and prompt_lens must have one entry per sequence")
    batch = events_pb2.FeatureBatch(source="trainer")
    for i, (ids, h, p) in enumerate(zip(token_ids, hidden, prompt_lens)):
        if len(ids) != h.shape[0]:
            raise ValueError(f"sequence {i}: {len(ids)} tokens but {h.shape[0]} hidden rows")
        start = max(p - 1, 0)
        end = min(len(ids), start + max_tokens)
        tokens = torch.as_tensor(list(ids[start:end]))
        batch.sequences.append(features_message(f"{id_prefix}-{policy_version}-{i}", tokens, h[start:end],
                                                p - start, policy_version,
                                                group_id=f"{id_prefix}-{policy_version}-{groups[i]}" if groups else ""))
    return pusher.push(batch)
