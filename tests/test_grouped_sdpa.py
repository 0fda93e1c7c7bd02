"""`layer_ops.grouped_sdpa`: GQA / MQA attention by folding each K/V head's query heads into query rows.

The engine's attention (paged gather, decode mirror, the drafter's runtime) no longer asks SDPA to expand
K and V to every query head (`enable_gqa`): each K/V head's g = nh / kvh query heads become g x L query
rows of that head, with the mask folded to match (`fold_mask`). Checked against the expanded call that
`transformers` makes (SDPA with `enable_gqa`, and an explicit `repeat_interleave` of K/V): within float
rounding, for MHA, GQA and MQA, with and without masks of several shapes. (Bitwise for L > 1 on the VMs of sessions
17-24; on an AVX-512 one the folded g x L rows take another blocking for L = 3, and the last bits differ.)
The greedy-losslessness tests do not depend on it: the engine runs the folded call in every path. Nothing is
faked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tlt.model.layer_ops import fold_mask, grouped_sdpa

SCRIPTED = torch.jit.script(grouped_sdpa)  # as the engine's TorchScript layers compile it


def _expanded(q, k, v, mask, scale):  # noqa: ANN001, ANN202
    """The reference: K/V repeated per query head (HF's `repeat_kv`), a plain SDPA call."""
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          attn_mask=mask, scale=scale)


@pytest.mark.parametrize("nh,kvh", [(4, 4), (4, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("q_len", [1, 3, 13])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "per-row"])
def test_grouped_sdpa_is_the_expanded_attention(nh, kvh, q_len, mask_kind):
    torch.manual_seed(nh * 100 + kvh * 10 + q_len)
    b, s, d = 5, 40, 16
    q = torch.randn(b, q_len, nh, d).transpose(1, 2)  # the engine's strided [B, nh, L, d] view
    k, v = torch.randn(b, kvh, s, d), torch.randn(b, kvh, s, d)
    mask = None
    if mask_kind == "causal":  # the verify/prefill mask: cached keys, then causal among the new ones
        ctx = s - q_len
        j, i = torch.arange(s)[None, :], torch.arange(q_len)[:, None]
        mask = ((j < ctx) | (j - ctx <= i))[None, None].expand(b, 1, q_len, s).contiguous()
    elif mask_kind == "per-row":  # a decode batch's unequal contexts
        lens = torch.randint(1, s + 1, (b,))
        mask = (torch.arange(s)[None, :] < lens[:, None])[:, None, None, :].expand(b, 1, q_len, s).contiguous()
    scale = d**-0.5
    got = grouped_sdpa(q, k, v, fold_mask(mask, nh // kvh), scale)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=nh != kvh)
    assert got.shape == (b, nh, q_len, d)
    if nh == kvh:  # nothing folded: the same call
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, _expanded(q, k, v, mask, scale), rtol=1e-5, atol=1e-6)
    assert torch.equal(SCRIPTED(q, k, v, fold_mask(mask, nh // kvh), scale), got)


def test_fold_mask_repeats_rows_per_query_head_and_leaves_broadcastable_masks():
    m = torch.rand(2, 1, 3, 7) > 0.5
    folded = fold_mask(m, 2)
    assert folded.shape == (2, 1, 6, 7)
    assert torch.equal(folded[:, :, :3], m) and torch.equal(folded[:, :, 3:], m)  # row m * L + i = mask row i
    one_row = torch.rand(2, 1, 1, 7) > 0.5
    assert fold_mask(one_row, 2) is one_row and fold_mask(m, 1) is m and fold_mask(None, 4) is None


def test_an_sdpa_output_in_cudas_transposed_layout_is_reshaped_not_viewed(monkeypatch):
    """CUDA's memory-efficient SDPA returns its [b, kvh, g * L, d] output as a transposed [b, g * L, kvh, d]
    buffer, which `.view(b, nh, L, d)` refused on the H200 (session 30: all 7 of tests/test_engine_cuda.py failed in
    prefill). The same values in that layout, made here on the CPU, must give the same attention."""
    torch.manual_seed(7)
    b, nh, kvh, q_len, s, d = 3, 6, 2, 5, 20, 16
    q = torch.randn(b, q_len, nh, d).transpose(1, 2)
    k, v = torch.randn(b, kvh, s, d), torch.randn(b, kvh, s, d)
    want = grouped_sdpa(q, k, v, None, None)
    sdpa = F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        o = sdpa(*args, **kwargs)  # [b, kvh, g * L, d] contiguous -> the same values, heads innermost but one
        return o.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_layout)
    got = grouped_sdpa(q, k, v, None, None)  # the Python function, as CUDA tensors run it (layer_ops.cpu_scripted)
    assert torch.equal(got, want)
