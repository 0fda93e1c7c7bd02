"""`tlt drafter export`: write a drafter the way SGLang's EAGLE loaders read it, or as a drafter folder of ours.

    tlt drafter export --drafter DIR --model TARGET_DIR --format sglang-eagle --out OUT
    tlt drafter export --drafter runs/<id>/drafter --model runs/<id>/policy --format tlt --out runs/<id>/policy-drafter

--drafter is a drafter folder (drafter_config.json + model.safetensors) or the elastic drafter trainer's
checkpoint_dir (coordinator.pt): there the serving drafter is taken, the one the rollout last took through the
acceptance gate. A run's online drafter lives only in that checkpoint; `--format tlt` makes it a drafter folder
(`tlt rollout serve --drafter`, `[run] drafter_init`, `[rollout.spec] drafter_path`).

SGLang (python/sglang/srt/models/llama_eagle.py, qwen2_eagle.py) builds `LlamaForCausalLMEagle` /
`Qwen2ForCausalLMEagle` from a normal HF config with `num_hidden_layers = 1`; its `load_weights`
prefixes every checkpoint name with "model." and skips names containing "lm_head"; its model has
`model.fc = Linear(2H, H)` WITH a bias, and decoder layer 0 has no input_layernorm (it is replaced
by the identity). The EAGLE worker (python/sglang/srt/speculative/eagle_worker.py) then shares the
target's embedding and lm_head with the draft model (`set_embed_and_head`), so neither is exported.

    ours                                   SGLang checkpoint name
    fc.weight [H, 2H]                  ->  fc.weight
    (no bias)                          ->  fc.bias = zeros [H]   (same function)
    layer.self_attn.{q,k,v}_proj.*     ->  layers.0.self_attn.{q,k,v}_proj.*
    layer.self_attn.o_proj.weight      ->  layers.0.self_attn.o_proj.weight
    layer.post_attention_layernorm.*   ->  layers.0.post_attention_layernorm.weight
    layer.mlp.{gate,up,down}_proj.*    ->  layers.0.mlp.{gate,up,down}_proj.weight

config.json = the target's, with architectures [<Family>ForCausalLMEagle], num_hidden_layers 1 (and
layer_types, when the target's config has that per-layer list, ["full_attention"]) and tie_word_embeddings false:
SGLang's EAGLE model aliases lm_head to embed_tokens when it is true, and set_embed_and_head, which deletes both
weights to take the target's, then fails with AttributeError (a tied target: Qwen2.5-0.5B..3B, Llama-3.2-1B/3B).
See docs/DRAFTER.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module to build its parser: keep torch out of it
    import torch

    from tlt.model.drafter import Drafter, DrafterConfig

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLMEagle", "llama": "LlamaForCausalLMEagle"}


def sglang_tensors(own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our drafter's state dict -> SGLang EAGLE checkpoint names (see the module docstring)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in own.items():
        if "embed" in name or "lm_head" in name:
            raise ValueError(f"the drafter must not carry the target's {name}; SGLang shares the target's")
        if name == "fc.weight":
            out["fc.weight"] = t
            out["fc.bias"] = torch.zeros(t.shape[0], dtype=t.dtype)
        elif name.startswith("layer."):
            out["layers.0." + name.removeprefix("layer.")] = t
        else:
            raise ValueError(f"unexpected drafter tensor {name!r}")
    return out


def sglang_config(target_config: dict) -> dict:
    family = target_config.get("model_type", "")
    if family not in ARCHITECTURES:
        from tlt.services.common.config import ConfigError  # the user's --model: `tlt` reports it in one line

        raise ConfigError(f"SGLang has EAGLE loaders for {sorted(ARCHITECTURES)} targets, not {family!r}")
    cfg = dict(target_config)
    cfg["architectures"] = [ARCHITECTURES[family]]
    cfg["num_hidden_layers"] = 1
    cfg["tie_word_embeddings"] = False  # the draft's head is the target's (set_embed_and_head): see the docstring
    if cfg.get("layer_types") is not None:  # per-layer list (recent transformers): one full-attention layer,
        cfg["layer_types"] = ["full_attention"]  # or AutoConfig refuses num_hidden_layers != len(layer_types)
    return cfg


def coordinator_checkpoint(source: str | Path) -> Path | None:
    """The coordinator checkpoint `source` is (the file) or holds (its checkpoint_dir); None when neither."""
    from tlt.model.drafter import TRAINER_CHECKPOINT

    path = Path(source)
    if path.is_file() and path.name == TRAINER_CHECKPOINT:
        return path
    return path / TRAINER_CHECKPOINT if (path / TRAINER_CHECKPOINT).is_file() else None


def source_drafter(source: str | Path, target: DrafterConfig, embed: torch.Tensor,
                   head: torch.Tensor) -> tuple[Drafter, int | None]:
    """The drafter `source` holds, sharing the target's `embed` / `head`, and its version: a drafter folder as saved
    (None), or a coordinator checkpoint's serving drafter (its layer is the target's shape, `target`). DrafterError
    when `source` is neither, or its weights do not fit."""
    from tlt.model.drafter import CONFIG_FILE, TRAINER_CHECKPOINT, WEIGHTS_FILE, Drafter, DrafterError, load_drafter
    from tlt.services.drafter.training import load_state

    if (Path(source) / CONFIG_FILE).is_file():
        return load_drafter(source, embed, head), None  # names and shapes against its own config
    ckpt = coordinator_checkpoint(source)
    if ckpt is None:
        raise DrafterError(f"{source} is neither a drafter folder ({CONFIG_FILE} + {WEIGHTS_FILE}) nor an elastic "
                           f"drafter trainer's checkpoint_dir ({TRAINER_CHECKPOINT}, e.g. runs/<id>/drafter)")
    try:
        state = load_state(ckpt)
    except Exception as e:  # deliberate boundary: torch.load's errors of a cut-short or foreign file vary
        raise DrafterError(f"{ckpt} is not a readable drafter trainer checkpoint ({(str(e).splitlines() or [repr(e)])[0][:200]})") from None
    if not isinstance(state, dict) or not isinstance(state.get("serving"), dict):
        raise DrafterError(f"{ckpt} holds no serving drafter (not a checkpoint of `tlt drafter serve`)")
    drafter = Drafter(target, embed, head)
    try:
        drafter.load_tensors(state["serving"])
    except DrafterError as e:
        raise DrafterError(f"{ckpt}'s serving drafter does not fit the target: {e}; export it with the model "
                           "its run trained") from None
    return drafter, int(state.get("serving_version", 0))


def export_sglang(drafter_dir: str | Path, model_dir: str | Path, out_dir: str | Path) -> tuple[Path, int | None]:
    from safetensors.torch import load_file, save_file

    from tlt.model.drafter import WEIGHTS_FILE
    from tlt.model.files import share_weights
    from tlt.services.drafter.training import target_shared

    target, embed, head = target_shared(model_dir)
    drafter, version = source_drafter(drafter_dir, target, embed, head)  # vocab, hidden: the target's
    # SGLang builds the draft layer from the config.json written here, the TARGET's: a drafter of another layer
    # shape (heads x head_dim of the same product, another MLP width) or RoPE (a target with rope_scaling) loaded
    # silently with the wrong heads or frequencies, or failed only inside SGLang
    differ = [f"{f.name}: drafter {getattr(drafter.cfg, f.name)!r}, target {getattr(target, f.name)!r}"
              for f in dataclasses.fields(target) if getattr(drafter.cfg, f.name) != getattr(target, f.name)]
    if differ:
        from tlt.services.common.config import ConfigError

        raise ConfigError(f"the drafter in {drafter_dir} was not made for the target in {model_dir} "
                          f"({'; '.join(differ)}); export it with the model it was trained on")
    own = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    config = sglang_config(json.loads((Path(model_dir) / "config.json").read_text()))  # refused before writing
    tensors = sglang_tensors(own)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # config.json first: it is what marks the folder an export (check_out), so an export cut short is redone
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    share_weights(out)  # safetensors wrote it 0600: the SGLang process may run as another user
    assert set(load_file(str(out / WEIGHTS_FILE))) == set(tensors)
    return out, version


def export_tlt(drafter_dir: str | Path, model_dir: str | Path, out_dir: str | Path) -> tuple[Path, int | None]:
    """`--format tlt`: the drafter as a drafter folder of ours (Drafter.save), read back before it is reported."""
    import torch

    from tlt.model.drafter import load_drafter
    from tlt.services.drafter.training import own_tensors, target_shared

    target, embed, head = target_shared(model_dir)
    drafter, version = source_drafter(drafter_dir, target, embed, head)
    out = Path(out_dir)
    drafter.save(out)
    again = own_tensors(load_drafter(out, embed, head))
    assert all(torch.equal(again[k], v) for k, v in own_tensors(drafter).items())
    return out, version


def export_config(folder: str | Path) -> dict | None:
    """`folder`'s config.json, or None when there is no readable one (missing, not JSON, or JSON that is no object)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def export_architectures(folder: str | Path) -> list[str] | None:
    """The `architectures` of `folder`'s config.json ([] when it names none), or None when there is no readable
    config.json: what tells an SGLang EAGLE export (`ARCHITECTURES`' values) from another model."""
    config = export_config(folder)
    return None if config is None else list(config.get("architectures") or [])


