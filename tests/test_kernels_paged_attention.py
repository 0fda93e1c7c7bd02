"""Paged decode / tree attention: reference against hand values and dense SDPA, kernel against reference.

The "interpreter" cases need TRITON_INTERPRET=1 from process start: they run in
the child process of tests/test_kernels_interpreter.py and skip elsewhere. The
"cuda" cases run the compiled kernels on a GPU (marked `gpu`). Nothing is faked.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernel_params import DEVICE_DTYPES, DEVICES, device  # noqa: F401 - device is a fixture
from tlt.kernels.paged_attention import (
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_tree_attention_ref,
    paged_tree_attention_triton,
)

TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_cache(
    lens: list[int], hkv: int, dim: int, block_size: int, dtype: torch.dtype, seed: int, spare_blocks: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches with each sequence's blocks scattered over a shuffled pool (plus unused blocks)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [max(1, math.ceil(n / block_size)) for n in lens]
    max_blocks = max(per_seq) + 1  # one unused column: never read
    num_blocks = sum(per_seq) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max_blocks), 10**6, dtype=torch.int32)  # out-of-range sentinel beyond use
    for b, count in enumerate(per_seq):
        tables[b, :count] = torch.tensor([pool.pop() for _ in range(count)], dtype=torch.int32)
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def test_reference_hand_values() -> None:
    # One head, D = 1, q = 1, keys [0, ln 2], values [3, 6], scale 1:
    # softmax([0, ln 2]) = [1/3, 2/3] -> out = 1 + 4 = 5. Block size 1, blocks scattered.
    k_cache = torch.tensor([9.0, math.log(2.0), 7.0, 0.0]).view(4, 1, 1, 1)
    v_cache = torch.tensor([9.0, 6.0, 9.0, 3.0]).view(4, 1, 1, 1)
    tables = torch.tensor([[3, 1]], dtype=torch.int32)
    out = paged_decode_attention_ref(torch.ones(1, 1, 1), k_cache, v_cache, tables, torch.tensor([2], dtype=torch.int32), 1.0)
    torch.testing.assert_close(out, torch.tensor([[[5.0]]]))


def test_reference_equals_dense_sdpa_with_gqa() -> None:
    lens, hq, hkv, dim, block_size = [1, 7, 12], 4, 2, 8, 4
    k_cache, v_cache, tables, ctx = make_cache(lens, hkv, dim, block_size, torch.float32, seed=0)
    q = torch.randn(len(lens), hq, dim)
    got = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.37)
    for b, n in enumerate(lens):
        blocks = tables[b, : math.ceil(n / block_size)].long()
        k = k_cache[blocks].reshape(-1, hkv, dim)[:n].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        v = v_cache[blocks].reshape(-1, hkv, dim)[:n].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        want = F.scaled_dot_product_attention(q[b][:, None], k, v, scale=0.37)[:, 0]
        torch.testing.assert_close(got[b], want)


def test_tree_reference_causal_chain_equals_decode_per_token() -> None:
    # A chain of Q new tokens with a lower-triangular mask is ordinary causal attention:
    # query i equals decode attention with context length prefix + i + 1.
    lens, hq, hkv, dim, num_q = [5, 9], 2, 1, 8, 3
    k_cache, v_cache, tables, ctx = make_cache(lens, hkv, dim, 4, torch.float32, seed=1)
    q = torch.randn(2, num_q, hq, dim)
    causal = torch.tril(torch.ones(num_q, num_q, dtype=torch.bool)).expand(2, num_q, num_q).contiguous()
    tree = paged_tree_attention_ref(q, k_cache, v_cache, tables, ctx, 0.5, causal)
    for i in range(num_q):
        decode = paged_decode_attention_ref(q[:, i], k_cache, v_cache, tables, ctx - (num_q - 1 - i), 0.5)
        torch.testing.assert_close(tree[:, i], decode)


def random_tree_mask(batch: int, num_q: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self masks of random trees over the Q new tokens (node 0 is the root)."""
    mask = torch.zeros(batch, num_q, num_q, dtype=torch.bool)
    for b in range(batch):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_q)]
        for i in range(num_q):
            node = i
            while node >= 0:
                mask[b, i, node] = True
                node = parents[node]
    return mask


