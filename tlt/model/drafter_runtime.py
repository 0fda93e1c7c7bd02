"""DrafterRuntime: the rollout engine's inference path for the EAGLE drafter (same maths, fewer ops).

`Drafter.forward` (an nn.Module, what the drafter service trains) costs ~0.5 ms per call on one CPU
core for the tiny model, almost all of it per-op overhead: eight module calls, RoPE recomputed from
the frequencies, the cache mask built from a dozen small tensors. A tree or chain draft makes up to
eight such calls per verify step, which decided whether speculation paid off at all on CPU.

Here the layer is one TorchScript function (on CPU; `layer_ops.cpu_scripted`) over fused weights (q/k/v
in one matmul, gate/up in one, oneDNN-packed on CPU with the post-attention RMSNorm weight folded in, as
`layer_ops` does for the target), RoPE reads a precomputed table, and the cache mask comes from
`Drafter.cache_mask`, the one definition both paths share. Results equal `Drafter.forward` up to float rounding
(`tests/test_drafter_runtime.py`); which tokens get drafted can only change the acceptance rate,
never the output (verification is exact).

`refresh()` re-derives the fused weights: call it after every drafter weight load (the engine's
drafter hot-swap does, through `EagleSource.reset`). The target's embed / lm_head are read by
reference at each call, so policy updates need nothing here.
"""

from __future__ import annotations

from typing import List, Optional, Tuple  # noqa: UP035 - TorchScript needs typing generics

import torch
import torch.nn.functional as F

from tlt.model.drafter import Drafter, DrafterCache
from tlt.model.layer_ops import cpu_scripted, fold_mask, grouped_sdpa, linear, onednn_works, pack, rms
from tlt.model.transformer import rope_table, signed_sin