def check_out(out_dir: str | Path) -> None:
    """ConfigError unless `out_dir` is new, empty or an earlier export: the export writes config.json and
    model.safetensors there, which in the target's or the drafter's folder (or any other model) replaced its own."""
    from tlt.model.drafter import CONFIG_FILE
    from tlt.services.common.config import ConfigError

    out = Path(out_dir)
    hint = "give the export its own folder (e.g. artifacts/tiny-drafter-sglang)"
    if (out / CONFIG_FILE).is_file():
        raise ConfigError(f"--out {out} is a drafter folder ({CONFIG_FILE}); {hint}")
    cfg_path = out / "config.json"
    if cfg_path.is_file():
        if not set(export_architectures(out) or []) & set(ARCHITECTURES.values()):
            raise ConfigError(f"--out {out} holds a model that is not an SGLang EAGLE export ({cfg_path}); {hint}")
    elif out.is_dir() and any(out.iterdir()):  # other files: its model.safetensors was replaced
        raise ConfigError(f"--out {out} is neither empty nor an earlier export (no config.json); {hint}")


RUN_DRAFTER = "policy-drafter"  # beside a run's exported policy (runs/<id>/policy)


def export_run_drafter(run_dir: str | Path, checkpoint_dir: str | Path) -> tuple[Path, int] | None:
    """At the end of a `tlt run` that exported its policy: the online drafter's serving weights, which lived only in
    the coordinator's checkpoint, as a drafter folder runs/<id>/policy-drafter for that policy (replaced whole: a
    continued run writes it again). None when the run had no drafter service (or its checkpoint holds none)."""
    import os
    import shutil
    import time

    run = Path(run_dir)
    source = coordinator_checkpoint(checkpoint_dir)
    if source is None or not (run / "policy" / "config.json").is_file():
        return None
    final, tmp = run / RUN_DRAFTER, run / f".{RUN_DRAFTER}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _, version = export_tlt(source, run / "policy", tmp)
        from tlt.services.trainer.run_folder import EXPORT_RECORD, export_record

        policy = export_record(run / "policy") or {}
        record = {"drafter_version": int(version or 0), "run": run.name, "policy_steps_done": policy.get("steps_done"),
                  "exported_at": time.time()}  # what the report says of it (a drafter folder's loaders ignore it)
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, int(version or 0)


