"""Checkpoint loader: config normalisation per family and one clear CheckpointError per failure.

Checkpoints are written in the test from randomly initialised `transformers`
models (no downloads); nothing is faked.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tlt.model.config import ModelConfig, UnsupportedModelError
from tlt.model.loader import CheckpointError, expected_tensors, load_checkpoint, validate_tensors

torch.set_num_threads(1)


def _save(tmp_path, family="qwen2", tie=False, shards=False, head_dim=8):
    common = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie, eos_token_id=7)
    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]
    if family == "qwen3":
        common["head_dim"] = head_dim  # Qwen3 defaults to 128 regardless of hidden size
    cfg = cls[0](**common)
    torch.manual_seed(0)
    model = cls[1](cfg)
    out = tmp_path / f"{family}-{tie}-{shards}"
    model.save_pretrained(out, max_shard_size="20KB" if shards else "10GB")
    return out, model


@pytest.mark.parametrize("family,tie,arch,bias,qk", [
    ("qwen2", False, "Qwen2ForCausalLM", True, False),
    ("qwen3", True, "Qwen3ForCausalLM", False, True),
    ("llama", False, "LlamaForCausalLM", False, False),
])
def test_loads_each_family(tmp_path, family, tie, arch, bias, qk):
    path, model = _save(tmp_path, family, tie)
    cfg, tensors = load_checkpoint(path)
    assert cfg.architecture == arch and cfg.attention_bias is bias and cfg.qk_norm is qk
    assert cfg.tie_word_embeddings is tie and cfg.num_kv_heads == 2 and cfg.head_dim == 8
    assert 7 in cfg.eos_token_ids
    assert set(tensors) == set(expected_tensors(cfg))
    ref = model.state_dict()
    for name, t in tensors.items():
        assert torch.equal(t, ref[name]), name


def test_sharded_checkpoint_and_dtype(tmp_path):
    path, model = _save(tmp_path, shards=True)
    assert (path / "model.safetensors.index.json").is_file()
    cfg, tensors = load_checkpoint(path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["lm_head.weight"], model.state_dict()["lm_head.weight"].to(torch.bfloat16))


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")  # the checkpoint's config.json given for its folder
    with pytest.raises(CheckpointError, match="config.json is a file; give the checkpoint folder"):
        load_checkpoint(tmp_path / "config.json")  # it said "checkpoint folder .../config.json does not exist"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path / "empty")


def test_missing_weights_and_missing_shard(tmp_path):
    path, _ = _save(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no weights"):
        load_checkpoint(path)
    path, _ = _save(tmp_path, shards=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match=f"shard {victim} named in model.safetensors.index.json is missing"):
        load_checkpoint(path)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    path, _ = _save(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="MixtralForCausalLM.*Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"):
        load_checkpoint(path)


def test_wrong_shape_and_unknown_and_missing_tensor(tmp_path):
    path, _ = _save(tmp_path)
    good = load_file(path / "model.safetensors")
    bad = dict(good)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(47, 32)
    save_file(bad, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj.weight.*expected shape \(48, 32\), found \(47, 32\)"):
        load_checkpoint(path)
    bad = dict(good)
    bad["model.layers.2.mlp.up_proj.weight"] = torch.zeros(48, 32)
    save_file(bad, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
        load_checkpoint(path)
    bad = dict(good)
    del bad["model.norm.weight"]
    save_file(bad, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor.*model.norm.weight"):
        load_checkpoint(path)


def test_validate_partial_update_checks_dtype(tmp_path):
    path, _ = _save(tmp_path)
    cfg, tensors = load_checkpoint(path)
    validate_tensors(cfg, {"model.norm.weight": tensors["model.norm.weight"]}, partial=True, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="expected dtype torch.float32, found torch.bfloat16"):
        validate_tensors(cfg, {"model.norm.weight": tensors["model.norm.weight"].bfloat16()}, partial=True,
                         dtype=torch.float32)
    with pytest.raises(CheckpointError, match="missing"):
        validate_tensors(cfg, {"model.norm.weight": tensors["model.norm.weight"]})


def test_config_from_hf_reads_rope_scaling_and_generation_eos():
    cfg = transformers.LlamaConfig(
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        eos_token_id=[1, 2],
    ).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    mc = ModelConfig.from_hf(cfg, {"eos_token_id": 9})
    assert mc.rope_theta == 5e5 and mc.rope_scaling.rope_type == "llama3" and mc.rope_scaling.factor == 8.0
    assert mc.eos_token_ids == (1, 2, 9)


def _retie_with_head(path, head):
    sd = load_file(path / "model.safetensors")
    sd["lm_head.weight"] = head(sd["model.embed_tokens.weight"])
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def test_tied_config_with_a_different_stored_head_is_refused(tmp_path):
    # transformers (>= 5) does NOT tie when both tensors are stored and differ: it runs the stored lm_head.
    # Dropping it (as for a true tied checkpoint) would serve other logits than the trainer's HF policy.
    path, _ = _save(tmp_path, "qwen2", tie=True)
    _retie_with_head(path, lambda e: e + 1.0)
    with pytest.raises(CheckpointError, match="lm_head"):
        load_checkpoint(path)


def test_tied_config_with_an_equal_stored_head_loads_tied(tmp_path):
    path, model = _save(tmp_path, "qwen2", tie=True)
    _retie_with_head(path, lambda e: e.clone())
    cfg, tensors = load_checkpoint(path)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in tensors
    assert torch.equal(tensors["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])


def test_config_refuses_an_activation_the_native_model_does_not_run():
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, hidden_act="gelu").to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf(cfg)
    cfg["hidden_act"] = "silu"
    assert ModelConfig.from_hf(cfg).head_dim == 8


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_config_refuses_an_o_proj_bias_by_name(family):
    """attention_bias=true gives Llama and Qwen3 an o_proj bias too: it used to fail later, at the tensors,
    as "unexpected tensor ...o_proj.bias"."""
    cls, arch = {"llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
                 "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM")}[family]
    cfg = cls(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, attention_bias=True).to_dict()
    cfg["architectures"] = [arch]
    with pytest.raises(UnsupportedModelError, match="attention_bias=true is not supported"):
        ModelConfig.from_hf(cfg)
    cfg["attention_bias"] = False
    assert not ModelConfig.from_hf(cfg).attention_bias


def test_qwen3_head_dim_defaults_like_transformers():
    cfg = transformers.Qwen3Config(hidden_size=512, num_attention_heads=8, num_key_value_heads=2).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    del cfg["head_dim"]  # a config.json written without it: Qwen3Config's default (128), not hidden / heads (64)
    assert transformers.Qwen3Config(**cfg).head_dim == 128
    assert ModelConfig.from_hf(cfg).head_dim == 128


def test_llama3_rope_original_context_is_the_one_transformers_uses(tmp_path):
    """The native engine took the rope block's original_max_position_embeddings, else 8192; transformers takes a
    top-level one first, then the block's, then max_position_embeddings: other RoPE frequencies (max |dlogit| 0.15
    on a tiny Llama) on the same folder, so the rollout sampled from another model than the trainer's."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 50, "max_position_embeddings": 256, "rope_theta": 5e5}
    cases = []
    for form in ("rope_parameters", "rope_scaling"):  # transformers 5's form, and the legacy one most files have
        for block in (None, 8192):
            for top in (None, 64):
                block_cfg = {**rope, **({"original_max_position_embeddings": block} if block else {})}
                if form == "rope_parameters":
                    block_cfg["rope_theta"] = 5e5
                cases.append({**base, form: block_cfg, **({"original_max_position_embeddings": top} if top else {})})
    seen = set()
    for cfg in cases:  # what the trainer's model runs with: the config once the model is built (its init settles it)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
        want = model.config.rope_parameters["original_max_position_embeddings"]
        got = ModelConfig.from_hf(cfg).rope_scaling
        assert got.original_max_position_embeddings == want, (cfg, got, want)
        seen.add(want)
    assert seen == {64, 256, 8192}