# (lens, Hq, Hkv, D, block_size): ragged lengths incl. 1 and exact block multiples; GQA 1, 2, 4;
# non-power-of-2 head dim and block size.
DECODE_CONFIGS = [
    ([1, 4, 9], 2, 2, 16, 4),
    ([8, 3, 13, 16], 4, 2, 24, 4),
    ([5, 11], 8, 2, 16, 5),
    ([30, 7], 4, 2, 16, 24),  # a block size past 16 and not a power of two: the tile is padded to 32 keys
]


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES, indirect=["device"])
@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["splits1", "splits3", "splits_auto"])
def test_decode_kernel_matches_reference(device: torch.device, dtype: torch.dtype, config: tuple, num_splits: int | None) -> None:
    lens, hq, hkv, dim, block_size = config
    k_cache, v_cache, tables, ctx = make_cache(lens, hkv, dim, block_size, dtype, seed=hq * dim)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), hq, dim, generator=gen).to(dtype)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 1 / math.sqrt(dim))
    on = [t.to(device) for t in (q, k_cache, v_cache, tables, ctx)]
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)  # poison: unwritten elements fail
    got = paged_decode_attention_triton(*on, 1 / math.sqrt(dim), out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


def _check_tree_kernel(device: torch.device, dtype: torch.dtype, lens: list[int], hq: int, hkv: int, block_size: int,
                      num_q: int, seed: int, scale: float, **kernel_args: int) -> tuple:
    """The tree kernel against the reference on random caches, trees and queries (head dim 16); returns the inputs."""
    k_cache, v_cache, tables, ctx = make_cache(lens, hkv, 16, block_size, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), num_q, hq, 16, generator=gen).to(dtype)
    mask = random_tree_mask(len(lens), num_q, gen)
    want = paged_tree_attention_ref(q, k_cache, v_cache, tables, ctx, scale, mask)
    on = [t.to(device) for t in (q, k_cache, v_cache, tables, ctx)]
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)  # poison: unwritten elements fail
    got = paged_tree_attention_triton(*on, scale, mask.to(device), out=out, **kernel_args)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    return q, k_cache, v_cache, tables, ctx


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES, indirect=["device"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tree_kernel_matches_reference(device: torch.device, dtype: torch.dtype, num_splits: int) -> None:
    _check_tree_kernel(device, dtype, [4, 10, 7], hq=4, hkv=1, block_size=4, num_q=4, seed=11, scale=0.25,
                       num_splits=num_splits)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES, indirect=["device"])
