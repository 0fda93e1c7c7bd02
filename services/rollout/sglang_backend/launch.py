"""Launch arguments for one SGLang engine replica (pure functions, no SGLang import).

    SGLangBackendConfig + model dir + replica id -> ServerArgs keyword arguments
    spec_batch_threshold + adaptive_steps         -> adaptive JSON (written to a file)

`sglang.Engine(**kwargs)` takes `ServerArgs` fields as keyword arguments
(`sglang/srt/entrypoints/engine.py`, `Engine.__init__`). Every name below is a
field of SGLang 0.5.23's `ServerArgs`; `tests/test_sglang_contract.py` builds a
real `ServerArgs` from this dict where SGLang can be imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig


def adaptive_spec_config(cfg: SGLangBackendConfig) -> dict[str, dict[str, Any]]:
    """SGLang's adaptive config with TLT's batch-size threshold folded in.

    SGLang routes a batch to the slot with the largest key <= batch size
    (`AdaptiveStepRouter.batch_size_key_for_batch` in
    sglang/srt/speculative/adaptive_step_router.py), after padding the batch
    to a captured CUDA-graph size; a batch below the smallest key uses it. A slot whose only candidate is 0 decodes
    without drafting, so `threshold + 1 -> [0]` switches SD off above the
    threshold, as TLT's engine does (up to that padding: a batch just under
    the threshold can pad past it and run without drafting).
    """
    limit = cfg.spec_batch_threshold
    slots: dict[str, dict[str, Any]] = {}
    for key in sorted(cfg.adaptive_steps, key=int):
        if int(key) <= limit:
            slots[key] = {"candidate_steps": sorted(set(cfg.adaptive_steps[key]))}
    slots[str(limit + 1)] = {"candidate_steps": [0]}
    if "1" not in slots:  # the smallest batches need a slot of their own
        slots["1"] = {"candidate_steps": [cfg.num_steps]}
    # The depth SGLang starts from must be a candidate of some slot
    # (`_init_adaptive_speculative_params` in sglang/srt/arg_groups/speculative_hook.py).
    if not any(cfg.num_steps in s["candidate_steps"] for s in slots.values()):
        slots["1"]["candidate_steps"] = sorted({*slots["1"]["candidate_steps"], cfg.num_steps})
    return dict(sorted(slots.items(), key=lambda kv: int(kv[0])))


def check_draft_model(cfg: SGLangBackendConfig, look: bool = True) -> None:
    """ConfigError unless speculation is off or a draft model is named; with `look`, DrafterError unless that
    folder is an SGLang EAGLE export. SGLang reads an export (config.json with an `...ForCausalLMEagle`
    architecture and its own tensor names), not TLT's drafter folder, and fails minutes into loading otherwise."""
    from tlt.model.drafter import CONFIG_FILE, DrafterError
    from tlt.services.common.config import ConfigError
    from tlt.services.drafter.export import ARCHITECTURES, export_config

    if cfg.speculative_algorithm == "none":
        return
    folder = Path(cfg.draft_model_path) if cfg.draft_model_path else None
    if folder is None:
        raise ConfigError(
            f"SGLang's {cfg.speculative_algorithm} speculative decoding needs a drafter: pass --drafter DIR (a "
            "`tlt drafter export --format sglang-eagle` folder) or set [sglang] draft_model_path; or decode without "
            "one: --spec off ([sglang] speculative_algorithm = 'none')"
        )
    if not look:
        return
    export = f"tlt drafter export --drafter DIR --model MODEL --format sglang-eagle --out {folder}-sglang"
    if (folder / CONFIG_FILE).is_file():
        raise DrafterError(f"{folder} is TLT's drafter folder; SGLang loads an export of it: {export}")
    if not folder.is_dir():
        raise DrafterError(f"drafter folder {folder} does not exist ([sglang] draft_model_path, or --drafter)")
    config = export_config(folder)
    archs = None if config is None else list(config.get("architectures") or [])
    if archs is None or not (folder / "model.safetensors").is_file():
        raise DrafterError(f"{folder} is not an SGLang EAGLE export: it needs config.json and model.safetensors "
                           f"({export})")
    if cfg.speculative_algorithm == "EAGLE" and not set(archs) & set(ARCHITECTURES.values()):
        raise DrafterError(f"{folder} holds {archs or 'no architecture'}, not an EAGLE draft model "
                           f"({sorted(ARCHITECTURES.values())}); write one with {export}")
    if cfg.speculative_algorithm == "EAGLE" and config.get("tie_word_embeddings"):
        # SGLang's qwen2_eagle / llama_eagle alias lm_head to embed_tokens, and EAGLEWorker's set_embed_and_head
        # (`del embed_tokens.weight; del lm_head.weight`) then raises AttributeError once the target has loaded
        raise DrafterError(f"{folder}/config.json has tie_word_embeddings true, which SGLang's EAGLE worker fails "
                           f"on at startup (an export from before this was fixed, of a tied target); export it "
                           f"again: {export}")
    if cfg.speculative_algorithm == "EAGLE3" and set(archs) & set(ARCHITECTURES.values()):
        # SGLang's EAGLE3 worker feeds the draft model three of the target's layers; an EAGLE-1 layer such as
        # TLT's export (fc over 2 x hidden) fails inside SGLang, after the target has loaded.
        raise DrafterError(f"{folder} holds {archs}, an EAGLE draft model (TLT's export), not an EAGLE3 one: set "
                           "[sglang] speculative_algorithm = 'EAGLE'")