def test_config_without_architectures_goes_by_model_type_and_bad_fields_are_checkpoint_errors(tmp_path):
    from tlt.model.folder import read_model_config

    path, _ = _save(tmp_path, "qwen2", tie=False)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "architectures"}))
    assert read_model_config(path).architecture == "Qwen2ForCausalLM"  # as transformers loads it
    for bad in ({"rope_theta": None, "rope_parameters": None}, {"rope_scaling": "llama3"}, {"num_attention_heads": 0}):
        (path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(CheckpointError, match="wrong type"):  # were TypeError, AttributeError, ZeroDivisionError
            read_model_config(path)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text('{"eos_token_id": ')
    with pytest.raises(CheckpointError, match="generation_config.json is not valid JSON"):
        read_model_config(path)


def test_config_reads_architectures_given_as_a_string():
    # transformers loads such a file (it goes by model_type); its characters were taken as the list's items, and the
    # error named the very architecture it listed as supported
    base = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, model_type="llama")
    assert ModelConfig.from_hf(dict(base, architectures="LlamaForCausalLM")).architecture == "LlamaForCausalLM"
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture \['MixtralForCausalLM'\]"):
        ModelConfig.from_hf(dict(base, architectures="MixtralForCausalLM"))


def test_a_single_file_beside_an_index_is_the_one_loaded_as_transformers_does(tmp_path):
    # transformers (the trainer's policy) loads model.safetensors when a folder holds it and a sharded index too;
    # the rollout loaded the shards: both sides started from other weights, silently
    path, model = _save(tmp_path, shards=True)
    single = {k: v + 1.0 for k, v in model.state_dict().items()}
    save_file(single, path / "model.safetensors", metadata={"format": "pt"})
    assert (path / "model.safetensors.index.json").is_file()
    _, tensors = load_checkpoint(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for name, t in tensors.items():
        assert torch.equal(t, hf[name]) and torch.equal(t, single[name]), name


def test_a_tied_head_is_accepted_only_as_the_embedding_it_is(tmp_path):
    # HF's state_dict() of a tied model carries lm_head.weight (the embedding's storage): a push of it is valid; a
    # head that differs from the embedding, or comes without it, cannot be served by a model that has no head of its
    # own, and was dropped in silence
    path, model = _save(tmp_path, "qwen2", tie=True)
    cfg, _ = load_checkpoint(path)
    sd = model.state_dict()
    embed = sd["model.embed_tokens.weight"]
    validate_tensors(cfg, sd)
    validate_tensors(cfg, {"lm_head.weight": embed.clone(), "model.embed_tokens.weight": embed}, partial=True)
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        validate_tensors(cfg, {"lm_head.weight": embed + 1.0, "model.embed_tokens.weight": embed}, partial=True)
    with pytest.raises(CheckpointError, match="lm_head.weight without model.embed_tokens.weight"):
        validate_tensors(cfg, {"lm_head.weight": embed}, partial=True)
    with pytest.raises(CheckpointError, match=r"lm_head.weight.*expected shape \(50, 32\), found \(49, 32\)"):
        validate_tensors(cfg, {"lm_head.weight": embed[1:], "model.embed_tokens.weight": embed}, partial=True)


def test_o_proj_is_hidden_by_heads_times_head_dim_where_they_differ(tmp_path):
    # every other checkpoint here has heads * head_dim == hidden_size, where o_proj's (hidden, q_size) and its
    # transpose are the same shape; Qwen3 models are not so (0.6B: 16 heads of 128 on a hidden size of 1024)
    path, model = _save(tmp_path, "qwen3", tie=True, head_dim=16)
    cfg, tensors = load_checkpoint(path)
    assert (cfg.hidden_size, cfg.q_size) == (32, 64)
    assert tuple(tensors["model.layers.0.self_attn.o_proj.weight"].shape) == (32, 64)
    assert torch.equal(tensors["model.layers.1.self_attn.o_proj.weight"],
                       model.state_dict()["model.layers.1.self_attn.o_proj.weight"])


def test_the_generation_config_eos_ids_are_read_from_the_folder(tmp_path):
    # Qwen2.5 instruct: config.json's eos is <|endoftext|>, generation_config.json adds <|im_end|>, the end of an
    # assistant turn; without it a rollout runs past every answer to max_tokens
    from tlt.model.folder import read_model_config

    path, _ = _save(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, 7]}))
    assert read_model_config(path).eos_token_ids == (7, 11)
    assert load_checkpoint(path)[0].eos_token_ids == (7, 11)


