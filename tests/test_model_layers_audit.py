"""Audit of the native model's layer maths (`layer_ops`, `transformer`, `kernel_ops`): cases the parity tests miss.

The parity tests (tests/test_model_parity.py) run fp32 on a CPU with oneDNN, so three paths the model takes
elsewhere went unchecked: low-precision RMSNorm in HF's exact order (every bf16/fp16 model), the unpacked
linears with the norm weights applied by `rms` (CPU builds without oneDNN, CUDA with kernels="torch"), and the
Triton path's Qwen3 q/k norms in bf16.
Each test names the mutant of the audit it pins (L-* layer_ops, T-* transformer, K-* kernel_ops). References:
`transformers` modules and models built tiny in code, float64, or the expanded SDPA call. Nothing is downloaded or
faked (the Triton path's RoPE runs as the rotary kernel's PyTorch reference, as tests/test_engine_kernels.py does).
"""

from __future__ import annotations

import copy
import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from test_model_parity import BLOCK, native_from_hf, random_hf_model

from tlt.model import transformer as transformer_mod
from tlt.model.config import ModelConfig
from tlt.model.layer_ops import grouped_sdpa, rms
from tlt.model.transformer import AttentionMetadata, rms_norm, rope_inv_freq


@pytest.fixture(autouse=True)
def _two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _hf_norm(weight: torch.Tensor, eps: float) -> Qwen2RMSNorm:
    norm = Qwen2RMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def _rows(dtype: torch.dtype, hidden: int = 64) -> torch.Tensor:
    """Random rows of several magnitudes, one of them all zeros (eps alone keeps it finite)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(24, hidden, generator=g) * torch.logspace(-3, 2, 24)[:, None]
    x[5] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [1e-6, 0.25])
def test_low_precision_rms_is_hfs_rmsnorm_bitwise(dtype, eps):
    """L-4 (eps dropped), L-7 (no cast back before the weight: fp32 out), L-11 (fp32 formula in low precision), and
    T-1 / T-2 for `transformer.rms_norm` (the drafter's norm): bitwise HF's Qwen2RMSNorm, in the input's dtype."""
    x = _rows(dtype)
    w = (1 + 0.5 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(2))).to(dtype)
    with torch.no_grad():
        want = _hf_norm(w, eps)(x)
        want_unweighted = _hf_norm(torch.ones_like(w), eps)(x)
    assert torch.isfinite(want).all()
    for got in (rms(x, w, torch.tensor(eps), True), rms_norm(x, w, eps)):
        assert got.dtype == dtype
        assert torch.equal(got, want)
    got = rms(x, None, torch.tensor(eps), True)  # the q/k norm's form: weight applied by the caller
    assert got.dtype == dtype and torch.equal(got, want_unweighted)


def test_fp32_rms_is_the_float64_formula_with_its_eps():
    """The fp32 form (||x||^2 / H + eps) against float64, with an eps large enough to matter and a zero row."""
    x = _rows(torch.float32)
    w = 1 + 0.5 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(3))
    x64, w64 = x.double(), w.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 0.25) * w64
    got = rms(x, w, torch.tensor(0.25), False)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_grouped_sdpa_honours_its_scale_when_it_folds_query_heads():
    """L-23: the folded (GQA) call passed no scale, so SDPA's default 1/sqrt(d) replaced the caller's. Latent
    today (every caller passes 1/sqrt(d) or None) but the function's contract; the MHA branch already honours it."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.9)
    torch.testing.assert_close(grouped_sdpa(q, k, v, None, 0.9), want, rtol=1e-5, atol=1e-6)


def test_llama3_rope_wavelength_exactly_at_low_freq_wavelen_is_smoothed_as_transformers_does(tmp_path):
    """T-27: transformers' llama3 scaling counts a wavelength equal to either bound as "medium" (smoothed); strict
    bounds served the unscaled frequency there. low_freq_factor = 16 / 2pi puts the first frequency's wavelength
    (2pi) exactly on original_max_position_embeddings / low_freq_factor."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
           "max_position_embeddings": 64, "rope_theta": 5e5,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 16 / (2 * math.pi),
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    want = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg).inv_freq.float()
    assert want[0].item() == pytest.approx(1 / 8.0, rel=1e-3)  # the boundary frequency, smoothed to 1/factor
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_hf(copy.deepcopy(raw))), want, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- whole models against transformers


def _hf_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """test_model_parity's random model, norms and biases further from their init values (0.3), in `dtype`."""
    hf_cfg, model = random_hf_model(family, tie=False, seed=seed, spread=0.3)
    return hf_cfg, model.to(dtype)


def _native(hf_cfg, model, dtype=torch.float32):
    return native_from_hf(hf_cfg, model, dtype=dtype)[1]


