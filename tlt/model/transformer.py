"""The native decoder (Qwen2 / Qwen3 / Llama dense) over a paged KV cache.

Plain single-device PyTorch, functional and fused where it saves work
(q/k/v in one matmul, gate/up in one matmul). One forward serves prefill
chunks, single-token decode and speculative verify passes:

    forward(input_ids [T], positions [T], attn: AttentionMetadata) -> hidden [T, H]
    compute_logits(hidden [R, H]) -> logits [R, V]       # only for the rows needed

`T` is the flattened batch: sequence b contributes `q_lens[b]` new tokens.
Each new token's K/V is written at `slot_mapping` first, then every query
attends to its sequence's cached tokens plus the new tokens allowed by the
(optional) per-sequence mask among new tokens (default causal; a tree mask
for speculative verification). Requirement: the new tokens of sequence b
sit at cache positions context_lens[b] .. context_lens[b]+q_lens[b]-1 of its
block table (their RoPE `positions` may differ, e.g. tree nodes at the same
depth share a position). `copy_slots` moves accepted tokens' K/V afterwards.

The per-step attention metadata (`AttentionMetadata`) and the grouped attention every layer runs
(`attend_groups`) live in `tlt.model.attention`.

KV layout per layer (shared with the Triton kernels):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

Two implementations, chosen once per model (`kernels`, the engine's `EngineConfig.kernels`):

- "torch" (every CPU run, and CUDA when asked): attention is the PyTorch
  reference: gather each sequence's K/V blocks through its block table, pad
  the batch to its longest context, one SDPA call per group (decode rows and
  extend rows are separate groups so a long prefill does not pad every decode
  row). The layer maths around attention lives in `layer_ops` (TorchScript;
  oneDNN packed, norm-folded weights on CPU). Plain decode steps (one new
  token per sequence, no tree) skip the gather: they read a dense copy of the
  batch's K/V that each step appends to in place (`decode_mirror`, rebuilt
  when the batch changes; bitwise the same output).
- "triton" (the default on CUDA; on CPU only under TRITON_INTERPRET=1, for
  tests): `kernel_ops` runs RMSNorm and residual-add + RMSNorm, RoPE and, for
  decode rows and speculative verify trees, paged attention as the Triton
  kernels of `tlt.kernels`, straight over the cache above; prefill chunks keep
  SDPA. The kernels' int32 block tables, context lengths and padded tree masks
  are built once per step in `AttentionMetadata.build(for_kernels=True)`.
  Checked by the interpreter run on CPU (tests/test_engine_kernels.py, parity with "torch") and compiled
  on an H200 (tests/test_engine_cuda.py, session 30).

The HF named tensors stay the source of truth and `prepare_kernels`
rederives what the layers use after every load, so hot swaps and cold starts
are one path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tlt.kernels.launch import Impl, resolve_impl
from tlt.model.config import ModelConfig
from tlt.model.decode_mirror import DecodeMirror, MirrorStep
from tlt.model.attention import AttentionGroup, AttentionMetadata, KernelTables, attend_groups  # noqa: F401 (re-exported)
from tlt.model.layer_ops import (
    dense_attention_fn,
    gpu_sdpa,
    linear,
    onednn_works,
    pack,
    post_attention_fn,
    pre_attention_fn,
    rms,
)


# ----------------------------------------------------------------------------- pure maths


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32 like HF, returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama-3 / linear scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
    # llama3: long wavelengths scaled down by `factor`, short kept, smooth blend between.
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    wl = 2 * math.pi / inv
    scaled = torch.where(wl > low_wl, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wl >= high_wl) & (wl <= low_wl)
    return torch.where(medium, smoothed, scaled)


def rope_table(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim] in fp32, HF rotate-half layout (freqs repeated twice)."""
    t = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """(-sin_1, sin_2): with it RoPE is x * cos + roll(x, d/2) * signed_sin (see `layer_ops`)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


# ----------------------------------------------------------------------------- model


class _Layer:
    """One decoder layer's weights, fused: qkv [q+2kv, H], gate_up [2I, H]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        h, e = cfg.hidden_size, dict(dtype=dtype, device=device)
        self.ln1 = torch.ones(h, **e)
        self.ln2 = torch.ones(h, **e)
        self.qkv = torch.zeros(cfg.q_size + 2 * cfg.kv_size, h, **e)
        self.qkv_bias = torch.zeros(cfg.q_size + 2 * cfg.kv_size, **e) if cfg.attention_bias else None
        self.o = torch.zeros(h, cfg.q_size, **e)
        # Qwen3 per-head q/k norm weights laid out for the joint [nh + kvh, d] q/k tensor
        self.qk_norm = torch.ones(cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, **e) if cfg.qk_norm else None
        self.gate_up = torch.zeros(2 * cfg.intermediate_size, h, **e)
        self.down = torch.zeros(h, cfg.intermediate_size, **e)
        # what the kernels consume (packed / norm-folded on CPU), set by Transformer.prepare_kernels
        self.k_qkv = self.k_o = self.k_gate_up = self.k_down = self.qkv
        self.k_ln1: torch.Tensor | None = self.ln1
        self.k_ln2: torch.Tensor | None = self.ln2


