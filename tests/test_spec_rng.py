"""Counter-based uniforms (services/rollout/spec/rng.py): the int64 torch hash against a plain-python
splitmix64, and the statistical properties sampling relies on. The chi-square tests of
tests/test_lossless_sampling.py and tests/test_spec_decoder.py draw every token with these uniforms."""

from __future__ import annotations

import torch
from scipy.stats import chisquare, kstest

from tlt.services.rollout.engine.sequence import seed_for
from tlt.services.rollout.spec.rng import (
    ACCEPT,
    GAMMA,
    PLAIN,
    RESIDUAL,
    STREAM_GAMMA,
    counter_uniforms,
    key_tensor,
)

MASK = 2**64 - 1


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _reference(key: int, t: int, stream: int) -> float:
    base = _mix((key + stream * STREAM_GAMMA) & MASK)
    return (_mix((base + (t + 1) * GAMMA) & MASK) >> 40) / 2**24


def test_torch_hash_equals_python_splitmix64_bit_for_bit():
    """int64 wrap-around and the emulated logical shifts give exactly the unsigned 64-bit arithmetic."""
    keys = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, seed_for(-1, 0), seed_for(1234, 3), 0xDEADBEEFCAFEBABE]
    pos = torch.tensor([[0, 1, 7, 40, 2**31, 2**40 + 3]]).expand(len(keys), 6)
    for stream in (PLAIN, ACCEPT, RESIDUAL):
        got = counter_uniforms(key_tensor(keys), pos, stream)
        want = [[_reference(k, t, stream) for t in row] for k, row in zip(keys, pos.tolist())]
        assert got.dtype == torch.float32 and got.tolist() == want
    assert key_tensor([-1]).tolist() == key_tensor([2**64 - 1]).tolist()  # keys are taken modulo 2**64


def test_uniforms_are_uniform_and_independent_across_positions_keys_and_streams():
    """One request's samples (consecutive `seed_for` keys) over consecutive positions: marginal KS, and
    chi-square on a 16 x 16 grid of pairs at adjacent positions, adjacent keys and two streams."""
    keys = key_tensor([seed_for(7, i) for i in range(512)])
    pos = torch.arange(256)[None].expand(512, 256)
    u = counter_uniforms(keys, pos)
    assert (u >= 0).all() and (u < 1).all()
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    other = counter_uniforms(keys, pos, ACCEPT)
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u, other)):
        cells = (a * 16).long() * 16 + (b * 16).long()
        counts = torch.bincount(cells.flatten(), minlength=256).tolist()
        assert chisquare(counts).pvalue > 1e-3
    assert not torch.equal(u, other)
