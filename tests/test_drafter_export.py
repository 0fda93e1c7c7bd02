"""`tlt drafter export --format sglang-eagle`: names, shapes and config against the mapping read
from SGLang's loaders (llama_eagle.py / qwen2_eagle.py; documented in docs/DRAFTER.md), and the
exported function equals ours (fc.bias is zero)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tlt.model.testing import random_checkpoint
from tlt.services.drafter.export import sglang_config, sglang_tensors
from tlt.services.drafter.training import new_drafter

LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


@pytest.mark.parametrize("family,arch,bias", [("qwen2", "Qwen2ForCausalLMEagle", True),
                                              ("llama", "LlamaForCausalLMEagle", False)])
def test_export_names_and_config(tmp_path, family, arch, bias) -> None:
    model = random_checkpoint(tmp_path / "m", family=family)
    d = new_drafter(model, seed=1)
    d.save(tmp_path / "d")
    out = tmp_path / "sg"
    subprocess.run([sys.executable, "-m", "tlt.cli", "drafter", "export", "--drafter", str(tmp_path / "d"),
                    "--model", str(model), "--format", "sglang-eagle", "--out", str(out)], check=True)
    t = load_file(str(out / "model.safetensors"))
    # readable like the config beside them, by the SGLang process's user too (safetensors wrote 0600)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    mode = {f: (tmp_path / "d" / f).stat().st_mode & 0o777 for f in ("model.safetensors", "drafter_config.json")}
    assert mode["model.safetensors"] == mode["drafter_config.json"]
    want = {"fc.weight", "fc.bias", *(f"layers.0.{n}" for n in LAYER)}
    if bias:
        want |= {f"layers.0.self_attn.{p}_proj.bias" for p in "qkv"}
    assert set(t) == want  # no "model." prefix (SGLang adds it), no embed/lm_head, no input_layernorm
    h = d.cfg.hidden_size
    assert t["fc.weight"].shape == (h, 2 * h) and torch.equal(t["fc.bias"], torch.zeros(h))
    assert torch.equal(t["fc.weight"], d.fc.weight.detach())
    assert torch.equal(t["layers.0.mlp.down_proj.weight"], d.layer.mlp.down_proj.weight.detach())
    cfg = json.loads((out / "config.json").read_text())
    target = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["num_hidden_layers"] == 1
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
              "rms_norm_eps", "rope_theta", "model_type"):
        assert cfg.get(k) == target.get(k), k


def test_export_refuses_shared_tensors_and_unknown_families() -> None:
    with pytest.raises(ValueError, match="must not carry"):
        sglang_tensors({"fc.weight": torch.zeros(2, 4), "embed_tokens.weight": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="EAGLE loaders"):
        sglang_config({"model_type": "qwen3"})


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_exported_config_loads_with_transformers(tmp_path, family) -> None:
    """SGLang reads the draft config with transformers' AutoConfig: the target's per-layer `layer_types`
    (written by recent transformers) must shrink with num_hidden_layers = 1, or the config is refused."""
    from transformers import AutoConfig

    model = random_checkpoint(tmp_path / "m", family=family, num_hidden_layers=2)
    target = json.loads((model / "config.json").read_text())
    out = tmp_path / "sg"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(sglang_config(target)))
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.num_hidden_layers == 1 and cfg.architectures == [sglang_config(target)["architectures"][0]]
    if getattr(cfg, "layer_types", None) is not None:
        assert cfg.layer_types == ["full_attention"]


def test_a_drafter_made_for_another_layer_shape_or_rope_is_refused(tmp_path) -> None:
    """SGLang builds the draft layer from the exported config.json, the target's: a drafter whose heads x head_dim
    had the same product, or whose RoPE differed (a target with rope_scaling), was exported without a word."""
    from tlt.services.common.config import ConfigError
    from tlt.services.drafter.export import export_sglang

    model = random_checkpoint(tmp_path / "m", family="qwen2")
    other = random_checkpoint(tmp_path / "o", family="qwen2", rope_theta=1e6)  # same shapes, other RoPE
    new_drafter(other, seed=1).save(tmp_path / "d")
    with pytest.raises(ConfigError, match="rope_theta: drafter 1000000.0, target 10000.0"):
        export_sglang(tmp_path / "d", model, tmp_path / "sg")
    assert not (tmp_path / "sg").exists()
    new_drafter(model, seed=1).save(tmp_path / "ok")
    assert (export_sglang(tmp_path / "ok", model, tmp_path / "sg")[0] / "config.json").is_file()


def test_the_drafter_shares_the_head_the_target_runs(tmp_path) -> None:
    """target_shared: a tied model's head is its embedding; an untied one's is its lm_head.weight; an untied
    config without lm_head.weight is refused (the embedding used to stand in, silently: the engine and
    transformers would not run that head)."""
    from safetensors.torch import save_file

    from tlt.services.drafter.training import target_shared

    untied = random_checkpoint(tmp_path / "untied", tie_word_embeddings=False)
    tensors = load_file(str(untied / "model.safetensors"))
    _, embed, head = target_shared(untied)
    assert torch.equal(head, tensors["lm_head.weight"]) and not torch.equal(head, embed)
    tied = random_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    _, embed, head = target_shared(tied)
    assert torch.equal(head, embed)
    del tensors["lm_head.weight"]
    save_file(tensors, str(untied / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no lm_head.weight.*tie_word_embeddings=false"):
        target_shared(untied)


def test_a_drafter_tensor_of_the_targets_head_is_refused() -> None:
    """The target's lm_head, like its embedding, is the rollout's own (SGLang's set_embed_and_head): a drafter
    carrying one is refused, not exported under its own name."""
    with pytest.raises(ValueError, match="must not carry the target's lm_head.weight"):
        sglang_tensors({"fc.weight": torch.zeros(2, 4), "lm_head.weight": torch.zeros(3, 2)})


def test_the_export_writes_only_into_a_new_empty_or_earlier_export_folder(tmp_path) -> None:
    """The export writes config.json and model.safetensors into --out: given the target's folder, the drafter's, or
    any folder of other files, it replaced their own. Refused before anything is written; a new or empty folder and an
    earlier export (rewritten) are taken."""
    from tlt.services.common.config import ConfigError
    from tlt.services.drafter.export import check_out

    model = random_checkpoint(tmp_path / "m", family="qwen2")
    new_drafter(model, seed=1).save(tmp_path / "d")
    with pytest.raises(ConfigError, match="is a drafter folder"):
        check_out(tmp_path / "d")
    with pytest.raises(ConfigError, match="holds a model that is not an SGLang EAGLE export"):
        check_out(model)  # a config.json with architectures, but the target's
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.safetensors").write_bytes(b"weights of something else")
    with pytest.raises(ConfigError, match="neither empty nor an earlier export"):
        check_out(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "config.json").write_text(json.dumps(sglang_config({"model_type": "llama"})))
    for ok in ("new", "empty", "earlier"):
        check_out(tmp_path / ok)


def _coordinator_checkpoint(tmp_path, model):  # noqa: ANN001, ANN202
    """A real coordinator's checkpoint_dir whose serving drafter (v7) differs from its candidate (v9)."""
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.training import own_tensors

    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False, eval_interval_s=1e9)
    coord = Coordinator(cfg, str(model), None, None)
    try:
        serving = own_tensors(new_drafter(model, seed=5))
        coord.serving, coord.serving_version = serving, 7
        coord.candidate.load_tensors(own_tensors(new_drafter(model, seed=6)))
        coord.candidate_version = 9
        coord.save_now()
    finally:
        coord.close()
    return tmp_path / "ckpt", serving