class Transformer:
    """Functional decoder; weights are plain tensors addressed by HF names via `_targets`.

    kernels: "auto" (Triton on CUDA when it imports, PyTorch elsewhere), "torch" or "triton" (on CPU
    only under TRITON_INTERPRET=1); resolved once here, `self.kernels` is "torch" or "triton".
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu", max_len: int | None = None,
                 kernels: Impl = "torch"):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.kernels = resolve_impl(kernels, self.device)
        if self.kernels == "triton":  # imported only here: it imports triton.language
            from tlt.model import kernel_ops

            self._ko = kernel_ops
        e = dict(dtype=dtype, device=self.device)
        self.embed = torch.zeros(cfg.vocab_size, cfg.hidden_size, **e)
        self.lm_head = self.embed if cfg.tie_word_embeddings else torch.zeros(cfg.vocab_size, cfg.hidden_size, **e)
        self.norm = torch.ones(cfg.hidden_size, **e)
        self.layers = [_Layer(cfg, dtype, self.device) for _ in range(cfg.num_layers)]
        cos, sin = rope_table(cfg, max_len or cfg.max_position_embeddings)
        self.cos, self.sin = cos.to(**e), sin.to(**e)
        self.sin_signed = signed_sin(self.sin)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.k_flat: list[torch.Tensor] = []  # the same caches viewed as [num_blocks * block_size, kvh, d]
        self.v_flat: list[torch.Tensor] = []
        self.mirror: DecodeMirror | None = None  # "torch" kernels: plain decode steps skip the gather (decode_mirror)
        self.scale = cfg.head_dim**-0.5
        self._eps = torch.tensor(cfg.rms_norm_eps, dtype=torch.float32, device=self.device)
        # the Triton path reads the HF-layout weights (never packed / norm-folded)
        self._use_onednn = self.device.type == "cpu" and self.kernels == "torch" and onednn_works(dtype)
        self._exact_hf = dtype != torch.float32  # low precision: RMSNorm in HF's exact order
        self.k_lm_head = self.lm_head

    # ---- weights
    def _targets(self) -> dict[str, torch.Tensor]:
        """HF name -> the view of our tensor it fills."""
        cfg = self.cfg
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head
        for i, L in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = L.ln1
            out[p + "post_attention_layernorm.weight"] = L.ln2
            out[p + "self_attn.q_proj.weight"] = L.qkv[:q]
            out[p + "self_attn.k_proj.weight"] = L.qkv[q : q + kv]
            out[p + "self_attn.v_proj.weight"] = L.qkv[q + kv :]
            out[p + "self_attn.o_proj.weight"] = L.o
            if L.qkv_bias is not None:
                out[p + "self_attn.q_proj.bias"] = L.qkv_bias[:q]
                out[p + "self_attn.k_proj.bias"] = L.qkv_bias[q : q + kv]
                out[p + "self_attn.v_proj.bias"] = L.qkv_bias[q + kv :]
            if L.qk_norm is not None:
                out[p + "self_attn.q_norm.weight"] = L.qk_norm[: cfg.num_heads]  # broadcast copy per head
                out[p + "self_attn.k_norm.weight"] = L.qk_norm[cfg.num_heads :]
            out[p + "mlp.gate_proj.weight"] = L.gate_up[:inter]
            out[p + "mlp.up_proj.weight"] = L.gate_up[inter:]
            out[p + "mlp.down_proj.weight"] = L.down
        return out

    @torch.inference_mode()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in place (callers validate first with loader.validate_tensors)."""
        targets = self._targets()
        for name, t in tensors.items():
            if name in targets:
                targets[name].copy_(t)
        self.prepare_kernels()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor in HF shape (q/k norm weights are stored once per head here)."""
        return {k: v[0] if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in self._targets().items()}

    # ---- KV cache
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.k_flat = [c.view(-1, shape[2], shape[3]) for c in self.k_caches]
        self.v_flat = [c.view(-1, shape[2], shape[3]) for c in self.v_caches]
        if self.kernels == "torch":
            self.mirror = DecodeMirror(len(self.layers), num_blocks, block_size, shape[2], shape[3], self.dtype, self.device)

    @torch.inference_mode()
    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's K/V from src slots to dst slots (speculative decoding keeps the accepted path)."""
        kvh, d = self.cfg.num_kv_heads, self.cfg.head_dim
        if self.mirror is not None:
            self.mirror.invalidate()
        for cache in (*self.k_caches, *self.v_caches):
            flat = cache.view(-1, kvh, d)
            flat[dst_slots] = flat[src_slots]

    # ---- forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        with gpu_sdpa(input_ids):  # off the CPU, SDPA without cuDNN's per-shape plans (layer_ops), once per forward
            if self.kernels == "triton":
                return self._forward_triton(input_ids, positions, attn)
            return self._forward_torch(input_ids, positions, attn)

    def _forward_torch(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        nh, kvh, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        packed, eps, exact = self._use_onednn, self._eps, self._exact_hf
        cos = self.cos[positions][:, None, :]
        sin = self.sin_signed[positions][:, None, :]
        x = F.embedding(input_ids, self.embed)
        slots = attn.slot_mapping
        step = self._mirror_step(attn)
        scratch: torch.Tensor | None = None  # a rebuilding step's gather buffer, shared by the layers
        pre, dense, post = (f.for_tensor(x) for f in (pre_attention_fn, dense_attention_fn, post_attention_fn))
        for li, L in enumerate(self.layers):
            q = pre(x, L.k_ln1, L.k_qkv, L.qkv_bias, L.qk_norm, packed, eps, exact, cos, sin, self.k_flat[li],
                    self.v_flat[li], slots, nh, kvh, d)
            if step is not None:
                if step.rebuild_index is not None:
                    if scratch is None:
                        scratch = self.k_caches[li].new_empty(step.rebuild_index.shape[0], *self.k_caches[li].shape[1:])
                    self.mirror.rebuild(li, step, self.k_caches[li], self.v_caches[li], scratch)
                kd, vd = self.mirror.views[li]
                o = dense(q, self.k_flat[li], self.v_flat[li], slots, kd, vd, step.append_rows, attn.groups[0].lk,
                          attn.groups[0].mask if step.slots is None else step.slot_mask, self.scale, step.row_of_slot,
                          step.slot_of_row, step.bounds, step.lks)
            else:
                o = attend_groups(q, self.k_caches[li], self.v_caches[li], attn, self.scale)
            x = post(x, o, L.k_o, L.k_ln2, L.k_gate_up, L.k_down, packed, eps, exact, inter)
        if step is not None:
            self.mirror.commit(step)
        return rms(x, self.norm, eps, exact)

    def _mirror_step(self, attn: AttentionMetadata) -> MirrorStep | None:
        """A plain decode step's mirror work (`decode_mirror`); any other forward writes the cache otherwise: invalidate."""
        if self.mirror is None:
            return None
        if attn.tree_masks is None and all(q == 1 for q in attn.q_lens):
            return self.mirror.plan(attn)
        self.mirror.invalidate()
        return None

    __call__ = forward

    def _forward_triton(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The same maths on the Triton kernels (see `kernel_ops`): the residual add fused into the next norm."""
        ko, cfg = self._ko, self.cfg
        nh, kvh, d, inter, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps
        x = F.embedding(input_ids, self.embed)
        h = ko.rmsnorm_triton(x, self.layers[0].ln1, eps)
        for li, L in enumerate(self.layers):
            q = ko.pre_attention(h, L.qkv, L.qkv_bias, L.qk_norm, self._eps, positions, self.cos, self.sin,
                                 self.k_flat[li], self.v_flat[li], attn.slot_mapping, nh, kvh, d)
            o = attend_groups(q, self.k_caches[li], self.v_caches[li], attn, self.scale, ko.attend)
            h, x = ko.fused_add_rmsnorm_triton(F.linear(o, L.o), x, L.ln2, eps)
            gu = F.linear(h, L.gate_up)
            delta = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], L.down)
            nxt = self.layers[li + 1].ln1 if li + 1 < len(self.layers) else self.norm
            h, x = ko.fused_add_rmsnorm_triton(delta, x, nxt, eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.k_lm_head, None, self._use_onednn)

    @torch.inference_mode()
    def prepare_kernels(self) -> None:
        """Point each layer's kernel weights at what the kernels consume; called after every weight load.

        oneDNN (CPU, kernels="torch"): packed copies with the preceding RMSNorm weight folded in (so
        the norm applies none). Otherwise the HF-layout tensors themselves (views, no copy); the
        Triton path (`_forward_triton`) reads those directly.
        """
        for L in self.layers:
            if self._use_onednn:
                L.k_qkv, L.k_o = pack(L.qkv * L.ln1[None, :]), pack(L.o)
                L.k_gate_up, L.k_down = pack(L.gate_up * L.ln2[None, :]), pack(L.down)
                L.k_ln1 = L.k_ln2 = None
            else:
                L.k_qkv, L.k_o, L.k_gate_up, L.k_down, L.k_ln1, L.k_ln2 = L.qkv, L.o, L.gate_up, L.down, L.ln1, L.ln2
        self.k_lm_head = pack(self.lm_head) if self._use_onednn else self.lm_head


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype=torch.float32, device="cpu", max_len=None,
                kernels: Impl = "torch") -> Transformer:
    model = Transformer(cfg, dtype=dtype, device=device, max_len=max_len, kernels=kernels)
    model.load_weights(tensors)
    return model
