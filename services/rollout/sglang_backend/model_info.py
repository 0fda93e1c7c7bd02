"""What the rollout servers need to know about a checkpoint, read from its files without loading it.

SGLang loads the model inside its own processes; the replica still has to
report vocab size, hidden size, context length, EOS ids and the weight
names/shapes a push must match. These come from config.json,
generation_config.json and the safetensors headers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    """What the servers need to know about the served model, read from config.json."""

    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelInfo:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        gen = Path(model_dir) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids,
        )


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_specs(folder: str) -> dict[str, tuple[tuple[int, ...], Any]]:
    """name -> (shape, dtype) of every tensor in a folder's *.safetensors, from the headers only."""
    from safetensors import safe_open

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
    return out