def check_out_tlt(out_dir: str | Path) -> None:
    """ConfigError unless `out_dir` is new or empty: a drafter folder written over another (a run's drafter-init,
    which its checkpoints' lineage names) would replace it."""
    from tlt.services.common.config import ConfigError

    out = Path(out_dir)
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; give the export a new folder (e.g. runs/<id>/policy-drafter)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import out_folder

    parser.add_argument("--drafter", required=True,
                        help="drafter folder (drafter_config.json + model.safetensors), or the elastic drafter "
                             "trainer's checkpoint_dir (coordinator.pt; a run's is runs/<id>/drafter): its serving "
                             "drafter")
    parser.add_argument("--model", required=True, help="the target checkpoint folder the drafter belongs to")
    parser.add_argument("--format", choices=("sglang-eagle", "tlt"), default="sglang-eagle",
                        help="sglang-eagle: config.json + model.safetensors for SGLang's EAGLE; tlt: a drafter folder "
                             "(drafter_config.json + model.safetensors) for `tlt rollout serve --drafter`")
    parser.add_argument("--out", type=out_folder, required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    from tlt.services.common.logging import get_logger

    if args.format == "tlt":
        check_out_tlt(args.out)
        out, version = export_tlt(args.drafter, args.model, args.out)
    else:
        check_out(args.out)
        out, version = export_sglang(args.drafter, args.model, args.out)
    serving = {} if version is None else {"serving_version": version}  # from a checkpoint: which drafter it was
    get_logger("drafter.export").info("drafter_exported", out=str(out), format=args.format, **serving)
    print(out)
    return 0
