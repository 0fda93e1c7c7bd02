"""Stand-ins for SGLang in the backend tests (SGLang needs a CUDA GPU and is an optional extra).

- `sglang_chunk`: a stream chunk laid out as SGLang 0.5.23's TokenizerManager yields it for a
  streamed request with cumulative output (`output_ids`, `meta_info.output_token_logprobs` as
  (logprob, id, text) triples, `finish_reason` dicts with a "type").
- `FakeSGLang`: the `SGLangClient` boundary, recording every call in order.
- `model_dir`-style checkpoint: `write_checkpoint(folder)` writes config.json and one safetensors file.
"""

from __future__ import annotations

import json

import torch

from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
from tlt.services.rollout.sglang_backend.engine import SGLangEngine
from tlt.services.rollout.sglang_backend.requests import StreamChunk, parse_chunk


def sglang_chunk(rid, ids, lps=None, finish=None, text=None, **meta):
    """A chunk as TokenizerManager._handle_batch_output yields it (non-incremental stream)."""
    meta_info = {"id": rid, "finish_reason": finish, "prompt_tokens": 3, "weight_version": "0", **meta}
    if lps is not None:
        meta_info["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(lps, ids)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta_info}


class FakeSGLang:
    """Records calls; `poll` hands out the chunks queued with `feed`."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.pending: list[StreamChunk] = []
        self.submitted = {}

    def feed(self, *chunks):
        self.pending.extend(parse_chunk(c) for c in chunks)

    def submit(self, call):
        self.submitted[call.rid] = call
        self.calls.append(("submit", call.rid))

    def poll(self, timeout_s):
        out, self.pending = self.pending, []
        return out

    def abort(self, rid):
        self.calls.append(("abort", rid))
        self.feed(sglang_chunk(rid, [], finish={"type": "abort", "message": "aborted by user"}))

    def pause_generation(self, mode):
        self.calls.append(("pause", mode))

    def continue_generation(self):
        self.calls.append(("continue",))

    def begin_weight_update(self, selector):
        self.calls.append(("begin", selector))

    def update_weights_from_tensor(self, call, tensors):
        self.calls.append(("update", call.selector, call.flush_cache, call.weight_version, tuple(n for n, _ in tensors)))

    def end_weight_update(self):
        self.calls.append(("end",))

    def flush_cache(self):
        self.calls.append(("flush",))

    def release_memory_occupation(self, tags):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags):
        self.calls.append(("resume", tuple(tags)))

    def shutdown(self):
        self.calls.append(("shutdown",))


def make_engine(model_dir, **cfg):
    fake = FakeSGLang()
    config = SGLangBackendConfig(draft_model_path="/drafter", **cfg)
    return SGLangEngine(model_dir, config, replica_id=1, client=fake), fake


def write_checkpoint(folder):
    (folder / "config.json").write_text(json.dumps(
        {"vocab_size": 64, "hidden_size": 8, "max_position_embeddings": 128, "eos_token_id": 2}))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(64, 8, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    return str(folder)
