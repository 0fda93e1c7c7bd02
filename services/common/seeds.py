"""Seeds for torch's generators from config seeds, which are any integer.

`torch.Generator.manual_seed` takes -2**63 .. 2**64 - 1 and keeps the value modulo 2**64; past that range it raised
"Overflow when unpacking long long" (a run started with `--seed` from a nanosecond clock failed in its first step).
Taking the seed modulo 2**64 first gives every accepted seed the generator it had, and every other one a generator.
"""

from __future__ import annotations


def torch_seed(seed: int) -> int:
    """`seed` (any integer) as `manual_seed` keeps it: modulo 2**64."""
    return seed % 2**64
