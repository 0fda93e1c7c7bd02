"""Packed training batches for the drafter: sequences side by side in rows, never mixing.

    Sample (tokens, features h_t, response_start) --pack--> PackedBatch rows [R, L]
        tokens, features, segment_ids (-1 = padding), loss_mask (h_t is a target)
    PackedBatch --packed_pairs--> the drafter's shifted inputs (TLT.md section 3 alignment):
        pair j = (x_{j+1}, h_j) at position (j - segment start + 1) -> target h_{j+1}

A pair is trained only when x_{j+1} / h_{j+1} belong to the same segment as h_j (the last token of
a sequence has no pair) and h_{j+1} is a target; attention masks come from the segment ids, so a
packed sequence never sees another (the reference let attention cross sample boundaries).
Positions restart at each segment; RoPE attention depends only on position differences, so a
window cut from the middle of a response trains the same as at its absolute position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tlt.v1 import drafter_pb2


@dataclass(frozen=True)
class Sample:
    """One window of one sequence: features[t] = target's last-layer state (post norm) at token t."""

    seq_id: str
    tokens: np.ndarray  # int32 [n]
    features: np.ndarray  # float16 [n, H]
    response_start: int  # index of the first response token (h at response_start - 1 predicts it)
    policy_version: int
    replica_id: int = 0
    seq_tokens: int = 0  # length of the sequence this window was cut from (0: the window's own)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def loss_mask(self) -> np.ndarray:
        """h_t is a training target when it predicts a response token: t >= response_start - 1."""
        return np.arange(len(self)) >= self.response_start - 1


@dataclass(frozen=True)
class PackedBatch:
    tokens: torch.Tensor  # int64 [R, L]
    features: torch.Tensor  # float16 [R, L, H]
    segment_ids: torch.Tensor  # int64 [R, L], -1 = padding
    loss_mask: torch.Tensor  # bool [R, L]
    policy_version: int
    sequences: int

    def to_proto(self) -> drafter_pb2.TrainBatch:
        r, length, h = self.features.shape
        return drafter_pb2.TrainBatch(
            rows=r, length=length, hidden_size=h, policy_version=self.policy_version, sequences=self.sequences,
            token_ids=self.tokens.to(torch.int32).numpy().tobytes(),
            features=self.features.to(torch.float16).numpy().tobytes(),
            segment_ids=self.segment_ids.to(torch.int32).numpy().tobytes(),
            loss_mask=self.loss_mask.to(torch.uint8).numpy().tobytes(),
        )

    @classmethod
    def from_proto(cls, m: drafter_pb2.TrainBatch) -> PackedBatch:
        r, length, h = m.rows, m.length, m.hidden_size

        def arr(b: bytes, dtype: type, shape: tuple[int, ...]) -> torch.Tensor:
            a = np.frombuffer(b, dtype=dtype)
            if a.size != int(np.prod(shape)):
                raise ValueError(f"TrainBatch field has {a.size} values, expected shape {shape}")
            return torch.from_numpy(a.reshape(shape).copy())

        return cls(
            tokens=arr(m.token_ids, np.int32, (r, length)).long(),
            features=arr(m.features, np.float16, (r, length, h)),
            segment_ids=arr(m.segment_ids, np.int32, (r, length)).long(),
            loss_mask=arr(m.loss_mask, np.uint8, (r, length)).bool(),
            policy_version=m.policy_version,
            sequences=m.sequences,
        )


def pack(samples: list[Sample], rows: int, row_tokens: int) -> tuple[PackedBatch | None, list[Sample]]:
    """First-fit the samples (in the given order) into `rows` rows of `row_tokens`; returns (batch, used).

    A sample longer than a row is cut to its first `row_tokens` tokens. None when nothing fits.
    """
    fill = [0] * rows
    placed: list[tuple[int, int, Sample]] = []
    for s in samples:
        n = min(len(s), row_tokens)
        if n < 2:
            continue
        row = next((i for i in range(rows) if fill[i] + n <= row_tokens), None)
        if row is None:
            continue
        placed.append((row, fill[row], s))
        fill[row] += n
        if min(fill) >= row_tokens - 1:
            break
    if not placed:
        return None, []
    h = placed[0][2].features.shape[1]
    length = max(fill)
    tokens = np.zeros((rows, length), np.int64)
    feats = np.zeros((rows, length, h), np.float16)
    seg = np.full((rows, length), -1, np.int64)
    mask = np.zeros((rows, length), bool)
    for k, (row, start, s) in enumerate(placed):
        n = min(len(s), row_tokens)
        tokens[row, start:start + n] = s.tokens[:n]
        feats[row, start:start + n] = s.features[:n]
        seg[row, start:start + n] = k
        mask[row, start:start + n] = s.loss_mask()[:n]
    version = max(s.policy_version for _, _, s in placed)
    batch = PackedBatch(torch.from_numpy(tokens), torch.from_numpy(feats), torch.from_numpy(seg),
                        torch.from_numpy(mask), version, len(placed))
    return batch, [s for _, _, s in placed]


@dataclass(frozen=True)
class PackedPairs:
    input_ids: torch.Tensor  # [R, L-1] x_{j+1}
    features: torch.Tensor  # [R, L-1, H] h_j
    target: torch.Tensor  # [R, L-1, H] h_{j+1}
    positions: torch.Tensor  # [R, L-1] position of pair j inside its segment (1-based, like training_pairs)
    segment_ids: torch.Tensor  # [R, L-1] attention groups
    mask: torch.Tensor  # [R, L-1] bool: the pair is inside one segment and h_{j+1} is a target


def packed_pairs(tokens: torch.Tensor, features: torch.Tensor, segment_ids: torch.Tensor,
                 loss_mask: torch.Tensor) -> PackedPairs:
    """Shift a packed batch into drafter pairs without crossing segments (see the module docstring)."""
    r, length = tokens.shape
    seg = segment_ids[:, :-1]
    same = (seg == segment_ids[:, 1:]) & (seg >= 0)
    idx = torch.arange(length - 1, device=tokens.device).expand(r, length - 1)
    new = torch.ones_like(seg, dtype=torch.bool)
    new[:, 1:] = seg[:, 1:] != seg[:, :-1]
    start = torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=1).values
    return PackedPairs(
        input_ids=tokens[:, 1:],
        features=features[:, :-1],
        target=features[:, 1:],
        positions=idx - start + 1,
        segment_ids=seg,
        mask=same & loss_mask[:, 1:].bool(),
    )
