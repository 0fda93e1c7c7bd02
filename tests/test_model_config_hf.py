"""ModelConfig.from_hf reads a config.json as transformers does (the trainer's AutoModelForCausalLM), or refuses it.

Each case is a config dict compared with what the installed transformers builds from the same file: its RoPE
inverse frequencies, its max_position_embeddings, or its refusal. One tiny Llama checks the logits end to end.
Nothing is downloaded or faked.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tlt.model.config import ModelConfig, UnsupportedModelError
from tlt.model.folder import read_model_config
from tlt.model.loader import CheckpointError, check_weight_headers, load_checkpoint
from tlt.model.transformer import AttentionMetadata, build_model, rope_inv_freq

torch.set_num_threads(1)

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50,
         "max_position_embeddings": 64}
QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
QWEN3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 8}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def hf_config(tmp_path, raw):
    """The config the trainer's model runs with: config.json loaded by AutoConfig, settled by building the model."""
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return transformers.AutoConfig.from_pretrained(tmp_path)


def hf_rope(tmp_path, raw):
    cfg = hf_config(tmp_path, raw)
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    return rot.inv_freq.float(), rot.attention_scaling


@pytest.mark.parametrize("name,extra", [
    ("rope_parameters spelled with type: linear",
     {"rope_parameters": {"type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
    ("rope_parameters spelled with type: llama3", {"rope_parameters": {"type": "llama3", **{k: v for k, v in
                                                   LLAMA3.items() if k != "rope_type"}, "rope_theta": 5e5}}),
    ("rope_theta inside the rope_scaling block",
     {"rope_scaling": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
    ("rope_theta inside the rope_scaling block, another at the top",
     {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    ("rope_theta at the top only", {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("no rope_theta anywhere", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("both blocks, equal", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                            "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
    # the same RoPE in other words (a review's finding: refused as "different" while transformers loads it)
    ("both blocks, rope_parameters adding the top-level rope_theta", {"rope_theta": 5e5, "rope_scaling": dict(LLAMA3),
                                                                      "rope_parameters": {**LLAMA3, "rope_theta": 5e5}}),
    ("both blocks, one spelling its type with type", {"rope_theta": 5e5, "rope_parameters": dict(LLAMA3),
     "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}}),
    ("llama3 without max_position_embeddings", {"max_position_embeddings": None, "rope_theta": 5e5,
     "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}}),
])
def test_rope_frequencies_are_the_ones_transformers_builds(tmp_path, name, extra):
    raw = {k: v for k, v in {**LLAMA, **extra}.items() if v is not None}
    want, scaling = hf_rope(tmp_path, copy.deepcopy(raw))
    assert scaling == 1.0
    got = rope_inv_freq(ModelConfig.from_hf(copy.deepcopy(raw)))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=name)


def test_a_yarn_block_spelled_with_type_is_refused_not_served_unscaled():
    raw = {**QWEN2, "rope_parameters": {"type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                        "original_max_position_embeddings": 16}}
    with pytest.raises(UnsupportedModelError, match="'yarn' is not supported"):
        ModelConfig.from_hf(raw)


def test_rope_parameters_and_a_different_rope_scaling_are_refused_naming_both():
    raw = {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
           "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="both rope_parameters and rope_scaling.*keep one"):
        ModelConfig.from_hf(raw)


def test_what_transformers_saves_from_a_legacy_rope_scaling_file_reads_the_same(tmp_path):
    legacy = {**LLAMA, "rope_theta": 5e5, "rope_scaling": dict(LLAMA3)}
    hf_config(tmp_path, legacy).save_pretrained(tmp_path)  # transformers 5 writes rope_parameters (no rope_scaling)
    resaved = json.loads((tmp_path / "config.json").read_text())
    got, want = ModelConfig.from_hf(resaved), ModelConfig.from_hf(legacy)
    assert (got.rope_theta, got.rope_scaling, got.max_position_embeddings) == \
        (want.rope_theta, want.rope_scaling, want.max_position_embeddings)


def test_llama3_block_without_its_frequency_factors_is_refused_as_transformers_does(tmp_path):
    block = {k: v for k, v in LLAMA3.items() if k not in ("low_freq_factor", "high_freq_factor")}
    raw = {**LLAMA, "rope_theta": 5e5, "rope_scaling": block}
    with pytest.raises(KeyError):  # transformers refuses it as it loads
        hf_config(tmp_path, copy.deepcopy(raw))
    with pytest.raises(UnsupportedModelError, match="'high_freq_factor', 'low_freq_factor'"):
        ModelConfig.from_hf(raw)
    with pytest.raises(UnsupportedModelError, match="'factor'"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"type": "linear"}})


@pytest.mark.parametrize("base", [LLAMA, QWEN2, QWEN3], ids=lambda b: b["model_type"])
def test_max_position_embeddings_defaults_as_each_family_in_transformers(tmp_path, base):
    raw = {k: v for k, v in base.items() if k != "max_position_embeddings"}
    want = hf_config(tmp_path, copy.deepcopy(raw)).max_position_embeddings
    assert ModelConfig.from_hf(raw).max_position_embeddings == want


@pytest.mark.parametrize("base", [LLAMA, QWEN2, QWEN3], ids=lambda b: b["model_type"])
def test_num_key_value_heads_left_out_is_read_as_transformers_reads_it(tmp_path, base):
    # transformers' LlamaConfig takes one K/V head per query head when config.json has no num_key_value_heads, but
    # Qwen2Config and Qwen3Config take 32 (only an explicit null means num_attention_heads): the native engine took
    # num_attention_heads for every family, another model than the trainer's
    raw = {k: v for k, v in base.items() if k != "num_key_value_heads"} | {"hidden_size": 128, "num_attention_heads": 64}
    want = hf_config(tmp_path, copy.deepcopy(raw)).num_key_value_heads
    assert want == (64 if base is LLAMA else 32)
    assert ModelConfig.from_hf(raw).num_kv_heads == want
    # 4 query heads and transformers' 32 K/V heads are no model: refused, naming the key to write
    small = {k: v for k, v in base.items() if k != "num_key_value_heads"}
    if base is LLAMA:
        assert ModelConfig.from_hf(small).num_kv_heads == 4
    else:
        with pytest.raises(UnsupportedModelError, match="no num_key_value_heads"):
            ModelConfig.from_hf(small)
    null = {**base, "num_key_value_heads": None}
    assert ModelConfig.from_hf(null).num_kv_heads == hf_config(tmp_path, copy.deepcopy(null)).num_key_value_heads == 4


def test_architectures_and_model_type_that_disagree_are_refused():
    raw = {**LLAMA, "model_type": "mistral", "sliding_window": 32}  # transformers builds a Mistral from it
    with pytest.raises(UnsupportedModelError, match="model_type 'mistral'.*LlamaForCausalLM"):
        ModelConfig.from_hf(raw)
    with pytest.raises(UnsupportedModelError, match="model_type 'qwen3'"):
        ModelConfig.from_hf({**QWEN2, "model_type": "qwen3"})
    assert ModelConfig.from_hf({k: v for k, v in LLAMA.items() if k != "model_type"}).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_a_quantized_config_is_refused_at_config_read(tmp_path, method):
    raw = {**QWEN3, "quantization_config": {"quant_method": method, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"quantized checkpoints \\(quant_method {method}\\) are not supported "
                                              "by the native engine; use --backend sglang or a bf16/fp16/fp32"):
        read_model_config(tmp_path)


def test_a_float8_tensor_is_named_float8_in_the_errors(tmp_path):
    cfg = ModelConfig.from_hf(LLAMA)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(dtype)
        save_file(tensors, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps(LLAMA))
        for check in (lambda: check_weight_headers(tmp_path, cfg), lambda: load_checkpoint(tmp_path)):
            with pytest.raises(CheckpointError, match=f"q_proj.weight.*{dtype}.*quantized"):
                check()


def test_rope_theta_in_the_rope_scaling_block_gives_transformers_logits(tmp_path):
    raw = {**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0}}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(tmp_path, copy.deepcopy(raw))).eval()
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    native = build_model(ModelConfig.from_hf(copy.deepcopy(raw)), tensors, max_len=64)
    native.allocate_kv_cache(num_blocks=8, block_size=4)
    tokens = torch.randint(0, 50, (24,))
    with torch.inference_mode():
        want = model(tokens[None]).logits[0]
        meta = AttentionMetadata.build([24], [0], [list(range(8))], 4)
        got = native.compute_logits(native(tokens, torch.arange(24), meta))
    assert (got - want).abs().max().item() <= 1e-4
