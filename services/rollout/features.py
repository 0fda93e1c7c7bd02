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

A policy push can land between two steps of a running sequence (the engine keeps going with the new
weights). Its features are then of two versions (and the later ones of neither: new weights over old
K/V), so `observe` counts each running sequence's emitted tokens and `policy_changed` cuts it there:
only the rows computed before the first push are sent, tagged with the version that computed them.
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
        self._emitted: dict[str, dict[int, int]] = {}  # request id -> sample -> tokens emitted so far
        self._cut: dict[tuple[str, int], tuple[int, int]] = {}  # (request, sample) -> (rows, version) at a push

    @property
    def dropped(self) -> int:
        return self.pusher.dropped

    def want_features(self, request: GenerationRequest) -> GenerationRequest:
        """The request with return_features on; remembers to strip them when the client did not ask."""
        if request.params.return_features:
            return request
        self._strip[request.request_id] = request.n
        return dataclasses.replace(request, params=dataclasses.replace(request.params, return_features=True))

    def observe(self, steps: list[Any]) -> None:
        """Count what a step emitted per sequence (StepOutputs), for `policy_changed`."""
        for s in steps:
            mine = self._emitted.setdefault(s.request_id, {})
            mine[s.sample_index] = mine.get(s.sample_index, 0) + len(s.new_token_ids)

    def policy_changed(self, old_version: int) -> None:
        """A policy push was applied between two steps: every running sequence's features end here."""
        for rid, samples in self._emitted.items():
            for i, n in samples.items():
                self._cut.setdefault((rid, i), (n, old_version))  # the first push is the one that counts

    def publish(self, finished: list[CompletionOutput], policy_version: int) -> bool:
        """Push the features of `finished` (one batch); strip the ones nobody asked for. True if sent."""
        batch = events_pb2.FeatureBatch(source="rollout")
        for c in finished:
            feats: Any = c.features
            rows_total, version = len(c.token_ids), int(c.versions.policy)
            samples = self._emitted.get(c.request_id)
            if samples is not None:
                samples.pop(c.sample_index, None)
                if not samples:
                    del self._emitted[c.request_id]
            cut = self._cut.pop((c.request_id, c.sample_index), None)
            if cut is not None:
                rows_total, version = min(rows_total, cut[0]), cut[1]
            elif c.versions.policy_min is not None:
                rows_total = 0  # mixed versions and no record of where: send nothing rather than mislabel
            if feats is not None and rows_total >= 2 and c.prompt_token_ids:
                n = min(rows_total, self.max_tokens)
                tokens = [c.prompt_token_ids[-1], *c.token_ids[: n - 1]]
                rows = feats[:n].detach().to("cpu").half().contiguous()
                batch.sequences.add(
                    seq_id=f"{c.request_id}/{c.sample_index}", group_id=c.request_id, token_ids=tokens,
                    response_start=1, hidden_size=int(rows.shape[1]), features=rows.numpy().tobytes(),
                    policy_version=version, replica_id=self.replica_id,
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
        for i in self._emitted.pop(request_id, {}):
            self._cut.pop((request_id, i), None)

    def close(self) -> None:
        self.pusher.close()