@pytest.mark.parametrize(("pages", "num_splits", "block_size"), [(2, 1, 8), (4, 2, 8), (2, 3, 16)])
def test_tree_kernel_with_several_blocks_per_iteration_matches_reference(device: torch.device, dtype: torch.dtype,
                                                                         pages: int, num_splits: int,
                                                                         block_size: int) -> None:
    """`pages` > 1 (a tuning candidate for long contexts): each key's block is gathered through the table, the last
    iteration runs past the sequence's blocks (sentinel table entries, never read) and past the table's width."""
    q, k_cache, v_cache, tables, ctx = _check_tree_kernel(device, dtype, [5, 41, 23, 16], hq=6, hkv=2,
                                                          block_size=block_size, num_q=5, seed=13, scale=0.3,
                                                          num_splits=num_splits, pages=pages)
    decode = paged_decode_attention_ref(q[:, -1], k_cache, v_cache, tables, ctx, 0.3)  # no mask: every key
    got_decode = paged_tree_attention_triton(*[t.to(device) for t in (q[:, -1:], k_cache, v_cache, tables, ctx)], 0.3,
                                             None, pages=pages)
    torch.testing.assert_close(got_decode[:, 0].cpu(), decode, **TOL[dtype])


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES, indirect=["device"])
@pytest.mark.parametrize("block_m", [16, 32, None])
def test_tree_kernel_with_fewer_rows_per_tile_matches_reference(device: torch.device, dtype: torch.dtype,
                                                                block_m: int | None) -> None:
    """`block_m` below the default (64 for these 36 rows per KV head): several row tiles per (sequence, KV head).
    None: the default, a power of two above the 36 rows (a verify pass of 9 tokens with 4 query heads a KV head)."""
    _check_tree_kernel(device, dtype, [5, 41, 17], hq=8, hkv=2, block_size=8, num_q=9, seed=17, scale=0.3,
                       num_splits=2, **({} if block_m is None else {"block_m": block_m}))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_kernel_empty_context_and_empty_mask_rows_give_zero(device: torch.device) -> None:
    k_cache, v_cache, tables, _ = make_cache([4, 4], 1, 8, 4, torch.float32, seed=2)
    q = torch.randn(2, 1, 8)
    ctx = torch.tensor([0, 4], dtype=torch.int32)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 1.0)
    assert torch.equal(want[0], torch.zeros(1, 8))
    for splits in (1, 2):
        got = paged_decode_attention(*(t.to(device) for t in (q, k_cache, v_cache, tables, ctx)), 1.0, impl="triton") \
            if splits == 1 else paged_decode_attention_triton(
                *(t.to(device) for t in (q, k_cache, v_cache, tables, ctx)), 1.0, num_splits=splits)
        torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])
    # Tree: Q = 2 new tokens are the whole context; a query whose mask row is empty sees nothing.
    mask = torch.tensor([[[False, False], [True, True]]]).expand(2, 2, 2).contiguous()
    q2 = torch.randn(2, 2, 1, 8)
    ctx2 = torch.tensor([2, 4], dtype=torch.int32)
    want2 = paged_tree_attention_ref(q2, k_cache, v_cache, tables, ctx2, 1.0, mask)
    assert torch.equal(want2[0, 0], torch.zeros(1, 8))
    got2 = paged_tree_attention_triton(*(t.to(device) for t in (q2, k_cache, v_cache, tables, ctx2)), 1.0, mask.to(device))
    torch.testing.assert_close(got2.cpu(), want2, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_an_empty_batch_gives_an_empty_output(device: torch.device) -> None:
    """No sequence to attend for (every request of a step finished): an empty output, not a division by zero in
    the split heuristic or a launch of an empty grid."""
    k_cache, v_cache, tables, ctx = make_cache([4], 2, 8, 4, torch.float32, seed=3)
    empty = [t.to(device) for t in (k_cache, v_cache, tables[:0], ctx[:0])]
    got = paged_tree_attention_triton(torch.randn(0, 3, 4, 8, device=device), *empty, 1.0, None)
    assert got.shape == (0, 3, 4, 8)
    assert paged_decode_attention_triton(torch.randn(0, 4, 8, device=device), *empty, 1.0).shape == (0, 4, 8)


def test_split_heuristic_depends_on_shapes_only() -> None:
    assert default_num_splits(programs=1024, max_blocks=4096) == 1  # grid already large
    assert default_num_splits(programs=28, max_blocks=2048) == 19  # ceil(512 / 28)
    assert default_num_splits(programs=1, max_blocks=16) == 2  # at least 8 blocks per split
    assert default_num_splits(programs=1, max_blocks=1) == 1


def test_wrapper_rejects_bad_inputs() -> None:
    k_cache, v_cache, tables, ctx = make_cache([3], 2, 8, 4, torch.float32, seed=0)
    q = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_triton(torch.randn(1, 4, 8), k_cache, v_cache, tables.long(), ctx, 1.0)
    with pytest.raises(ValueError, match="pages must be"):
        paged_tree_attention_triton(torch.randn(1, 1, 4, 8), k_cache, v_cache, tables, ctx, 1.0, None, pages=3)
    with pytest.raises(ValueError, match="pages must be"):
        paged_tree_attention_triton(torch.randn(1, 1, 4, 8), k_cache, v_cache, tables, ctx, 1.0, None, pages=2.0)
    with pytest.raises(ValueError, match="num_warps"):
        paged_tree_attention_triton(torch.randn(1, 1, 4, 8), k_cache, v_cache, tables, ctx, 1.0, None, num_warps=3)
    with pytest.raises(ValueError, match=">= 16 keys"):
        paged_tree_attention_triton(torch.randn(1, 1, 4, 8), k_cache, v_cache, tables, ctx, 1.0, None, pages=2)
    with pytest.raises(ValueError, match="tree_mask"):
        paged_tree_attention_triton(torch.randn(1, 2, 4, 8), k_cache, v_cache, tables, ctx, 1.0,
                                    torch.ones(1, 2, 3, dtype=torch.bool))
