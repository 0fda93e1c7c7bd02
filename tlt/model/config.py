"""ModelConfig: one normalised description of a dense decoder checkpoint.

Hugging Face families spell the same facts differently (Qwen2 has qkv bias,
Qwen3 has per-head q/k RMSNorm and an explicit head_dim, Llama may carry a
`rope_scaling` block). `ModelConfig.from_hf(config_json, generation_config)`
reads a `config.json` dict of a supported architecture into one frozen
dataclass that the loader, the native model and the engine all share.

Supported architectures: Qwen2ForCausalLM (Qwen2 / Qwen2.5),
Qwen3ForCausalLM, LlamaForCausalLM (dense only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")


class UnsupportedModelError(ValueError):
    """The config describes a model this project cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type = "llama3"`); `linear` is factor only."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    rope_scaling: RopeScaling | None = None
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Normalise a HF `config.json` dict (plus optional `generation_config.json`)."""
        # no `architectures` (some exporters leave it out): transformers goes by model_type, and so do we
        archs = cfg.get("architectures") or [a for t, a in _BY_MODEL_TYPE.items() if t == cfg.get("model_type")]
        if isinstance(archs, str):  # "architectures": "LlamaForCausalLM" (transformers loads it): one name, not letters
            archs = [archs]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        qwen2 = arch == "Qwen2ForCausalLM"
        qwen3 = arch == "Qwen3ForCausalLM"
        # transformers' Qwen3Config defaults head_dim to 128 whatever the hidden size; Qwen2 / Llama derive it
        head_dim = cfg.get("head_dim") or (128 if qwen3 else hidden // heads)
        attention_bias = True if qwen2 else bool(cfg.get("attention_bias", False))
        # transformers 5 moved rope settings into `rope_parameters`; older files use rope_theta/rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        if scaling:  # the pre-training context as transformers' standardize_rope_params takes it (the block's alone,
            # defaulting to 8192, gave other RoPE frequencies than HF's): a top-level value first (Phi-3 style files),
            # then the block's, then max_position_embeddings
            top, block = cfg.get("original_max_position_embeddings"), scaling.get("original_max_position_embeddings")
            original = top or block or cfg.get("max_position_embeddings")
            scaling = {**scaling, "original_max_position_embeddings": original}
        rope_scaling = _rope_scaling(scaling) if scaling else None
        eos = _ids(cfg.get("eos_token_id"))
        if generation_config:
            eos = tuple(dict.fromkeys(eos + _ids(generation_config.get("eos_token_id"))))
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("sliding-window attention (use_sliding_window=true) is not supported")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (the native MLP is SwiGLU: silu)")
        if attention_bias and not qwen2:  # Llama / Qwen3 put it on o_proj too, which the native layer has no slot for
            raise UnsupportedModelError(f"attention_bias=true is not supported for {arch} (a bias on o_proj as well as "
                                        "q/k/v); Qwen2's q/k/v bias is")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            rope_theta=rope_theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qwen3,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            rope_scaling=rope_scaling,
        )


_BY_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_scaling(s: dict[str, Any]) -> RopeScaling | None:
    kind = s.get("rope_type") or s.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(s["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(s["factor"]),
            low_freq_factor=float(s.get("low_freq_factor", 1.0)),
            high_freq_factor=float(s.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(s.get("original_max_position_embeddings") or 8192),
        )
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")