def reserved_tokens(cfg: SGLangBackendConfig) -> int:
    """Output-token slots SGLang reserves per request on top of the prompt with an EAGLE drafter.

    `compute_num_reserved_tokens` (sglang/srt/managers/utils.py):
    max(eagle_topk * num_steps, max_speculative_num_draft_tokens), where the
    maximum is num_draft_tokens for a static configuration and
    max(candidate_steps) + 1 in adaptive mode. `TokenizerManager._validate_one_request`
    adds it to the prompt length and refuses (ValueError) a prompt with
    prompt + reserved >= context length, or prompt + reserved + max_new_tokens
    > context length (`validate_total_tokens` is always on).
    """
    if cfg.speculative_algorithm == "none":
        return 0
    if cfg.adaptive:
        steps = {s for slot in adaptive_spec_config(cfg).values() for s in slot["candidate_steps"]}
        max_draft = max(steps) + 1
    else:
        max_draft = cfg.draft_tokens
    return max(cfg.eagle_topk * cfg.num_steps, max_draft)


def write_adaptive_config(cfg: SGLangBackendConfig, run_dir: Path) -> Path:
    path = run_dir / "sglang-adaptive-spec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(adaptive_spec_config(cfg), indent=2))
    return path


def engine_kwargs(
    cfg: SGLangBackendConfig,
    model_dir: str,
    replica_id: int,
    adaptive_config_path: str | None = None,
) -> dict[str, Any]:
    """`sglang.Engine(**engine_kwargs(...))` for replica `replica_id`."""
    kwargs: dict[str, Any] = {
        "model_path": model_dir,
        "tp_size": cfg.tp_size,
        "base_gpu_id": replica_id * cfg.tp_size,
        "dtype": cfg.dtype,
        "mem_fraction_static": cfg.mem_fraction_static,
        "random_seed": cfg.random_seed + replica_id,
        # Cumulative stream chunks: the adapter slices what is new itself.
        "incremental_streaming_output": False,
        "enable_memory_saver": cfg.enable_memory_saver,
    }
    if cfg.max_running_requests:
        kwargs["max_running_requests"] = cfg.max_running_requests
    if cfg.context_length:
        kwargs["context_length"] = cfg.context_length
    if cfg.deterministic_inference:
        kwargs["enable_deterministic_inference"] = True
    if cfg.return_hidden_states:
        kwargs["enable_return_hidden_states"] = True
    if cfg.speculative_algorithm == "none":
        return kwargs
    check_draft_model(cfg, look=False)  # the folder itself: checked before the replicas start (serve.py)
    if cfg.enable_memory_saver and "weights" in cfg.release_tags:
        # Releasing "weights" drops the draft model's parameters AND buffers (rotary
        # caches): SGLang's resume restores only the target's buffers
        # (`_import_static_state(tp_worker.model_runner.model, ...)` in
        # scheduler_components/weight_updater.py), so a re-pushed drafter would still
        # run on garbage buffers. With this flag the draft runner loads inside a
        # CPU-backed memory-saver region (ModelRunner.load_model) and comes back intact.
        kwargs["enable_draft_weights_cpu_backup"] = True
    kwargs.update(
        speculative_algorithm=cfg.speculative_algorithm,
        speculative_draft_model_path=cfg.draft_model_path,
        speculative_num_steps=cfg.num_steps,
        speculative_eagle_topk=cfg.eagle_topk,
    )
    if cfg.adaptive:
        if adaptive_config_path is None:
            raise ValueError("adaptive mode needs the path of the adaptive JSON (write_adaptive_config)")
        # SGLang derives num_draft_tokens = num_steps + 1 itself in adaptive mode.
        kwargs.update(speculative_adaptive=True, speculative_adaptive_config=adaptive_config_path)
    else:
        kwargs["speculative_num_draft_tokens"] = cfg.draft_tokens
    return kwargs
