"""The EAGLE-style drafter: one decoder layer that predicts the target's next last-layer feature.

    input_t  = concat(embed(x_{t+1}), h_t)        # 2H; h_t = target's hidden state after its final norm
    z_t      = fc(input_t)                         # H, no bias
    h'_{t+1} = layer(z_t)                          # attention (RoPE) + SwiGLU; NO input norm on the
                                                   #   attention sublayer, post-attention norm kept
    logits   = lm_head(h'_{t+1})                   # the target's lm_head applied directly, no final norm:
                                                   #   h is already post-norm, h' is trained to match it

Shared by the rollout engine (runs it, with its own small KV cache) and the drafter service (trains it).
`embed` and `lm_head` are the TARGET's tensors held by reference (`detach()` shares storage), so an
in-place policy update is seen at once; they are not parameters, not in `state_dict()`, never saved or
pushed. Only `fc.*` and `layer.*` are trained and saved (`model.safetensors` + `drafter_config.json`).

Alignment: the pair (x_{t+1}, h_t) predicts h_{t+1} (and so the token x_{t+2}). A pair sits at the
position of its token x_{t+1}; in tree drafting the root (last verified token x_T, paired with h_{T-1})
is at position T and a node at depth d at T + d, the same positions the target verifies them at.
`training_pairs` builds the shifted inputs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tlt.model.config import ModelConfig, RopeScaling
from tlt.model.files import share_weights
from tlt.model.layer_ops import gpu_sdpa
from tlt.model.transformer import rms_norm, rope_inv_freq

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "drafter_config.json"
TRAINER_CHECKPOINT = "coordinator.pt"  # the elastic drafter trainer's checkpoint, in its checkpoint_dir (coordinator.py)


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = True
    rope_scaling: RopeScaling | None = None

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> DrafterConfig:
        """The drafter layer has the target's layer shape (and RoPE), so its features line up."""
        return cls(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps, cfg.attention_bias, cfg.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config: dict) -> DrafterConfig:
        return cls.from_model_config(ModelConfig.from_hf(hf_config))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        d = json.loads(text)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


class DrafterError(ValueError):
    """A drafter folder or tensor set cannot be used; the message says why."""


