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
    """name -> (shape, dtype) of every tensor in the folder's weight files, from the headers only.

    The files are those transformers (so the trainer) and the native engine read (tlt/model/folder.py
    weight_files: model.safetensors, else the index's shards): every *.safetensors mixed in stale shards
    beside a re-saved model.safetensors. A folder with neither (a drafter saved under another file name)
    falls back to every *.safetensors in it."""
    from safetensors import safe_open

    from tlt.model.folder import CheckpointError, weight_files

    try:
        paths = weight_files(Path(folder))
    except CheckpointError:
        paths = sorted(Path(folder).glob("*.safetensors"))
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
    return out
