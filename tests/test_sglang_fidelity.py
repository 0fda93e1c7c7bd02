"""The SGLang backend does what real SGLang would with what TLT hands it (an audit that read SGLang 0.5.x's source):

- A drafter exported for a target with tied embeddings (Qwen2.5-0.5B..3B, Llama-3.2-1B/3B) carried
  `tie_word_embeddings: true` into the draft's config.json; SGLang's qwen2_eagle / llama_eagle then alias lm_head to
  embed_tokens, and EAGLEWorker's `set_embed_and_head` (`del embed_tokens.weight; del lm_head.weight`) raises
  AttributeError at startup (sgl-project/sglang PR #33964). The export writes false; a tied draft folder is refused.
- `--max-model-len`, `--dtype`, `--max-num-seqs` with `--backend sglang` went to [rollout.engine], which no SGLang
  replica reads: they become [sglang] context_length, dtype, max_running_requests, and reach SGLang's ServerArgs.
- With speculation off a drafter push was accepted and stamped as served (real SGLang loads nothing: no draft
  worker); it is refused as the native engine refuses it.

Faked: SGLang itself (it needs a CUDA GPU and is an optional extra never installed by default): `FakeSGLang`
(tests/sglang_fakes.py) stands in at the `SGLangClient` boundary. The export, the config loading, the launch
arguments and the adapter are the real ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_fakes import FakeSGLang, replica_config, serve_args, write_checkpoint
from tlt.services.rollout import serve
from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
from tlt.services.rollout.sglang_backend.engine import SGLangEngine
from tlt.services.rollout.sglang_backend.launch import check_draft_model, engine_kwargs


# -- tied embeddings -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_tied_targets_export_does_not_tie_the_draft(tmp_path: Path, family: str) -> None:
    from tlt.model.testing import random_checkpoint
    from tlt.services.drafter.training import new_drafter

    model = random_checkpoint(tmp_path / "m", family=family, tie_word_embeddings=True, num_hidden_layers=1)
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True
    new_drafter(model, seed=1).save(tmp_path / "d")
    out = tmp_path / "sg"
    subprocess.run([sys.executable, "-m", "tlt.cli", "drafter", "export", "--drafter", str(tmp_path / "d"),
                    "--model", str(model), "--format", "sglang-eagle", "--out", str(out)], check=True,
                   capture_output=True)
    cfg = json.loads((out / "config.json").read_text())
    # SGLang's EAGLE model ties lm_head to embed_tokens when this is true, and set_embed_and_head then deletes
    # the same weight twice; the draft takes the target's embedding and head from set_embed_and_head anyway
    assert cfg["tie_word_embeddings"] is False
    check_draft_model(SGLangBackendConfig(draft_model_path=str(out)))  # the folder SGLang starts from is accepted


def test_a_draft_folder_that_ties_its_embeddings_is_refused_naming_the_reexport(tmp_path: Path) -> None:
    from tlt.model.drafter import DrafterError

    folder = tmp_path / "old-export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLMEagle"], "model_type": "qwen2", "tie_word_embeddings": True}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(DrafterError, match="tie_word_embeddings.*tlt drafter export"):
        check_draft_model(SGLangBackendConfig(draft_model_path=str(folder)))


# -- vLLM's engine flags with --backend sglang ------------------------------------------------------------


def test_vllm_engine_flags_reach_sglangs_launch(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path)  # max_position_embeddings 128
    cfg = replica_config(serve_args("--spec", "off", "--max-model-len", "64", "--dtype", "half", "--max-num-seqs", "4"))
    assert (cfg.context_length, cfg.dtype, cfg.max_running_requests) == (64, "float16", 4)
    kw = engine_kwargs(cfg, model, 0)
    assert (kw["context_length"], kw["dtype"], kw["max_running_requests"]) == (64, "float16", 4)
    eng = SGLangEngine(model, cfg, client=FakeSGLang())
    assert eng.max_model_len == 64  # requests are sized and refused against SGLang's context, not the model's

    assert "context_length" not in engine_kwargs(replica_config(serve_args("--spec", "off")), model, 0)
    assert replica_config(serve_args("--spec", "off", "--dtype", "auto")).dtype == "auto"  # SGLang has an auto
    assert replica_config(serve_args("--spec", "off", "--max-model-len", "1K")).context_length == 1024


def test_vllm_engine_flags_with_sglang_are_not_refused_by_the_native_engines_section() -> None:
    cfg = serve.build_config(serve_args("--spec", "off", "--dtype", "auto", "--max-model-len", "64"))
    assert cfg.backend == "sglang"  # and not "auto is not a dtype of [rollout.engine]": nothing there reads it


# -- a drafter push with speculation off ------------------------------------------------------------------


def test_a_drafter_push_without_speculation_is_refused(tmp_path: Path) -> None:
    fake = FakeSGLang()
    eng = SGLangEngine(write_checkpoint(tmp_path), SGLangBackendConfig(speculative_algorithm="none",
                                                                        return_hidden_states=False), client=fake)
    with pytest.raises(ValueError, match="no speculative decoder"):
        eng.update_weights("drafter", {"fc.weight": torch.zeros(8, 16)}, 1)
    assert eng.versions.drafter == -1 and fake.calls == []