def test_a_runs_online_drafter_is_exported_from_the_trainers_checkpoint(tmp_path) -> None:
    """A run's online drafter lived only in the elastic trainer's coordinator.pt: `tlt drafter export` refused that
    folder ("not a drafter folder"), so the drafter trained beside the policy could be served nowhere after the run.
    --drafter now takes the checkpoint_dir (or the file) and exports its SERVING drafter (not the candidate), as a
    drafter folder of ours (--format tlt, which the rollout loads) or for SGLang."""
    from tlt.model.drafter import load_drafter
    from tlt.services.drafter.training import own_tensors, target_shared

    model = random_checkpoint(tmp_path / "m", family="qwen2")
    ckpt, serving = _coordinator_checkpoint(tmp_path, model)
    cli = [sys.executable, "-m", "tlt.cli", "drafter", "export", "--model", str(model)]
    done = subprocess.run([*cli, "--drafter", str(ckpt), "--format", "tlt", "--out", str(tmp_path / "own")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "serving_version=7" in done.stderr
    _, embed, head = target_shared(model)
    got = own_tensors(load_drafter(tmp_path / "own", embed, head))
    assert set(got) == set(serving) and all(torch.equal(got[k], serving[k]) for k in serving)
    done = subprocess.run([*cli, "--drafter", str(ckpt / "coordinator.pt"), "--out", str(tmp_path / "sg")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert torch.equal(load_file(str(tmp_path / "sg" / "model.safetensors"))["fc.weight"], serving["fc.weight"])


def test_an_export_source_that_is_not_a_drafter_is_refused_in_one_line(tmp_path) -> None:
    """Neither a drafter folder nor a checkpoint_dir; a checkpoint of another target's shape; a --format tlt --out
    that holds files (a run's drafter-init, which its checkpoints' lineage names): each refused before writing."""
    model = random_checkpoint(tmp_path / "m", family="qwen2")
    small = random_checkpoint(tmp_path / "s", family="qwen2", hidden_size=32, intermediate_size=64)
    ckpt, _ = _coordinator_checkpoint(tmp_path, model)
    new_drafter(model, seed=1).save(tmp_path / "d")
    (tmp_path / "empty").mkdir()
    cli = [sys.executable, "-m", "tlt.cli", "drafter", "export", "--format", "tlt"]
    for args, says in [
        (["--drafter", str(tmp_path / "empty"), "--model", str(model), "--out", str(tmp_path / "o1")],
         "is neither a drafter folder"),
        (["--drafter", str(ckpt), "--model", str(small), "--out", str(tmp_path / "o2")],
         "serving drafter does not fit the target"),
        (["--drafter", str(ckpt), "--model", str(model), "--out", str(tmp_path / "d")], "is not empty"),
    ]:
        done = subprocess.run([*cli, *args], capture_output=True, text=True)
        assert done.returncode != 0 and says in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["drafter_config.json", "model.safetensors"]


def test_a_trainers_checkpoint_given_where_a_drafter_folder_is_wanted_names_the_export(tmp_path) -> None:
    """`tlt rollout serve --drafter runs/<id>/drafter` (and every other loader) said only "not a drafter folder":
    the refusal now says that folder is a drafter trainer's checkpoint and which command makes it a drafter."""
    from tlt.model.drafter import DrafterError, check_drafter_folder

    model = random_checkpoint(tmp_path / "m", family="qwen2")
    ckpt, _ = _coordinator_checkpoint(tmp_path, model)
    with pytest.raises(DrafterError, match=rf"checkpoint_dir, whose serving drafter `tlt drafter export --drafter "
                                           rf"{ckpt} --model MODEL --format tlt"):
        check_drafter_folder(ckpt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DrafterError, match=r"model.safetensors$"):  # no hint where there is no checkpoint
        check_drafter_folder(tmp_path / "empty")


def test_a_cut_short_trainer_checkpoint_is_refused_in_one_line(tmp_path) -> None:
    """coordinator.pt cut short by a copy (or another file of that name): one line naming it, not torch's traceback."""
    model = random_checkpoint(tmp_path / "m", family="qwen2")
    ckpt, _ = _coordinator_checkpoint(tmp_path, model)
    data = (ckpt / "coordinator.pt").read_bytes()
    (ckpt / "coordinator.pt").write_bytes(data[: len(data) // 2])
    done = subprocess.run([sys.executable, "-m", "tlt.cli", "drafter", "export", "--format", "tlt", "--drafter",
                           str(ckpt), "--model", str(model), "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert done.returncode == 2 and "is not a readable drafter trainer checkpoint" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "o").exists()