class _RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class DrafterCache:
    """Contiguous K/V for the drafter's one layer: rows (one per sequence slot) x capacity positions.

    `lengths[row]` counts the cached entries; a forward appends its new tokens after them. Tree drafting
    appends candidate nodes too; `truncate` rolls a row back to its verified prefix afterwards.
    """

    def __init__(self, cfg: DrafterConfig, rows: int, capacity: int, dtype=torch.float32, device="cpu") -> None:
        shape = (rows, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])

    def ensure(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        new = max(capacity, 2 * self.capacity)
        pad = (0, 0, 0, new - self.capacity)
        self.k = F.pad(self.k, pad)
        self.v = F.pad(self.v, pad)

    def truncate(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        self.lengths[rows.to(self.lengths.device)] = lengths.to(self.lengths.device)


class Drafter(nn.Module):
    """fc + one decoder layer; embed/lm_head are the target's (frozen, by reference)."""

    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = _Layer(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # type: ignore[arg-type]
        self.set_shared(embed, lm_head)

    def set_shared(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Point at the target's embedding and lm_head (shared storage, no grad, not parameters)."""
        v, h = self.cfg.vocab_size, self.cfg.hidden_size
        for name, t in (("embed", embed), ("lm_head", lm_head)):
            if tuple(t.shape) != (v, h):
                raise DrafterError(f"target {name} has shape {tuple(t.shape)}, the drafter expects {(v, h)}")
        object.__setattr__(self, "embed", embed.detach())
        object.__setattr__(self, "lm_head", lm_head.detach())

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head.to(h.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        *,
        segment_ids: torch.Tensor | None = None,
        cache: DrafterCache | None = None,
        cache_rows: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        prefix_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] (x_{t+1}), features [B, T, H] (h_t), positions [B, T] -> h' [B, T, H].

        Without a cache (training): causal attention within each segment (`segment_ids` [B, T], so packed
        sequences never see each other). With a cache: the new tokens of row r = cache_rows[b] are appended
        after its `lengths[r]` cached entries and attend to all of them plus the new tokens that
        `tree_mask` [B, T, T] allows (default causal); lengths grow by T. `prefix_mask` [B, T, P] (tree
        drafting) hides cached entries: key j < P is visible to new token i only where it is True (earlier
        drafted levels: only a node's ancestors); cached keys at or past P stay visible.
        """
        c = self.cfg
        b, t = input_ids.shape
        x = self.fc(torch.cat([F.embedding(input_ids, self.embed).to(features.dtype), features], -1))
        attn = self.layer.self_attn
        q = attn.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        freqs = positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq.float()  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], -1)[:, None]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if cache is None:
            mask = causal[None].expand(b, t, t)
            if segment_ids is not None:
                mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        else:
            rows = torch.arange(b, device=x.device) if cache_rows is None else cache_rows.to(x.device)
            start = cache.lengths[rows]
            cache.ensure(int((start + t).max()))
            slots = start[:, None] + torch.arange(t, device=x.device)  # [B, T]
            cache.k[rows[:, None], :, slots] = k.transpose(1, 2).to(cache.k.dtype)
            cache.v[rows[:, None], :, slots] = v.transpose(1, 2).to(cache.v.dtype)
            cache.lengths[rows] = start + t
            span = int((start + t).max())
            k, v = cache.k[rows, :, :span].to(q.dtype), cache.v[rows, :, :span].to(q.dtype)
            mask = self.cache_mask(start, t, span, tree_mask, prefix_mask)
        with gpu_sdpa(q):  # off the CPU no cuDNN attention: a plan per new shape (layer_ops; training shapes vary too)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                               enable_gqa=c.num_heads != c.num_kv_heads)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))  # no input norm (EAGLE)
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def forward_unrolled(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                         segment_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (TLT.md section 3, EAGLE-3): the drafter unrolled on its own outputs.

        input_ids, features, positions, segment_ids [B, T]: packed training pairs (pair j = (x_{j+1},
        h_j) at positions[j]). Returns `steps` tensors [B, T, H]: out[0] is `forward(...)` (predicts
        h_{j+1}); out[s] at index j is what a chain drafted from root pair j computes at depth s + 1:
        the pair (x_{j+s+1}, out[s-1][j]) at position positions[j] + s, predicting h_{j+s+1}. Like the
        engine's chain, it attends the true pairs i <= j of its segment (step 0's keys) and its own
        earlier drafted pairs of the same root (the keys of steps 1..s at index j), nothing else, so
        it never sees a true feature past h_j. Tokens are the true ones (a drafted token only matters
        when it equals the true one). Indices whose x_{j+s+1} lies past the row get token 0; the caller
        masks their loss (`unrolled_targets`).
        """
        c = self.cfg
        b, t = input_ids.shape
        nh, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
        rep = nh // kvh
        attn = self.layer.self_attn
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        mask0 = (causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]  # [B, 1, T, T]
        keys0 = vals0 = None
        diag_k: list[torch.Tensor] = []  # per earlier step >= 1: [B, nh, T, d] (GQA heads repeated)
        diag_v: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        feats = features
        for s in range(steps):
            ids = F.pad(input_ids[:, s:], (0, s)) if s else input_ids
            x = self.fc(torch.cat([F.embedding(ids, self.embed).to(feats.dtype), feats], -1))
            q = attn.q_proj(x).view(b, t, nh, d).transpose(1, 2)
            k = attn.k_proj(x).view(b, t, kvh, d).transpose(1, 2)
            v = attn.v_proj(x).view(b, t, kvh, d).transpose(1, 2)
            freqs = (positions + s).to(self.inv_freq.device).float()[..., None] * self.inv_freq.float()
            emb = torch.cat([freqs, freqs], -1)[:, None]
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            if s == 0:
                keys0, vals0 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            scale = d**-0.5
            scores = (q @ keys0.transpose(-1, -2)) * scale  # [B, nh, T, T] over the true pairs
            scores = scores.masked_fill(~mask0, float("-inf"))
            own = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]  # [B, nh, T, 1] each
            p = torch.cat([scores, *own], -1).softmax(-1)
            o = p[..., :t] @ vals0
            for i, dv in enumerate(diag_v):
                o = o + p[..., t + i : t + i + 1] * dv
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, nh * d))
            h = x + self.layer.mlp(self.layer.post_attention_layernorm(x))
            outs.append(h)
            feats = h
        return outs

    @staticmethod
    def cache_mask(start: torch.Tensor, t: int, span: int, tree_mask: torch.Tensor | None = None,
                   prefix_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """[B, T, span] bool, True = attend, for T new tokens appended at `start` [B] of their cache rows.

        Cached key j < start_b is visible unless `prefix_mask` [B, T, P] hides it (j < P); new key
        start_b + k is visible to new token i where `tree_mask` [B, T, T] says so (default causal, k <= i);
        keys past a row's own end are hidden. None when every key of every row is visible (a single new
        token per row, no prefix mask, all rows equally long): SDPA then needs no mask.
        """
        b = start.shape[0]
        if t == 1 and prefix_mask is None and bool((start == span - 1).all()):
            return None
        key = torch.arange(span, device=start.device)
        rel = key[None, None, :] - start[:, None, None]  # index among the new tokens; < 0 for cached keys
        if tree_mask is None:
            new_ok = rel <= torch.arange(t, device=start.device)[None, :, None]
        else:
            new_ok = tree_mask.to(torch.bool).gather(2, rel.clamp(0, t - 1).expand(b, t, span))
        mask = (rel < 0) | ((rel < t) & new_ok)
        if prefix_mask is not None:
            pm = prefix_mask[..., :span].to(torch.bool)
            mask = mask & ((rel >= 0) | F.pad(pm, (0, span - pm.shape[-1]), value=True))
        return mask

    # ---- weights: only the drafter's own
    def save(self, folder: str | Path) -> None:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(self.cfg.to_json())
        share_weights(out)  # safetensors wrote it 0600

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Validate names/shapes/float dtypes/finite values strictly (the shared embed/lm_head are refused), then copy in
        place: a refused set changes nothing."""
        shared = [k for k in tensors if "embed" in k or "lm_head" in k]
        if shared:
            raise DrafterError(f"drafter weights must not carry the target's embedding/lm_head, found {shared}")
        own = self.state_dict()
        missing, unknown = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        if missing or unknown:
            raise DrafterError(f"drafter tensors do not match: missing {missing}, unexpected {unknown}")
        for k, t in tensors.items():
            if tuple(t.shape) != tuple(own[k].shape):
                raise DrafterError(f"drafter tensor {k}: shape {tuple(t.shape)}, expected {tuple(own[k].shape)}")
            if not t.dtype.is_floating_point:  # a float is cast to ours (fp32 trained, bf16 served)
                raise DrafterError(f"drafter tensor {k}: dtype {t.dtype}, expected a floating point dtype")
            if not bool(torch.isfinite(t).all()):  # served, every draft was rejected: acceptance 1.0 in silence
                raise DrafterError(f"drafter tensor {k} holds NaN or infinite values")
        with torch.no_grad():
            for k, t in tensors.items():
                own[k].copy_(t)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def tensors_identity(tensors: dict[str, torch.Tensor]) -> str:
    """"sha256:<16 hex>" of a drafter's own tensors (names, shapes, float32 values): the same weights are the same
    drafter wherever their folder is and whatever dtype it stores (a drafter coordinator's lineage, the drafter a
    rollout started with)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return f"sha256:{h.hexdigest()[:16]}"


def folder_identity(folder: str | Path) -> str:
    """`tensors_identity` of the drafter saved in `folder` (its weights file read again; DrafterError if unreadable)."""
    path = Path(folder) / WEIGHTS_FILE
    try:
        return tensors_identity(load_file(str(path)))
    except (OSError, SafetensorError) as e:
        raise DrafterError(f"{path} is not a readable safetensors file ({e})") from None


def check_drafter_folder(folder: str | Path) -> None:
    """DrafterError unless `folder` holds a drafter's two files (cheap: nothing is read)."""
    src = Path(folder)
    if not (src / CONFIG_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
        hint = ""
        if (src / TRAINER_CHECKPOINT).is_file():  # a run's drafter/ folder: the online drafter, not loadable as is
            hint = (f"; it is a drafter trainer's checkpoint_dir, whose serving drafter `tlt drafter export --drafter "
                    f"{src} --model MODEL --format tlt --out DIR` writes as one (a finished `tlt run` wrote it to "
                    "runs/<id>/policy-drafter)")
        raise DrafterError(f"{src} is not a drafter folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}{hint}")


def read_drafter_config(folder: str | Path, model: str = "MODEL") -> DrafterConfig:
    """The drafter config in `folder`; DrafterError when it is not one (not JSON, not an object, other fields): each
    command that loads a drafter said so in a traceback but `tlt rollout serve`. `model`: named in the fix."""
    path = Path(folder, CONFIG_FILE)
    try:
        return DrafterConfig.from_json(path.read_text())
    except (OSError, ValueError, TypeError, AttributeError) as e:  # not JSON, not an object, not a drafter's fields
        raise DrafterError(f"{path} is not a drafter config ({e}): write the drafter again with "
                           f"`tlt drafter warmup --model {model} --out DIR`") from None


def load_drafter(folder: str | Path, embed: torch.Tensor, lm_head: torch.Tensor) -> Drafter:
    """Build a Drafter from a folder written by `Drafter.save`, sharing the target's embed/lm_head."""
    src = Path(folder)
    check_drafter_folder(src)
    drafter = Drafter(read_drafter_config(src), embed, lm_head)
    try:
        tensors = load_file(str(src / WEIGHTS_FILE))
    except SafetensorError as e:  # cut short by a copy: it was a traceback
        raise DrafterError(f"{src / WEIGHTS_FILE} is not a readable safetensors file ({e}); copy or write the "
                           "drafter again") from None
    drafter.load_tensors(tensors)
    return drafter


@dataclass(frozen=True)
class TrainingPairs:
    """Shifted training inputs: pair j = (x_{j+1}, h_j) at position j+1, target h_{j+1}."""

    input_ids: torch.Tensor  # [B, T-1] = tokens[:, 1:]
    features: torch.Tensor  # [B, T-1, H] = features[:, :-1]
    target: torch.Tensor  # [B, T-1, H] = features[:, 1:]
    positions: torch.Tensor  # [B, T-1] = 1 .. T-1
    mask: torch.Tensor | None  # [B, T-1] = loss_mask[:, 1:] (is h_{j+1} a target?)


def training_pairs(tokens: torch.Tensor, features: torch.Tensor, loss_mask: torch.Tensor | None = None) -> TrainingPairs:
    """tokens [B, T], features [B, T, H] of the same positions (h_t = target feature at t) -> aligned pairs.

    loss_mask[t] says whether h_t is trained on: for response-only training, True from position
    prompt_len - 1 (whose feature predicts the first response token) to the end.
    """
    b, t = tokens.shape
    pos = torch.arange(1, t, device=tokens.device).expand(b, t - 1)
    mask = None if loss_mask is None else loss_mask[:, 1:]
    return TrainingPairs(tokens[:, 1:], features[:, :-1], features[:, 1:], pos, mask)
