"""The trained policy's export (output_dir/policy): a folder that loads like the input model.

Real parts: a tiny Qwen2 built in code and saved as the input model, a real Policy (DeepSpeed, gloo, CPU) that
writes the export, and the loop's own tokenizer copy. The tokenizer files are placeholders: the export copies
them byte for byte, whatever a tokenizer class would make of them.
"""

from __future__ import annotations

import json

import torch

from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import export_tokenizer
from tlt.services.trainer.policy import Policy

# Every tokenizer file transformers' save_pretrained may write (fast and slow tokenizers of the families we run).
TOKENIZER_SIDE = {
    "tokenizer.json": "{}", "tokenizer_config.json": "{}", "special_tokens_map.json": "{}",
    "added_tokens.json": '{"<extra>": 48}', "chat_template.jinja": "{{ messages }}", "tokenizer.model": "spm-bytes",
    "vocab.json": "{}", "merges.txt": "#version: 0.2\n",
}


def _input_model(path):  # noqa: ANN001, ANN202
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, use_cache=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    for name, text in TOKENIZER_SIDE.items():
        (path / name).write_text(text)
    return path


def _export(tmp_path, names):  # noqa: ANN001, ANN202
    src = _input_model(tmp_path / "in")
    for name in set(TOKENIZER_SIDE) - set(names):
        (src / name).unlink()
    torch.set_num_threads(2)
    policy = Policy(TrainerConfig(model_dir=str(src), prompts_per_step=2, n_samples=4, mini_batch_size=8,
                                  micro_batch_size=4))
    out = tmp_path / "policy"
    policy.save_pretrained(str(out))
    export_tokenizer(src, out)
    return src, out, policy


def test_the_export_carries_every_tokenizer_file_of_the_input(tmp_path):
    src, out, _ = _export(tmp_path, TOKENIZER_SIDE)
    for name, text in TOKENIZER_SIDE.items():
        assert (out / name).read_text() == text, name
    assert (src / "generation_config.json").read_text() == (out / "generation_config.json").read_text()


def test_a_sentencepiece_only_tokenizer_is_exported(tmp_path):
    # a model that ships tokenizer.model (+ its config) and no tokenizer.json: the export must still hold a tokenizer
    from tlt.model.folder import has_tokenizer

    _, out, _ = _export(tmp_path, ["tokenizer.model", "tokenizer_config.json", "added_tokens.json"])
    assert has_tokenizer(out)
    assert {"tokenizer.model", "tokenizer_config.json", "added_tokens.json"} <= {p.name for p in out.iterdir()}


def test_the_exported_config_is_the_inputs(tmp_path):
    # training switches use_cache off in the live model; the export must say what the input said (true)
    src, out, policy = _export(tmp_path, TOKENIZER_SIDE)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert policy.engine.module.config.use_cache is False  # still off for the training that may follow


def test_a_file_the_export_already_holds_is_kept(tmp_path):
    """export_tokenizer copies what the export lacks and keeps what Policy.save_pretrained (or a finished export)
    already wrote there: the generation config the policy saved stays its own, not the input's."""
    src, out = tmp_path / "in", tmp_path / "policy"
    src.mkdir()
    out.mkdir()
    (src / "generation_config.json").write_text('{"temperature": 0.7}')
    (src / "tokenizer.json").write_text('{"input": 1}')
    (out / "generation_config.json").write_text('{"temperature": 1.0}')
    export_tokenizer(src, out)
    assert (out / "generation_config.json").read_text() == '{"temperature": 1.0}'
    assert (out / "tokenizer.json").read_text() == '{"input": 1}'
