"""ModelConfig: one normalised description of a dense decoder checkpoint.

Hugging Face families spell the same facts differently (Qwen2 has qkv bias,
Qwen3 has per-head q/k RMSNorm and an explicit head_dim, Llama may carry a
`rope_scaling` block). `ModelConfig.from_hf(config_json, generation_config)`
reads a `config.json` dict of a supported architecture into one frozen
dataclass that the loader, the native model and the engine all share.

Supported architectures: Qwen2ForCausalLM (Qwen2 / Qwen2.5),
Qwen3ForCausalLM, LlamaForCausalLM (dense, unquantized only). The trainer runs
transformers' AutoModelForCausalLM on the same folder, so every field is read as
the installed transformers reads it (RoPE block, theta, defaults), and what it
would read differently or refuse is refused here with one line saying why.
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
        model_type = cfg.get("model_type")
        if model_type and _BY_MODEL_TYPE.get(model_type) != arch:  # AutoModelForCausalLM goes by model_type alone
            raise UnsupportedModelError(
                f"model_type {model_type!r} with architectures {archs}: transformers builds its model from model_type "
                f"({_BY_MODEL_TYPE.get(model_type) or 'a ' + model_type + ' model'}, not {arch}), so the native engine "
                "would serve another model than the trainer's; make architectures and model_type agree")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise UnsupportedModelError(f"quantized checkpoints (quant_method {method}) are not supported by the "
                                        "native engine; use --backend sglang or a bf16/fp16/fp32 checkpoint")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        qwen2 = arch == "Qwen2ForCausalLM"
        qwen3 = arch == "Qwen3ForCausalLM"
        # transformers' Qwen3Config defaults head_dim to 128 whatever the hidden size; Qwen2 / Llama derive it
        head_dim = cfg.get("head_dim") or (128 if qwen3 else hidden // heads)
        attention_bias = True if qwen2 else bool(cfg.get("attention_bias", False))
        max_positions = cfg.get("max_position_embeddings") or _MAX_POSITIONS[arch]  # transformers' per family
        rope_theta, rope_scaling = _rope(cfg, max_positions)
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
        # num_key_value_heads as transformers reads it: left out, the family's default (Qwen2 / Qwen3: 32, Llama: one
        # per query head); null, one per query head
        kv_heads = int(cfg.get("num_key_value_heads", _KV_HEADS.get(arch)) or heads)
        if "num_key_value_heads" not in cfg and heads % kv_heads:
            raise UnsupportedModelError(
                f"config.json has no num_key_value_heads: transformers then builds {arch} with {kv_heads} K/V heads, "
                f"which num_attention_heads={heads} is not a multiple of; write num_key_value_heads")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            rope_theta=rope_theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qwen3,
            max_position_embeddings=int(max_positions),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            rope_scaling=rope_scaling,
        )


_BY_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# transformers' default max_position_embeddings (LlamaConfig, Qwen2Config, Qwen3Config) for a file without one
_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768}
# transformers' num_key_value_heads for a file without one (LlamaConfig: None, one K/V head per query head)
_KV_HEADS = {"Qwen2ForCausalLM": 32, "Qwen3ForCausalLM": 32}
# what transformers' RoPE validation requires in a block of each type (rope_theta and the original context filled in)
_REQUIRED_ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "high_freq_factor", "low_freq_factor")}


def _rope(cfg: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) as transformers' convert_rope_params_to_dict and standardize_rope_params read them: the
    block is `rope_scaling` if given, else `rope_parameters`; its type is `rope_type`, else `type`; theta is the
    block's, else the top-level rope_theta, else 10000. Both blocks given: each is read so, and they must mean the
    same RoPE (the same theta and scaling, however spelled), else refused (transformers drops rope_parameters, its
    rope_theta too, in silence)."""
    params, legacy = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(value, dict):
            raise TypeError(f"{key} must be an object, got {value!r}")
    chosen = _rope_block(legacy or params, cfg, max_positions)
    if params and legacy and params != legacy:
        try:
            same = _rope_block(params, cfg, max_positions) == chosen
        except UnsupportedModelError:
            same = False
        if not same:
            raise UnsupportedModelError(
                "config.json has both rope_parameters and rope_scaling, and they differ (transformers takes "
                "rope_scaling and drops rope_parameters, rope_theta included); keep one")
    return chosen


def _rope_block(block: dict[str, Any], cfg: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """One RoPE block read as `_rope` says."""
    block = dict(block)
    if any(isinstance(v, dict) for v in block.values()):
        raise UnsupportedModelError("RoPE parameters per layer type (a block per attention kind) are not supported")
    theta = float(block["rope_theta"] if "rope_theta" in block else cfg.get("rope_theta", 10000.0))  # null: refused
    kind = block.get("rope_type") or block.get("type") or "default"
    if kind == "default":
        return theta, None
    missing = [k for k in _REQUIRED_ROPE_KEYS.get(kind, ()) if k not in block]
    if missing:
        raise UnsupportedModelError(f"rope scaling {kind!r} needs {', '.join(map(repr, missing))} in its block "
                                    "(transformers refuses the file without them)")
    # the pre-training context as transformers' standardize_rope_params takes it (the block's alone, defaulting to
    # 8192, gave other RoPE frequencies than HF's): a top-level value first (Phi-3 style files), then the block's,
    # then max_position_embeddings (the family's default where the file has none)
    original = cfg.get("original_max_position_embeddings") or block.get("original_max_position_embeddings")
    block.update(rope_type=kind, original_max_position_embeddings=original or max_positions)
    return theta, _rope_scaling(block)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_scaling(s: dict[str, Any]) -> RopeScaling:
    kind = s["rope_type"]
    if kind == "linear":
        return RopeScaling("linear", factor=float(s["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(s["factor"]),
            low_freq_factor=float(s["low_freq_factor"]),
            high_freq_factor=float(s["high_freq_factor"]),
            original_max_position_embeddings=int(s["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")
