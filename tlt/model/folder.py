"""A checkpoint folder's checks that read no tensors, without torch: a command checks the folder it was given
before it imports torch and transformers (seconds), so a wrong path fails at once.

    check_checkpoint(dir)   config.json readable, an architecture the native engine runs, weight files there
    read_model_config(dir)  -> ModelConfig (config.json + generation_config.json)
    weight_files(dir)       -> the safetensors files (the single file, else the shards of the index)
    ties_word_embeddings(dir) -> whether lm_head.weight is model.embed_tokens.weight (config.json alone)

Everything raises `CheckpointError` naming the folder; `tlt.model.loader` loads the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

from tlt.model.config import ModelConfig, UnsupportedModelError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder or a weight update cannot be used; the message says why."""


def read_model_config(model_dir: str | Path) -> ModelConfig:
    folder = Path(model_dir)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is a file; give the checkpoint folder that holds config.json")
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} has no config.json; a Hugging Face checkpoint folder is expected")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    gen_path = folder / "generation_config.json"
    try:
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{gen_path} is not valid JSON: {e}") from e
    try:
        return ModelConfig.from_hf(cfg, gen)
    except UnsupportedModelError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # "rope_theta": null, a string
        # "rope_scaling", "num_attention_heads": 0
        raise CheckpointError(f"{cfg_path}: a field has a value of the wrong type ({e})") from e


def weight_files(folder: Path) -> list[Path]:
    # model.safetensors first, as transformers takes it (the trainer's policy): with the index tried first, a folder
    # holding both (a re-save beside stale shards) gave the rollout other weights than the trainer, silently
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} named in {INDEX_FILE} is missing from {folder}")
        return files
    raise CheckpointError(f"{folder} has no weights: expected {SINGLE_FILE} or {INDEX_FILE}")


def ties_word_embeddings(model_dir: str | Path) -> bool:
    """Whether config.json ties lm_head.weight to model.embed_tokens.weight (false where it does not say, as
    ModelConfig reads it): then the model's head is its embedding, whatever head the weight files also store.
    config.json alone, so it answers for an architecture only SGLang serves too."""
    cfg_path = Path(model_dir) / "config.json"
    try:
        return bool(json.loads(cfg_path.read_text()).get("tie_word_embeddings", False))
    except (OSError, json.JSONDecodeError, AttributeError) as e:  # AttributeError: a JSON that is no object
        raise CheckpointError(f"{cfg_path} cannot be read as a model config: {e}") from e


# A tokenizer's vocabulary, in any of the forms transformers loads: tokenizer_config.json alone holds none (it
# loaded as a tokenizer of its 3 special tokens that encoded every prompt to nothing).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json + merges.txt")


def has_tokenizer(model_dir: str | Path) -> bool:
    folder = Path(model_dir)
    return any(all((folder / f).is_file() for f in group.split(" + ")) for group in TOKENIZER_FILES)


def check_checkpoint(model_dir: str | Path, architecture: bool = True, tokenizer: bool = True) -> None:
    """CheckpointError unless the folder is a checkpoint with weights, (`tokenizer`) tokenizer files, and
    (`architecture`) one the native engine can run; cheap: reads config.json and file names, no tensors. Commands
    call it before they load or start anything. architecture=False for the SGLang backend, which serves
    architectures the native engine does not."""
    folder = Path(model_dir)
    if architecture or not (folder / "config.json").is_file():
        read_model_config(folder)  # its CheckpointError: no folder, no config.json, an architecture we cannot run
    weight_files(folder)
    if tokenizer and not has_tokenizer(folder):  # found before the weights load (minutes for a large model)
        raise CheckpointError(f"{folder} has no tokenizer files ({' / '.join(TOKENIZER_FILES)}); save the "
                              "tokenizer with the model (tokenizer.save_pretrained(DIR))")
