"""Drafter features from the rollout: finished sequences' tokens and target hidden states, pushed lossy.

    AddRequest --want_features--> the engine records features for every sequence (return_features)
    engine step -> finished CompletionOutputs --publish--> FeatureBatch(source="rollout") --PUSH--> drafter
                                             (features removed again where the client did not ask)

The engine already computes the last-layer state (post final norm) that produced each emitted
token, so this costs no extra forward pass. A sequence with prompt p and response r_0..r_{R-1}
becomes token_ids = [p_last, r_0, .., r_{R-2}] with features[i] = the state at token_ids[i]
(which predicted the next token), response_start = 1, capped to `max_tokens` rows, fp16, tagged
with the policy version that produced it. The push never blocks: with a slow or absent drafter
the batch is dropped and counted (`dropped`, reported in the replica's stats; on /metrics as
rollout_replica_features_dropped_total{replica}). Batches that went out but were still queued when the
drafter's coordinator went away (a restart) are lost counted nowhere: neither here (they went out) nor by the
restarted coordinator (they never arrived), nor are the drops those frames carried.

A policy push can land between two steps of a running sequence (the engine keeps going with the new
weights). Its features are then of two versions (and the later ones of neither: new weights over old
K/V), so `policy_changed` records where each unfinished sequence stands (its tokens so far) and cuts it
there: only the rows computed before the first push are sent, tagged with the version that computed them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tlt.services.common.events import FeaturePusher
from tlt.services.rollout.types import CompletionOutput, GenerationRequest
from tlt.v1 import events_pb2


def feature_sequence(c: CompletionOutput, rows: int, policy_version: int, replica_id: int = -1,
                     seq_id: str = "") -> events_pb2.FeatureSequence:
    """The first `rows` features of a finished sequence in the rollout's format: token_ids = [p_last, r_0, ..,
    r_{rows-2}], features[i] = the state at token_ids[i] (which predicted the next token), response_start = 1,
    fp16; `seq_id` defaults to "<request id>/<sample index>". The group is the prompt (`prompt_group`)."""
    h = c.features[:rows].detach().to("cpu").half().contiguous()
    return events_pb2.FeatureSequence(
        seq_id=seq_id or f"{c.request_id}/{c.sample_index}", group_id=prompt_group(c.prompt_token_ids),
        token_ids=[c.prompt_token_ids[-1], *c.token_ids[: rows - 1]], response_start=1,
        hidden_size=int(h.shape[1]), features=h.numpy().tobytes(), policy_version=policy_version,
        replica_id=replica_id,
    )


def prompt_group(prompt_token_ids: Sequence[int]) -> str:
    """The drafter's held-out split key of a sequence: its prompt's token ids (a digest). It was the request id,
    which the server makes anew for every call: a rollout step the trainer redid (collect_retrying: the same
    prompts, and with reproducible sampling the same samples) published each prompt under a second group, so a
    twin of a held-out sequence could be trained on. Every sample of one prompt, whichever call, step or epoch
    sent it, is now one group."""
    ids = np.asarray(prompt_token_ids, dtype=np.int64).tobytes()
    return "p" + hashlib.blake2b(ids, digest_size=10).hexdigest()


class FeaturePublisher:
    def __init__(self, connect: str, replica_id: int, max_tokens: int = 4096, hwm: int = 4, token: str = "") -> None:
        self.replica_id = replica_id
        self.max_tokens = max_tokens
        self.pusher = FeaturePusher(connect, hwm=hwm, token=token)
        self._strip: dict[str, int] = {}  # request id -> samples whose features the client did not ask for
        self._cut: dict[tuple[str, int], tuple[int, int]] = {}  # (request, sample) -> (rows, version) at a push

    @property
    def dropped(self) -> int:
        return self.pusher.dropped

    def want_features(self, request: GenerationRequest) -> GenerationRequest:
        """The request with return_features on; remembers to strip them when the client did not ask."""
        if request.params.return_features:
            return request
        self._strip[request.request_id] = len(request.samples)
        return dataclasses.replace(request, params=dataclasses.replace(request.params, return_features=True))

    def policy_changed(self, old_version: int, unfinished: Iterable[tuple[str, int, int]]) -> None:
        """A policy push was applied between two steps: the features of every unfinished sequence ((request id,
        sample index, tokens emitted), the engine's `unfinished_emitted()`) end at the tokens it has now."""
        for request_id, sample_index, emitted in unfinished:
            if emitted:  # the first push is the one that counts
                self._cut.setdefault((request_id, sample_index), (emitted, old_version))

    def publish(self, finished: list[CompletionOutput], policy_version: int) -> bool:
        """Push the features of `finished` (one batch); strip the ones nobody asked for. True if sent."""
        batch = events_pb2.FeatureBatch(source="rollout")
        for c in finished:
            feats: Any = c.features
            rows_total, version = len(c.token_ids), int(c.versions.policy)
            cut = self._cut.pop((c.request_id, c.sample_index), None)
            if cut is not None:
                rows_total, version = min(rows_total, cut[0]), cut[1]
            elif c.versions.policy_min is not None:
                rows_total = 0  # mixed versions and no record of where: send nothing rather than mislabel
            if feats is not None and rows_total >= 2 and c.prompt_token_ids:
                batch.sequences.append(feature_sequence(c, min(rows_total, self.max_tokens), version, self.replica_id))
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
        for key in [k for k in self._cut if k[0] == request_id]:  # empty but between a push and the finishes
            del self._cut[key]

    def close(self) -> None:
        self.pusher.close()
