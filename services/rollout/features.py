"""Drafter features from the rollout: finished sequences' tokens and target hidden states, pushed lossy.

    AddRequest --want_features--> the engine records features for every sequence (return_features)
    engine step -> finished CompletionOutputs --publish--> FeatureBatch(source="rollout") --PUSH--> drafter
                                             (features removed again where the client did not ask)

The engine already computes the last-layer state (post final norm) that produced each emitted
token, so this costs no extra forward pass. A sequence with prompt p and response r_0..r_{R-1}
becomes token_ids = [p_last, r_0, .., r_{R-2}] with features[i] = the state at token_ids[i]
(which predicted the next token), response_start = 1, capped to `max_tokens` rows, fp16, tagged
with the policy version that produced it. The push never blocks: with a slow or absent drafter
the batch is dropped and counted (`dropped`, reported in the replica's stats).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tlt.services.common.events import FeaturePusher
from tlt.services.rollout.types import CompletionOutput, GenerationRequest
from tlt.v1 import events_pb2


class FeaturePublisher:
    def __init__(self, connect: str, replica_id: int, max_tokens: int = 4096, hwm: int = 4) -> None:
        self.replica_id = replica_id
        self.max_tokens = max_tokens
        self.pusher = FeaturePusher(connect, hwm=hwm)
        self._strip: dict[str, int] = {}  # request id -> samples whose features the client did not ask for

    @property
    def dropped(self) -> int:
        return self.pusher.dropped

    def want_features(self, request: GenerationRequest) -> GenerationRequest:
        """The request with return_features on; remembers to strip them when the client did not ask."""
        if request.params.return_features:
            return request
        self._strip[request.request_id] = request.n
        return dataclasses.replace(request, params=dataclasses.replace(request.params, return_features=True))

    def publish(self, finished: list[CompletionOutput], policy_version: int) -> bool:
        """Push the features of `finished` (one batch); strip the ones nobody asked for. True if sent."""
        batch = events_pb2.FeatureBatch(source="rollout")
        for c in finished:
            feats: Any = c.features
            if feats is not None and len(c.token_ids) >= 2 and c.prompt_token_ids:
                n = min(len(c.token_ids), self.max_tokens)
                tokens = [c.prompt_token_ids[-1], *c.token_ids[: n - 1]]
                rows = feats[:n].detach().to("cpu").half().contiguous()
                batch.sequences.add(
                    seq_id=f"{c.request_id}/{c.sample_index}", group_id=c.request_id, token_ids=tokens,
                    response_start=1, hidden_size=int(rows.shape[1]), features=rows.numpy().tobytes(),
                    policy_version=int(c.versions.policy), replica_id=self.replica_id,
                )
            left = self._strip.get(c.request_id)
            if left is not None:
                c.features = None
                if left <= 1:
                    del self._strip[c.request_id]
                else:
                    self._strip[c.request_id] = left - 1
        if not batch.sequences:
            return False
        return self.pusher.push(batch)

    def forget(self, request_id: str) -> None:
        self._strip.pop(request_id, None)

    def close(self) -> None:
        self.pusher.close()
