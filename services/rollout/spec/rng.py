"""Counter-based uniforms: the randomness of every sampled token, as a pure function of where it is drawn.

    u(key, t, stream) = top 24 bits of splitmix64(mix(key + stream * STREAM_GAMMA) + (t + 1) * GAMMA) / 2**24

key: the sequence's 64-bit key (`Sequence.rng_key`: `seed_for(seed, sample_index)`); t: the absolute index in
`token_ids` of the token being drawn; stream: what the uniform decides. No generator state: the uniform for
position t is the same whichever step, batch, arm or drafter draws it, so a seeded sample is a deterministic
function of (key, t, the target's filtered distribution at t). Plain decoding draws the token at t with
u(key, t, PLAIN); the tree walk draws the target's token at a node of depth d below the root (the last token,
at t - 1) with u(key, t + d, PLAIN), so it emits exactly plain decoding's tokens. Each position is emitted
once, and which positions a step consumes depends only on the values at earlier ones (a stopping rule), so
the uniforms a later step reads are fresh: speculation stays lossless.

Rejection-sampled chains (drafts drawn from the drafter, `SpecConfig.chain_sampling`) use their own streams
(DRAFT, ACCEPT, RESIDUAL) and so never reuse a PLAIN uniform; they are lossless in distribution but do not
reproduce plain decoding's tokens (see accept.py).

The mixing is done in int64 torch ops (two's-complement wrap-around on multiply and add; logical right shifts
emulated with a mask), elementwise, on the positions' device: CPU and CUDA give the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# streams: what a uniform decides (one independent sequence of uniforms per stream and key)
PLAIN = 0  # the token at t: plain decoding, and the tree walk's target draw at every node
DRAFT = 1  # a drafter's sampled draft for position t (rejection-sampled chains)
ACCEPT = 2  # accept / reject the draft for position t (rejection-sampled chains)
RESIDUAL = 3  # the residual or bonus draw of a rejection-sampled chain step starting at position t

GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio, odd)
STREAM_GAMMA = 0xD1B54A32D192ED03  # an odd constant that separates the streams of one key
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _i64(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores (values >= 2**63 wrap to negative)."""
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (a bijection of 64-bit patterns with full avalanche)."""
    z = (z ^ _srl(z, 30)) * _i64(_M1)
    z = (z ^ _srl(z, 27)) * _i64(_M2)
    return z ^ _srl(z, 31)


def key_tensor(keys: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 tensor of 64-bit keys (python ints, any sign; taken modulo 2**64)."""
    return torch.tensor([_i64(k) for k in keys], dtype=torch.int64, device=device)


def counter_uniforms(keys: torch.Tensor, positions: torch.Tensor, stream: int = PLAIN) -> torch.Tensor:
    """float32 U[0, 1) of `positions`' shape: u(keys[b], positions[b, ...], stream) (see the module docstring).

    keys [B] int64 (`key_tensor`); positions [B, ...] integer. Multiples of 2**-24 below 1, like torch.rand's
    float32 draws."""
    keys = keys.to(device=positions.device, dtype=torch.int64)
    base = _mix(keys + _i64(stream * STREAM_GAMMA))
    base = base.view(base.shape + (1,) * (positions.dim() - 1))
    z = _mix(base + (positions.to(torch.int64) + 1) * _i64(GAMMA))
    return _srl(z, 40).to(torch.float32) * 2.0**-24
