"""Load a Hugging Face checkpoint folder into (ModelConfig, tensors), with checks.

    load_checkpoint(dir) -> (ModelConfig, {hf_name: Tensor})
    read_tensors(dir, names) -> {hf_name: Tensor}   (only those, e.g. the embedding and lm_head)
    check_weight_headers(dir, config)               (names, shapes, dtypes from the files' headers: no tensor read)
    (the folder checks that read no tensors, check_checkpoint and read_model_config: folder.py, without torch)

Reads `config.json` (+ `generation_config.json` for eos ids) and the weights
from `model.safetensors` (first, as transformers) or the shards listed in
`model.safetensors.index.json`.
`expected_tensors(config)` names every tensor the native model needs with its
shape; `validate_tensors` checks a (full or partial) set of tensors against it.
The same check guards cold start and every hot weight swap in the engine, so a
bad file or a bad push fails the same way: one `CheckpointError` that names
the tensor, what was expected and what was found.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tlt.model.config import ModelConfig
from tlt.model.folder import CheckpointError, read_model_config, weight_files


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every weight the native model uses."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
        out[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
        out[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        out[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            out[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            out[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
    return out


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Tensors a checkpoint may carry that the model does not need (rotary caches; a tied head: check_tied_head).
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def check_tied_head(tensors: Mapping[str, torch.Tensor]) -> None:
    """For a model with tie_word_embeddings: CheckpointError unless a given lm_head.weight comes with an equal
    model.embed_tokens.weight. HF's state_dict() of a tied model carries both (one storage), so such a head is
    the embedding under its other name and the embedding is what is served; a head alone or a different one would
    be dropped in silence, since the model has no head of its own."""
    head, embed = tensors.get(TIED_HEAD), tensors.get(EMBEDDING)
    if head is None:
        return
    if embed is None:
        raise CheckpointError(f"{TIED_HEAD} without {EMBEDDING}: the model ties them (tie_word_embeddings=true), "
                              f"so give the head as {EMBEDDING}")
    if head.dtype != embed.dtype or not torch.equal(head, embed):
        raise CheckpointError(f"{TIED_HEAD} differs from {EMBEDDING} but the model ties them "
                              f"(tie_word_embeddings=true); give {EMBEDDING} alone, or untie the head in config.json")


def validate_tensors(
    cfg: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    partial: bool = False,
    dtype: torch.dtype | None = None,
    finite: bool = False,
) -> None:
    """Raise CheckpointError unless every tensor is known with the right shape (and dtype if given).

    partial=False also requires every expected tensor to be present. finite=True also refuses a NaN or infinite
    value: such weights were served without an error, every logprob a NaN shown as -9999.
    """
    expected = expected_tensors(cfg)
    if cfg.tie_word_embeddings and TIED_HEAD in tensors:  # checked as the embedding's shape and dtype, then equal
        expected[TIED_HEAD] = expected[EMBEDDING]
    for name, t in tensors.items():
        if name not in expected:
            if name.endswith(_IGNORABLE_SUFFIXES):
                continue
            raise CheckpointError(f"unexpected tensor {name!r} for {cfg.architecture} with {cfg.num_layers} layers")
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(f"tensor {name!r}: expected shape {expected[name]}, found {tuple(t.shape)}")
        if t.dtype in FLOAT8_DTYPES:  # a float8 checkpoint (its scales elsewhere): cast as it is, other weights
            raise CheckpointError(f"tensor {name!r}: found {t.dtype}, quantized weights; quantized checkpoints are not "
                                  "supported by the native engine; use --backend sglang or a bf16/fp16/fp32 checkpoint")
        if dtype is not None and t.dtype != dtype:
            raise CheckpointError(f"tensor {name!r}: expected dtype {dtype}, found {t.dtype}")
        if not t.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name!r}: expected a floating point dtype, found {t.dtype}")
        if finite and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"tensor {name!r} holds NaN or infinite values")
    if cfg.tie_word_embeddings:
        check_tied_head(tensors)
    if not partial:
        missing = [n for n in expected if n not in tensors]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise CheckpointError(f"checkpoint is missing tensor(s) {missing[:3]}{more}")


@contextlib.contextmanager
def _weights(path: Path):  # noqa: ANN202 - Iterator[safe_open]
    """`safe_open` of a weight file on the CPU; one that safetensors cannot read (cut short by a copy, not safetensors)
    is a CheckpointError naming it: it was a SafetensorError traceback."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); copy or write it again") from None


def read_tensors(model_dir: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Only the named tensors of a checkpoint folder, as stored (dtype kept); CheckpointError names any missing."""
    want = set(names)
    found: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(model_dir)):
        with _weights(path) as f:
            for name in want.intersection(f.keys()):
                found[name] = f.get_tensor(name)
    missing = sorted(want - set(found))
    if missing:
        raise CheckpointError(f"{model_dir} has no tensor(s) {missing}")
    return found


def load_checkpoint(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read and validate a checkpoint folder; tensors are cast to `dtype` on `device`."""
    folder = Path(model_dir)
    cfg = read_model_config(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        with _weights(path) as f:
            for name in f.keys():
                if name.endswith(_IGNORABLE_SUFFIXES):
                    continue
                tensors[name] = f.get_tensor(name)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        head, embed = tensors.pop("lm_head.weight"), tensors.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(head, embed):
            # transformers does not tie such a checkpoint: it runs the stored head, so dropping it would serve other
            # logits than an AutoModelForCausalLM of the same folder (the trainer's policy).
            raise CheckpointError(
                f"{folder}: config.json says tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings to false if the head is meant to be separate"
            )
    validate_tensors(cfg, tensors, finite=True)
    return cfg, {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}


class _Header:
    """A tensor as a safetensors header describes it: what validate_tensors reads of one, but its values."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def check_weight_headers(model_dir: str | Path, cfg: ModelConfig) -> None:
    """CheckpointError for what load_checkpoint would refuse that the weight files' headers show: a file safetensors
    cannot read (cut short, a Git LFS pointer), a missing, unknown, misshapen or integer tensor. Reads no tensor:
    `tlt rollout serve` checks it before its replicas load the weights, where the same error came back as a replica
    that failed to start, with two tracebacks. (A tied head is compared by value at load.)"""
    headers: dict[str, _Header] = {}
    for path in weight_files(Path(model_dir)):
        with _weights(path) as f:
            for name in f.keys():
                if name.endswith(_IGNORABLE_SUFFIXES) or (cfg.tie_word_embeddings and name == TIED_HEAD):
                    continue
                part = f.get_slice(name)
                headers[name] = _Header(tuple(part.get_shape()), _HEADER_DTYPES.get(part.get_dtype(), torch.uint8))
    validate_tensors(cfg, headers)  # type: ignore[arg-type]
