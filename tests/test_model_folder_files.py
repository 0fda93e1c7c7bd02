"""A checkpoint folder's cheap checks (tlt/model/folder.py) and the weight files' mode (tlt/model/files.py), on
folders written here: real safetensors files, a real random checkpoint's config and tokenizer."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tlt.model.files import share_weights
from tlt.model.folder import CheckpointError, check_checkpoint, has_tokenizer, ties_word_embeddings


def test_every_weight_file_gets_the_mode_the_umask_gives(tmp_path):
    """share_weights chmods each *.safetensors to 0666 less the umask: under umask 007 (a group's shared folder)
    the config beside them is 0660, and weights left 0644 (a fixed mode that only matches umask 022) or a shard left
    0600 (only model.safetensors chmodded) could not be read or replaced by the group."""
    old = os.umask(0o007)
    try:
        for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors"):
            save_file({"w": torch.zeros(2)}, str(tmp_path / name))
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "notes.txt").write_text("x")
        os.chmod(tmp_path / "notes.txt", 0o600)
        share_weights(tmp_path)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes.pop("notes.txt") == 0o600  # only the weight files
    assert set(modes.values()) == {0o660}, modes


def test_a_vocabulary_needs_all_of_its_files(tmp_path):
    """vocab.json without its merges.txt (or the reverse) is no tokenizer transformers loads: it counted as one and
    the folder passed the check; `tokenizer=False` (the drafter trainer's, which reads no text) skips the check."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x")  # the check reads names, not tensors
    for present in ("vocab.json", "merges.txt"):
        (tmp_path / present).write_text("{}")
        assert not has_tokenizer(tmp_path)
        with pytest.raises(CheckpointError, match="no tokenizer files"):
            check_checkpoint(tmp_path, architecture=False)
        check_checkpoint(tmp_path, architecture=False, tokenizer=False)
        (tmp_path / present).unlink()
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("")
    assert has_tokenizer(tmp_path)
    check_checkpoint(tmp_path, architecture=False)
    (tmp_path / "config.json").unlink()  # the SGLang backend skips the architecture, not the folder's config.json
    with pytest.raises(CheckpointError, match="no config.json"):
        check_checkpoint(tmp_path, architecture=False)


def test_tied_only_where_config_json_says_so(random_model_dir, tmp_path):
    """A config.json that does not name tie_word_embeddings ties nothing, as ModelConfig and transformers' Qwen2
    read it; a head taken for the embedding would push or load the wrong lm_head."""
    folder = tmp_path / "m"
    shutil.copytree(random_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    for value in (True, False):
        (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": value}))
        assert ties_word_embeddings(folder) is value
    cfg.pop("tie_word_embeddings", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    assert ties_word_embeddings(folder) is False
    check_checkpoint(folder)


def test_a_folder_without_weights_is_refused_before_anything_loads(random_model_dir, tmp_path):
    """config.json and a tokenizer but no model.safetensors nor index (a copy that left the weights behind): the
    cheap check names it, for the native engine and for SGLang, as the load would only minutes later."""
    folder = tmp_path / "m"
    shutil.copytree(random_model_dir, folder)
    check_checkpoint(folder)
    for weights in folder.glob("*.safetensors*"):
        weights.unlink()
    for architecture in (True, False):
        with pytest.raises(CheckpointError, match="has no weights: expected model.safetensors or"):
            check_checkpoint(folder, architecture=architecture)


def test_weight_files_follow_the_usual_umask_022(tmp_path):
    """The umask is octal (/proc says 0022): read as a decimal 22 (0o26) it gave 0640, weights the config's other
    readers (0644) could not open; under umask 007 the two readings are the same number."""
    old = os.umask(0o022)
    try:
        save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
        share_weights(tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
