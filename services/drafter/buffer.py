"""The drafter's bounded, version-tagged feature buffer (TLT.md section 6, "Data").

    FeatureBatch (rollout or trainer) --add--> windows (<= window_tokens, from the response)
        every k-th sequence -> held-out set (acceptance evaluation), the rest -> training set
    training set --batch--> newest policy version first (shuffled), then the previous
        version's long sequences ("one-step offset" fallback) --pack--> PackedBatch

Bounded: at most `buffer_sequences` training windows and `holdout_sequences` held-out ones; the
oldest go first. Older versions than the previous one are never sampled. Thread-safe: the feature
puller adds while the coordinator's request handler samples.

Checked at ingest (`problem`): a sequence from any sender that does not fit the model (hidden size,
feature length, token ids, non-finite features) is refused, logged with its sender and counted
(`rejected`). Let in, it would make every batch that draws it fail, for every worker, until evicted.
A batch whose sender reports an impossible drop count (past MAX_SENDER_DROPPED) is refused whole and counted the
same way: one such 20-byte message made the summed count overflow the status's int64, and every GetStatus failed
until a restart. The senders' running drop counts are kept for the MAX_SENDERS last heard (a restarted process is
a new sender), and each new count adds what it grew by; a sender not among them (new, or forgotten and heard again)
adds only the frame's `dropped_since`, the drops since its previous frame went out, which no frame before can have
carried (its whole running count was added again: 1,025 senders x 5 drops read 5130). The total is exact (capped at
the int64 maximum) for every frame a sender got out that reached this buffer. Not counted anywhere: frames lost after
they went out, with the sequences in them and the drops they carried (queued to a coordinator that restarted or went
away), so a restarted coordinator counts from its start; and the drops after a sender's last frame. A sender that does
not set `dropped_since` is counted by its running count alone (forgotten and heard again: counted again).
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict, deque

import numpy as np

from tlt.services.common.logging import get_logger
from tlt.services.drafter.packing import PackedBatch, Sample, pack
from tlt.v1 import events_pb2

log = get_logger("drafter.buffer")
MAX_GROUPS = 4096  # groups (prompts) whose split is remembered: a step and its redo, and a prompt seen again within
# the 4096 groups heard last, keep one side; one older is decided again
MAX_SENDERS = 1024  # senders whose running drop count is kept, the least recently heard forgotten first
MAX_SENDER_DROPPED = 1 << 40  # a trillion sequences dropped by one sender: past it, the count is no count
INT64_MAX = (1 << 63) - 1  # DrafterStatus.features_dropped


def problem(seq: events_pb2.FeatureSequence, hidden_size: int, vocab_size: int) -> str:
    """Why `seq` cannot be trained on by a drafter of `hidden_size` / `vocab_size` ("" when it can; 0: not checked)."""
    n, h = len(seq.token_ids), seq.hidden_size
    if hidden_size and h != hidden_size:
        return f"hidden_size {h}, the model's is {hidden_size}"
    if h <= 0 or len(seq.features) != n * h * 2:
        return f"{len(seq.features)} feature bytes for {n} tokens x hidden {h} in fp16"
    tokens = np.asarray(seq.token_ids, dtype=np.int64)
    if vocab_size and n and (tokens.min() < 0 or tokens.max() >= vocab_size):
        return f"token ids in [{tokens.min()}, {tokens.max()}], outside the vocabulary [0, {vocab_size})"
    if not np.isfinite(np.frombuffer(seq.features, dtype=np.float16)).all():
        return "non-finite features"
    return ""


def windows(seq: events_pb2.FeatureSequence, window_tokens: int) -> list[Sample]:
    """Cut a FeatureSequence into windows from the response (one token of overlap, so no pair is lost)."""
    n, h = len(seq.token_ids), seq.hidden_size
    feats = np.frombuffer(seq.features, dtype=np.float16)
    if h <= 0 or feats.size != n * h:
        raise ValueError(f"sequence {seq.seq_id!r}: {feats.size} feature values for {n} tokens x hidden {h}")
    feats = feats.reshape(n, h)
    tokens = np.asarray(seq.token_ids, dtype=np.int32)
    first = max(seq.response_start - 1, 0)
    out: list[Sample] = []
    start = first
    while start < n - 1:
        end = min(start + window_tokens, n)
        rs = seq.response_start - start if start == first else 0
        out.append(Sample(f"{seq.seq_id}@{start}", tokens[start:end], feats[start:end], max(rs, 0),
                          int(seq.policy_version), int(seq.replica_id), n - first))
        start = end - 1
    return out


class FeatureBuffer:
    def __init__(self, max_sequences: int, max_holdout: int, window_tokens: int, long_tokens: int,
                 holdout_every: int, seed: int = 0, hidden_size: int = 0, vocab_size: int = 0) -> None:
        """`hidden_size` / `vocab_size`: the model's, which every sequence added must fit (0: not checked)."""
        self.window_tokens = window_tokens
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.long_tokens = long_tokens
        self.holdout_every = holdout_every
        self._train: deque[Sample] = deque(maxlen=max_sequences)
        self._holdout: deque[Sample] = deque(maxlen=max_holdout)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._count = 0  # groups seen (the held-out split's counter)
        self._groups: OrderedDict[str, bool] = OrderedDict()  # recent groups -> held out (bounded: MAX_GROUPS)
        self.received_sequences = 0
        self.sender_dropped = 0  # sequences the senders dropped (summed over senders)
        self._dropped: OrderedDict[str, int] = OrderedDict()  # sender -> its running drop count (MAX_SENDERS)
        self.rejected = 0  # sequences refused at ingest (see `problem`)

    def add_batch(self, batch: events_pb2.FeatureBatch) -> int:
        """Add every sequence of `batch`; returns how many windows were added. Bad sequences are refused,
        logged and counted."""
        if max(batch.dropped_before, batch.dropped_since) > MAX_SENDER_DROPPED:
            with self._lock:
                self.received_sequences += len(batch.sequences)
                self.rejected += max(1, len(batch.sequences))  # one with no sequence counts as one
            log.warning("feature_batch_rejected", source=batch.source, sender=batch.sender[:100], total=self.rejected,
                        reason=f"dropped_before {batch.dropped_before} or dropped_since {batch.dropped_since} is past "
                               f"{MAX_SENDER_DROPPED}")
            return 0
        added = 0
        for seq in batch.sequences:
            reason = problem(seq, self.hidden_size, self.vocab_size)
            if reason:
                self.rejected += 1
                log.warning("feature_sequence_rejected", source=batch.source, replica=seq.replica_id,
                            seq_id=seq.seq_id, reason=reason, total=self.rejected)
                continue
            parts = windows(seq, self.window_tokens)
            with self._lock:
                target = self._holdout if self._held_out(seq.group_id) else self._train
                target.extend(parts)
            added += len(parts)
        with self._lock:
            self.received_sequences += len(batch.sequences)
            # each sender (a pusher: one per process and rank, a restarted process a new one) counts its own drops
            key = batch.sender or (f"replica-{batch.sequences[0].replica_id}" if batch.sequences else "")
            if key:
                known = key in self._dropped
                before = self._dropped.pop(key, 0)
                self._dropped[key] = now = max(before, int(batch.dropped_before))  # heard last: forgotten last
                # not known: its earlier frames may have been counted (it was forgotten), but not the drops since
                # the last of them
                grew = now - before if known or not batch.HasField("dropped_since") else min(batch.dropped_since, now)
                self.sender_dropped = min(INT64_MAX, self.sender_dropped + grew)
                if len(self._dropped) > MAX_SENDERS:  # its count stays in the total
                    self._dropped.popitem(last=False)
        return added

    def _held_out(self, group: str) -> bool:
        """Every `holdout_every`-th GROUP (a prompt's samples), whole: siblings of a held-out sequence in the
        training set made the candidate look better on the gate's held-out set than it is on new prompts. A
        sequence without a group counts as its own."""
        if group and group in self._groups:
            self._groups.move_to_end(group)
            return self._groups[group]
        self._count += 1
        held = self._count % self.holdout_every == 0
        if group:
            self._groups[group] = held
            if len(self._groups) > MAX_GROUPS:
                self._groups.popitem(last=False)
        return held

    def add_samples(self, samples: list[Sample], holdout: bool = False) -> None:
        with self._lock:
            (self._holdout if holdout else self._train).extend(samples)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted({s.policy_version for s in self._train}, reverse=True)

    def batch(self, rows: int, row_tokens: int) -> PackedBatch | None:
        """A packed batch: newest version first, previous version's long sequences as fallback."""
        with self._lock:
            train = list(self._train)
        if not train:
            return None
        versions = sorted({s.policy_version for s in train}, reverse=True)
        newest = [s for s in train if s.policy_version == versions[0]]
        self._rng.shuffle(newest)
        fallback: list[Sample] = []
        if len(versions) > 1:
            fallback = [s for s in train  # long SEQUENCES: every window of one, its short last one included
                        if s.policy_version == versions[1] and max(s.seq_tokens, len(s)) >= self.long_tokens]
            self._rng.shuffle(fallback)
        batch, _ = pack(newest + fallback, rows, row_tokens)
        return batch

    def holdout(self, min_tokens: int) -> list[Sample]:
        """Held-out windows of the newest version (plus older ones, newest first, until `min_tokens`)."""
        with self._lock:
            held = list(self._holdout)
        held.sort(key=lambda s: s.policy_version, reverse=True)
        if not held:
            return []
        out = [s for s in held if s.policy_version == held[0].policy_version]
        rest = [s for s in held if s.policy_version != held[0].policy_version]
        while sum(len(s) for s in out) < min_tokens and rest:
            out.append(rest.pop(0))
        return out

    def stats(self) -> tuple[int, int]:
        """(training windows, training tokens)."""
        with self._lock:
            return len(self._train), sum(len(s) for s in self._train)