def drafter_layer(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor],  # noqa: UP045
    o_w: torch.Tensor, ln2: Optional[torch.Tensor], gu_w: torch.Tensor, down_w: torch.Tensor,  # noqa: UP045
    packed: bool, eps: torch.Tensor, exact_hf: bool, ck: torch.Tensor, cv: torch.Tensor, rows: torch.Tensor,
    slots: torch.Tensor, span: int, mask: Optional[torch.Tensor], nh: int, kvh: int, d: int, inter: int,  # noqa: UP045
    first_row: int = -2,
) -> torch.Tensor:
    """x [B, T, H] (after fc) -> h' [B, T, H]; writes the new K/V to cache rows `rows` at `slots` [B, T].

    cos / sin_signed [B, T, 1, d]; ck / cv [rows, kvh, capacity, d]; keys are the first `span` cache
    positions of each row; mask [B, 1, T, span] (None: every key visible). Weights are packed (oneDNN,
    `packed`) or plain HF layout; with plain weights `ln2` is the norm weight, else it is folded in.
    first_row: `_first_row(rows)` when the caller knows it (a chain's rows are the same at every step), else -2.
    """
    b, t, hdim = x.shape[0], x.shape[1], x.shape[2]
    x2 = x.reshape(b * t, hdim)
    qkv = linear(x2, qkv_w, qkv_b, packed)  # no input norm before the drafter's attention (EAGLE)
    qk_size = (nh + kvh) * d
    qk = qkv[:, :qk_size].reshape(b, t, nh + kvh, d)
    qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
    ck[rows[:, None], :, slots] = qk[:, :, nh:]
    cv[rows[:, None], :, slots] = qkv[:, qk_size:].reshape(b, t, kvh, d)
    q = qk[:, :, :nh].transpose(1, 2)
    r0 = _first_row(rows) if first_row == -2 else first_row
    if r0 >= 0:  # consecutive rows (always at batch 1):
        k = ck.narrow(0, r0, b)[:, :, :span]  # views, nothing copied
        v = cv.narrow(0, r0, b)[:, :, :span]
    else:  # a row copy (index_select; ck[rows] would be a much slower per-element gather)
        k = ck[:, :, :span].index_select(0, rows)
        v = cv[:, :, :span].index_select(0, rows)
    o = grouped_sdpa(q, k, v, fold_mask(mask, nh // kvh), None)  # GQA without copying K/V (layer_ops)
    x2 = x2 + linear(o.transpose(1, 2).reshape(b * t, nh * d), o_w, None, packed)
    gu = linear(rms(x2, ln2, eps, exact_hf), gu_w, None, packed)
    x2 = x2 + linear(F.silu(gu[:, :inter]) * gu[:, inter:], down_w, None, packed)
    return x2.view(b, t, hdim)


def _first_row(rows: torch.Tensor) -> int:
    """rows[0] when `rows` are consecutive (r0, r0 + 1, ...: the cache rows are views), else -1."""
    r0 = int(rows[0])
    return r0 if bool((rows == torch.arange(r0, r0 + rows.shape[0], device=rows.device)).all()) else -1


def chain_draft(
    h: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor, fc_w: torch.Tensor, qkv_w: torch.Tensor,
    qkv_b: Optional[torch.Tensor], o_w: torch.Tensor, ln2: Optional[torch.Tensor], gu_w: torch.Tensor,  # noqa: UP045
    down_w: torch.Tensor, packed: bool, eps: torch.Tensor, exact_hf: bool, ck: torch.Tensor, cv: torch.Tensor,
    rows: torch.Tensor, committed: torch.Tensor, root_pos: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor,
    depth: int, nh: int, kvh: int, d: int, inter: int, min_score: float,
    params: Optional[torch.Tensor] = None, u: Optional[torch.Tensor] = None,  # noqa: UP045
    span_cap: int = 0, filter_flags: int = -1,
) -> List[torch.Tensor]:  # noqa: UP006
    """A chain of up to `depth` drafts from each row's root output h [B, H] -> [tokens [B, D], cumulative
    draft log-probs [B, D], draft distributions [B, D, V] (empty when greedy)]. Greedy (u None): each
    draft is the drafter's argmax. Sampled (u [B, depth] uniforms, params [B, 4] = temperature > 0,
    top_k, top_p, min_p): draft k is drawn by inverse CDF with u[:, k] from p_k, the drafter's
    distribution under those filters (`_draft_probs`), and p_k is returned for rejection sampling.
    Draft k (k >= 1) is fed as the pair (token k-1, h' that produced it) at position root_pos + k and
    cache offset committed + k - 1; the caller rolls the rows back afterwards. Stops early (D < depth)
    once every row's cumulative log-prob is below `min_score` (the scores only fall, so no row could
    keep a deeper draft); min_score = -inf never checks.

    For a CUDA graph (`drafter_graphs.ChainGraphs`), nothing may read the device from the host: span_cap > 0 attends
    over that many cache positions at every step, each row's keys past its own end masked (the same result as the
    per-step span, which reads the rows' longest length), gathers the rows' K/V by index (no test for consecutive
    rows), and filter_flags (bit 0: some row has top_k / top_p, bit 1: some row has min_p) is given instead of
    read from `params`; min_score must then be -inf."""
    probs: List[torch.Tensor] = []  # noqa: UP006
    # which filters any row uses, read once: most RL rollouts sample at a temperature with none, and the sort,
    # cumsum and scatter of top_k / top_p then change nothing but cost a third of a drafting step at batch 1
    filtered, min_p = True, True
    if filter_flags >= 0:
        filtered, min_p = (filter_flags & 1) != 0, (filter_flags & 2) != 0
    elif params is not None:
        filtered = bool(((params[:, 1] > 0) | (params[:, 2] < 1.0)).any())
        min_p = bool((params[:, 3] > 0).any())
    score, tok, p = _pick(F.linear(h, lm_head).float(), params, u, 0, filtered, min_p)
    if p is not None:
        probs.append(p)
    toks = [tok]
    scores = [score]
    if span_cap > 0:
        equal, longest, first_row = False, 0, -1
    else:
        equal = bool((committed == committed[0]).all())
        longest = int(committed.max())
        first_row = _first_row(rows)
    # every step's rotary rows at once (draft k sits at root_pos + k): one gather per table instead of two per step
    at = (root_pos[:, None] + torch.arange(1, max(depth, 1), device=h.device)[None, :]).flatten()
    cos_c = cos_t.index_select(0, at).view(h.shape[0], max(depth - 1, 0), cos_t.shape[-1])
    sin_c = sin_t.index_select(0, at).view(h.shape[0], max(depth - 1, 0), sin_t.shape[-1])
    for step in range(1, depth):
        if min_score > float("-inf") and bool((score < min_score).all()):
            break
        start = committed + (step - 1)
        span = span_cap if span_cap > 0 else longest + step
        # `Drafter.cache_mask` for one new token per row (that function is not scriptable): with rows of
        # different lengths, hide keys past each row's own end; otherwise every key is visible
        mask: Optional[torch.Tensor] = None  # noqa: UP045
        if not equal:
            mask = (torch.arange(span, device=h.device)[None, :] <= start[:, None])[:, None, None, :]
        x = linear(torch.cat([F.embedding(tok, embed).to(h.dtype), h], -1), fc_w, None, packed)
        h = drafter_layer(x[:, None], cos_c[:, step - 1, None, None], sin_c[:, step - 1, None, None], qkv_w, qkv_b,
                          o_w, ln2, gu_w, down_w, packed, eps,
                          exact_hf, ck, cv, rows, start[:, None], span, mask, nh, kvh, d, inter, first_row)[:, 0]
        best, tok, p = _pick(F.linear(h, lm_head).float(), params, u, step, filtered, min_p)
        if p is not None:
            probs.append(p)
        score = score + best
        toks.append(tok)
        scores.append(score)
    return [torch.stack(toks, 1), torch.stack(scores, 1), torch.stack(probs, 1) if len(probs) > 0 else torch.empty(0)]


def _draft_probs(logits: torch.Tensor, params: torch.Tensor, filtered: bool = True, min_p: bool = True) -> torch.Tensor:
    """softmax of the logits under each row's sampling filters, params [B, 4] = (temperature, top_k,
    top_p, min_p) (top_k <= 0, top_p >= 1, min_p <= 0: off): the same filters as the target's q
    (`spec/filters.py`), so the drafts land on the tokens q can give. Any p keeps rejection sampling
    exact; a p close to q is accepted more often. filtered=False (no row has top_k or top_p) and
    min_p=False (no row has min_p) skip those filters: bitwise the same p, as they mask nothing then."""
    x = logits / params[:, 0:1]
    if filtered:  # top_k, then top_p
        v = x.shape[-1]
        k = params[:, 1:2].to(torch.int64)
        sorted_x, order = x.sort(dim=-1, descending=True)  # one sort: the top-k cut keeps the sorted order
        kth = sorted_x.gather(-1, torch.where(k > 0, k.clamp(max=v), torch.full_like(k, v)) - 1)
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        probs = sorted_x.softmax(-1)
        # past the smallest prefix reaching top_p; rows with top_p >= 1 drop nothing (a peaked row's float32
        # cumsum reaches 1.0 before its tail, as in spec/filters.py)
        drop_sorted = ((probs.cumsum(-1) - probs) >= params[:, 2:3]) & (params[:, 2:3] < 1.0)
        x = x.masked_fill((x < kth) | torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    p = x.softmax(-1)
    if min_p:
        p = p.masked_fill(p < params[:, 3:4] * p.amax(-1, keepdim=True), 0.0)
    return p / p.sum(-1, keepdim=True)


def _pick(logits: torch.Tensor, params: Optional[torch.Tensor], u: Optional[torch.Tensor],  # noqa: UP045
          level: int, filtered: bool = True,
          min_p: bool = True) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:  # noqa: UP006, UP045
    """One chain level: (log-prob of the pick, the pick, the distribution drawn from or None) per row."""
    if u is None or params is None:
        best, tok = logits.log_softmax(-1).max(-1)
        return best, tok, None
    p = _draft_probs(logits, params, filtered, min_p)
    # `spec.accept.sample_probs` (not importable into this scripted model code): inverse CDF with u
    cdf = p.cumsum(-1)
    tok = torch.searchsorted(cdf, (u[:, level] * cdf[:, -1])[:, None].contiguous(), right=True)[:, 0]
    last = p.shape[-1] - 1 - (p.flip(-1) > 0).to(torch.int64).argmax(-1)  # never a token of probability 0
    tok = torch.minimum(tok, last)
    return p.gather(1, tok[:, None])[:, 0].log(), tok, p


_PACKED_FROM_ROWS = 3


drafter_layer_fn = cpu_scripted(drafter_layer, sdpa=True)  # scripted on CPU, Python on CUDA (layer_ops.cpu_scripted)
chain_draft_fn = cpu_scripted(chain_draft, sdpa=True)


class DrafterRuntime:
    """Inference-only view of a `Drafter` with its own fused weights; see the module docstring."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        p = next(drafter.parameters())
        self.dtype, self.device = p.dtype, p.device
        self._eps = torch.tensor(drafter.cfg.rms_norm_eps, dtype=torch.float32, device=self.device)
        self._exact_hf = self.dtype != torch.float32
        self._packed = self.device.type == "cpu" and onednn_works(self.dtype)
        self._cos = self._sin = torch.empty(0)
        self._ensure_rope(256)
        self.weights_version = 0  # counts `refresh` calls: new fused weights (drafter_graphs.py holds their addresses)
        self.refresh()

    @torch.inference_mode()
    def refresh(self) -> None:
        """Re-derive the fused (and on CPU packed, norm-folded) weights from the drafter's parameters."""
        self.weights_version += 1
        d = self.drafter
        a, mlp = d.layer.self_attn, d.layer.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        self.qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
        ln2 = d.layer.post_attention_layernorm.weight
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        # plain HF-layout weights: what one row (a chain step at batch 1) runs fastest on; oneDNN's packed
        # linears have a ~10 us fixed cost and win from about 3 rows up (measured on the CI CPU)
        self.plain = (d.fc.weight.detach(), qkv, a.o_proj.weight.detach(), gate_up, mlp.down_proj.weight.detach(),
                      ln2.detach())
        self.packed = None
        if self._packed:
            self.packed = (pack(d.fc.weight), pack(qkv), pack(a.o_proj.weight), pack(gate_up * ln2[None, :]),
                           pack(mlp.down_proj.weight), None)

    def _ensure_rope(self, n: int) -> None:
        """cos and signed sin tables ([positions, d]) covering positions 0 .. n-1; grown by doubling."""
        if n <= self._cos.shape[0]:
            return
        cos, sin = rope_table(self.drafter.cfg, max(n, 2 * self._cos.shape[0]))  # the target's tables' maths
        self._cos = cos.to(self.device, self.dtype)
        self._sin = signed_sin(sin).to(self.device, self.dtype)

    def _weights(self, rows: int) -> tuple[bool, tuple]:
        """(packed?, (fc, qkv, o, gate_up, down, ln2)) for a call over `rows` rows."""
        packed = self.packed is not None and rows >= _PACKED_FROM_ROWS
        return packed, self.packed if packed else self.plain

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.drafter.compute_logits(h)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: DrafterCache,
        cache_rows: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        prefix_mask: torch.Tensor | None = None,
        new_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`Drafter.forward` with a cache (same arguments and semantics) -> h' [B, T, H].

        new_lengths [B]: row b's real new tokens are its first new_lengths[b] (the rest right padding):
        its cached length grows by that much instead of T (the padding's K/V is dead, overwritten by the
        next append). Only with the default causal mask, under which a real token never sees padding."""
        c = self.drafter.cfg
        b, t = input_ids.shape
        self._ensure_rope(int(positions.max()) + 1)
        packed, (fc, qkv, o, gate_up, down, ln2) = self._weights(b * t)
        emb = F.embedding(input_ids, self.drafter.embed).to(features.dtype)
        x = linear(torch.cat([emb, features], -1).view(b * t, -1), fc, None, packed).view(b, t, -1)
        rows = cache_rows.to(x.device)
        start = cache.lengths[rows]
        end = start + t
        span = int(end.max())
        cache.ensure(span)
        cache.lengths[rows] = end if new_lengths is None else start + new_lengths.to(start.device)
        slots = start[:, None] + torch.arange(t, device=x.device)
        mask = Drafter.cache_mask(start, t, span, tree_mask, prefix_mask)
        if mask is not None:
            mask = mask[:, None]
        pos = positions.to(x.device)
        return drafter_layer_fn(x, self._cos[pos][:, :, None], self._sin[pos][:, :, None], qkv, self.qkv_b,
                                o, ln2, gate_up, down, packed, self._eps, self._exact_hf,
                                cache.k, cache.v, rows, slots, span, mask, c.num_heads, c.num_kv_heads, c.head_dim,
                                c.intermediate_size)

    __call__ = forward

    def ensure_chain(self, cache: DrafterCache, need: int) -> None:
        """Grow the cache and the rotary tables to `need` positions: a bound on every row's cached length + depth
        and root position + depth of the chains to come (the caller's sequence lengths + depth give one)."""
        cache.ensure(need)
        self._ensure_rope(need)

    @torch.inference_mode()
    def chain(self, h: torch.Tensor, cache: DrafterCache, rows: torch.Tensor, root_pos: torch.Tensor,
              depth: int, min_score: float = float("-inf"), params: torch.Tensor | None = None,
              u: torch.Tensor | None = None,
              need: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Chain drafting in one scripted call: h [B, H] = h' of each row's root pair (already fed),
        root_pos [B] -> (draft tokens [B, D], cumulative draft log-probs [B, D], draft distributions
        [B, D, V] or None), D <= depth: drafting stops once every row's cumulative log-prob is below
        `min_score`. Greedy by default; with uniforms u [B, depth] and sampling params [B, 4]
        (temperature, top_k, top_p, min_p) the drafts are sampled (see `chain_draft`). The rows'
        cached lengths are left as they were (the drafted entries past them are dead). need: see
        `ensure_chain` (None: read from the device)."""
        committed = cache.lengths[rows]
        if need is None:
            need = max(int(root_pos.max()), int(committed.max())) + depth
        self.ensure_chain(cache, need)
        toks, scores, probs = self.chain_call(h, cache, rows, committed, root_pos, depth, min_score, params, u)
        return toks, scores, (probs if u is not None else None)

    def chain_call(self, h: torch.Tensor, cache: DrafterCache, rows: torch.Tensor, committed: torch.Tensor,
                   root_pos: torch.Tensor, depth: int, min_score: float, params: torch.Tensor | None,
                   u: torch.Tensor | None, span_cap: int = 0, filter_flags: int = -1) -> list[torch.Tensor]:
        """`chain_draft` on this drafter's fused weights and tables (cache and tables already grown): what `chain`
        runs, and what `drafter_graphs.ChainGraphs` records (span_cap, filter_flags: see `chain_draft`)."""
        c = self.drafter.cfg
        packed, (fc, qkv, o, gate_up, down, ln2) = self._weights(h.shape[0])
        return chain_draft_fn(h, self.drafter.embed, self.drafter.lm_head.to(h.dtype), fc, qkv, self.qkv_b, o, ln2,
                              gate_up, down, packed, self._eps, self._exact_hf, cache.k, cache.v, rows, committed,
                              root_pos.to(h.device), self._cos, self._sin, depth, c.num_heads, c.num_kv_heads,
                              c.head_dim, c.intermediate_size, min_score, params, u, span_cap, filter_flags)