def test_any_shard_of_an_index_missing_is_named(tmp_path):
    # each shard in turn, the index's first and last (in the order it names them) too: a check that skipped one
    # found the missing file only when safetensors failed to open it, as an unreadable file
    path, _ = _save(tmp_path, shards=True)
    shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 2
    for shard in shards:
        (path / shard).rename(tmp_path / "away")
        with pytest.raises(CheckpointError, match=f"shard {shard} named in model.safetensors.index.json is missing"):
            load_checkpoint(path)
        (tmp_path / "away").rename(path / shard)
    load_checkpoint(path)


def test_a_nan_weight_is_refused_at_load(tmp_path):
    path, _ = _save(tmp_path)
    sd = load_file(path / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] = float("inf")
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight' holds NaN or infinite"):
        load_checkpoint(path)


def test_read_tensors_names_a_tensor_the_folder_lacks(tmp_path):
    # a tied checkpoint stores no lm_head.weight: asking for it is an error naming it, not a dict without it
    from tlt.model.loader import read_tensors

    path, model = _save(tmp_path, "qwen2", tie=True)
    got = read_tensors(path, ["model.embed_tokens.weight"])
    assert list(got) == ["model.embed_tokens.weight"]
    assert torch.equal(got["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match=r"has no tensor\(s\) \['lm_head.weight'\]"):
        read_tensors(path, ["model.embed_tokens.weight", "lm_head.weight"])


def test_the_header_check_refuses_a_dtype_it_does_not_know(tmp_path):
    # check_weight_headers (rollout serve's check before its replicas load) read an unlisted safetensors dtype (U16)
    # as uint8, an integer the check refuses; the load refuses it too
    from tlt.model.folder import read_model_config
    from tlt.model.loader import check_weight_headers

    path, _ = _save(tmp_path)
    cfg = read_model_config(path)
    check_weight_headers(path, cfg)
    sd = load_file(path / "model.safetensors")
    sd["model.norm.weight"] = torch.zeros(32, dtype=torch.uint16)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'model.norm.weight': expected a floating point dtype"):
        check_weight_headers(path, cfg)
