"""Rotary embedding: reference against HF Qwen2 and hand values, Triton kernel against reference.

The "interpreter" cases need TRITON_INTERPRET=1 from process start: they run in
the child process of tests/test_kernels_interpreter.py and skip elsewhere. The
"cuda" cases run the compiled kernel on a GPU (marked `gpu`). Nothing is faked.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_params import DEVICE_DTYPES, DEVICES, device  # noqa: F401 - device is a fixture
from tlt.kernels.rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton, rope_cache

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def test_reference_equals_hf_qwen2_fp32() -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    head_dim, base = 16, 10000.0
    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, rope_theta=base)
    torch.manual_seed(0)
    q, k = torch.randn(9, 4, head_dim), torch.randn(9, 2, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 3, 64, 100, 127, 5])
    hf_cos, hf_sin = Qwen2RotaryEmbedding(config)(q, positions[None])  # [1, T, D], halves repeated
    cos, sin = rope_cache(128, head_dim, base)
    assert torch.equal(cos[positions], hf_cos[0, :, : head_dim // 2])
    assert torch.equal(sin[positions], hf_sin[0, :, : head_dim // 2])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    got_q, got_k = apply_rotary_ref(q, k, positions, cos, sin)
    assert torch.equal(got_q, hf_q[0].transpose(0, 1))
    assert torch.equal(got_k, hf_k[0].transpose(0, 1))
    # The HF cache layout [max_pos, D] (halves repeated) gives the same result.
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    assert torch.equal(apply_rotary_ref(q, k, positions, full_cos, full_sin)[0], got_q)


def test_reference_hand_values() -> None:
    # D = 2: one frequency, inv_freq = 1, angle = position. [1, 0] rotates to [cos p, sin p];
    # [0, 1] to [-sin p, cos p].
    cos, sin = rope_cache(4, 2, 10000.0)
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    k = torch.tensor([[[2.0, 0.0]], [[0.0, 0.0]]])
    positions = torch.tensor([1, 3])
    got_q, got_k = apply_rotary_ref(q, k, positions, cos, sin)
    want_q = torch.tensor([[[math.cos(1), math.sin(1)]], [[-math.sin(3), math.cos(3)]]])
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, torch.tensor([[[2 * math.cos(1), 2 * math.sin(1)]], [[0.0, 0.0]]]))


# (tokens, Hq, Hkv, D): GQA ratios 1, 2, 4, 4; non-power-of-2 heads and half dims.
CONFIGS = [(1, 1, 1, 2), (5, 4, 4, 16), (7, 6, 3, 24), (6, 8, 2, 16), (3, 12, 3, 40)]


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES, indirect=["device"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_kernel_matches_reference(device: torch.device, dtype: torch.dtype, config: tuple[int, int, int, int]) -> None:
    tokens, hq, hkv, dim = config
    gen = torch.Generator().manual_seed(sum(config))
    q = torch.randn(tokens, hq, dim, generator=gen).to(dtype).to(device)
    k = torch.randn(tokens, hkv, dim, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(device)
    cos, sin = rope_cache(50, dim, 1e6, device=device)
    want_q, want_k = apply_rotary_ref(q, k, positions, cos, sin)

    q_out = torch.full_like(q, float("nan"))  # poison: unwritten elements fail
    k_out = torch.full_like(k, float("nan"))
    got_q, got_k = apply_rotary_triton(q, k, positions.to(torch.int32), cos, sin, q_out=q_out, k_out=k_out)
    assert got_q is q_out and got_k is k_out
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])

    # HF cache layout [max_pos, D], in place: q and k are overwritten with the same values.
    q2, k2 = q.clone(), k.clone()
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    res_q, res_k = apply_rotary(q2, k2, positions, full_cos, full_sin, inplace=True, impl="triton")
    assert res_q is q2 and res_k is k2
    torch.testing.assert_close(q2, got_q, rtol=0, atol=0)
    torch.testing.assert_close(k2, got_k, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_kernel_on_views_of_fused_qkv(device: torch.device) -> None:
    torch.manual_seed(3)
    tokens, hq, hkv, dim = 5, 4, 2, 8
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, device=device)
    q = qkv[:, : hq * dim].view(tokens, hq, dim)  # token stride (hq + 2 hkv) * dim: not contiguous
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(tokens, hkv, dim)
    positions = torch.tensor([4, 0, 9, 2, 2], device=device)
    cos, sin = rope_cache(16, dim, 10000.0, device=device)
    want_q, want_k = apply_rotary_ref(q, k, positions, cos, sin)
    v_before = qkv[:, (hq + hkv) * dim :].clone()
    apply_rotary(q, k, positions, cos, sin, inplace=True, impl="triton")
    torch.testing.assert_close(q, want_q, **TOL[torch.float32])
    torch.testing.assert_close(k, want_k, **TOL[torch.float32])
    assert torch.equal(qkv[:, (hq + hkv) * dim :], v_before)  # v untouched


def test_wrapper_rejects_bad_inputs() -> None:
    cos, sin = rope_cache(8, 8, 10000.0)
    q, k, pos = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="cache must be"):
        apply_rotary_triton(q, k, pos, cos[:, :3], sin)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_triton(q, k, pos.float(), cos, sin)
    with pytest.raises(ValueError, match="does not match"):
        apply_rotary_triton(q, torch.randn(2, 1, 8), pos, cos, sin)