def _prefill_decode_verify(native, model) -> None:
    """A chunked prefill of two sequences, a batched decode step, then a tree verify of the second: each
    row's logits within 1e-4 of transformers' on the same tokens."""
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (13, 9)]
    tables = [list(range(0, 12)), list(range(12, 24))]
    build = functools.partial(AttentionMetadata.build, block_size=BLOCK)

    def check(toks, pos, meta, refs, rows=None):
        with torch.inference_mode():
            logits = native.compute_logits(native(torch.tensor(toks), torch.tensor(pos), meta))
        for row, ref in zip(logits if rows is None else logits[rows], refs):
            with torch.no_grad():
                want = model(torch.tensor([ref])).logits[0, -1]
            err = (row - want).abs().max().item()
            assert err <= 1e-4, err

    check(seqs[0][:7] + seqs[1][:8], list(range(7)) + list(range(8)), build([7, 8], [0, 0], tables),
          [seqs[0][:7], seqs[1][:8]], rows=[6, 14])
    check(seqs[0][7:12], list(range(7, 12)), build([5], [7], tables[:1]), [seqs[0][: i + 1] for i in range(7, 12)])
    check([seqs[0][12], seqs[1][8]], [12, 8], build([1, 1], [12, 8], tables), [seqs[0], seqs[1]])
    # tree over seq 1: node0 and node2 children of the root, node1 child of node0
    nodes = [5, 17, 40]
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    paths = [seqs[1] + [5], seqs[1] + [5, 17], seqs[1] + [40]]
    check(nodes, [9, 10, 9], build([3], [9], tables[1:], tree_masks=[mask]), paths)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_unpacked_linears_apply_every_norm_weight(monkeypatch, family):
    """L-20: without oneDNN (CPU builds lacking it, CUDA with kernels="torch") the linears are plain F.linear and
    `rms` applies ln1 / ln2 itself; post_attention dropping ln2 went unseen, as the parity tests run packed."""
    monkeypatch.setattr(transformer_mod, "onednn_works", lambda dtype: False)
    hf_cfg, model = _hf_model(family)
    native = _native(hf_cfg, model)
    assert not native._use_onednn
    _prefill_decode_verify(native, model)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_bf16_models_final_norm_is_hfs_bitwise(family):
    """T-10 / L-11: a bf16 model normalises in HF's exact order (fp32, cast back, then the weight), not the fp32
    formula. With every layer's projections zero the residual stream is the embedding, so the model's hidden state
    is the final RMSNorm alone: bitwise transformers' last hidden state."""
    hf_cfg, model = _hf_model(family, dtype=torch.bfloat16, seed=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and "norm" not in name:
                p.zero_()
    native = _native(hf_cfg, model, dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (21,), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        got = native(ids, torch.arange(21), AttentionMetadata.build([21], [0], [list(range(8))], BLOCK))
        want = model.model(ids[None]).last_hidden_state[0]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_kernel_path_qk_norm_in_bf16_is_hfs_bitwise(monkeypatch):
    """K-3 (and K-1): the Triton path's Qwen3 q/k norms run in HF's exact order in bf16: at position 0 (RoPE the
    identity) q and the cached k are bitwise transformers' q_norm / k_norm of the projections."""
    from tlt.kernels.rotary import apply_rotary
    from tlt.model import kernel_ops

    monkeypatch.setattr(kernel_ops, "apply_rotary_triton", functools.partial(apply_rotary, impl="torch"))
    g = torch.Generator().manual_seed(6)
    t, hid, nh, kvh, d = 6, 32, 4, 2, 16
    bf = torch.bfloat16
    h = torch.randn(t, hid, generator=g).to(bf)
    qkv_w = (torch.randn((nh + 2 * kvh) * d, hid, generator=g) * 0.3).to(bf)
    qn, kn = (1 + 0.5 * torch.randn(d, generator=g)).to(bf), (1 + 0.5 * torch.randn(d, generator=g)).to(bf)
    norm = torch.cat([qn.expand(nh, d), kn.expand(kvh, d)])
    cos, sin = torch.ones(4, d, dtype=bf), torch.zeros(4, d, dtype=bf)
    k_flat, v_flat = torch.zeros(10, kvh, d, dtype=bf), torch.zeros(10, kvh, d, dtype=bf)
    slots = torch.tensor([3, 0, 7, 1, 9, 4])
    q = kernel_ops.pre_attention(h, qkv_w, None, norm, torch.tensor(1e-6), torch.zeros(t, dtype=torch.long), cos, sin,
                                 k_flat, v_flat, slots, nh, kvh, d)
    proj = F.linear(h, qkv_w)
    with torch.no_grad():
        want_q = _hf_norm(qn, 1e-6)(proj[:, : nh * d].view(t, nh, d))
        want_k = _hf_norm(kn, 1e-6)(proj[:, nh * d : (nh + kvh) * d].view(t, kvh, d))
    assert torch.equal(q, want_q)
    assert torch.equal(k_flat[slots], want_k)
    assert torch.equal(v_flat[slots], proj[:, (nh + kvh) * d :].view(t, kvh, d))
