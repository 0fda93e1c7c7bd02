"""Stand-ins for SGLang in the backend tests (SGLang needs a CUDA GPU and is an optional extra).

- `sglang_chunk`: a stream chunk laid out as SGLang 0.5.23's TokenizerManager yields it for a
  streamed request with cumulative output (`output_ids`, `meta_info.output_token_logprobs` as
  (logprob, id, text) triples, `finish_reason` dicts with a "type").
- `FakeSGLang`: the `SGLangClient` boundary, recording every call in order.
- `FakeSGLangEngine`: the SGLang adapter over a `FakeSGLang`, as a rollout backend a real server's replica process
  runs (`backend="sglang_fakes:FakeSGLangEngine"`); nothing feeds it, so its samples run until aborted.
- `model_dir`-style checkpoint: `write_checkpoint(folder)` writes config.json and one safetensors file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
from tlt.services.rollout.sglang_backend.engine import SGLangEngine
from tlt.services.rollout.sglang_backend.launch import adaptive_spec_config, engine_kwargs
from tlt.services.rollout.sglang_backend.requests import StreamChunk, parse_chunk
from tlt.services.rollout.types import FinishReason


def sglang_chunk(rid, ids, lps=None, finish=None, text=None, **meta):
    """A chunk as TokenizerManager._handle_batch_output yields it (non-incremental stream)."""
    meta_info = {"id": rid, "finish_reason": finish, "prompt_tokens": 3, "weight_version": "0", **meta}
    if lps is not None:
        meta_info["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(lps, ids)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta_info}


def sglang_reserved_tokens(launch_kwargs, adaptive_slots=None):
    """Draft slots SGLang reserves per request, computed from what SGLang is launched with.

    `compute_num_reserved_tokens` (sglang/srt/managers/utils.py): 0 without an EAGLE
    drafter, else max(eagle_topk * num_steps, max draft tokens), the max draft tokens
    being num_draft_tokens (static) or max(candidate_steps) + 1 (adaptive).
    """
    if launch_kwargs.get("speculative_algorithm") not in ("EAGLE", "EAGLE3"):
        return 0
    topk, steps = launch_kwargs["speculative_eagle_topk"], launch_kwargs["speculative_num_steps"]
    if launch_kwargs.get("speculative_adaptive"):
        max_draft = max(s for slot in adaptive_slots.values() for s in slot["candidate_steps"]) + 1
    else:
        max_draft = launch_kwargs["speculative_num_draft_tokens"]
    return max(topk * steps, max_draft)


class FakeSGLang:
    """Records calls; `poll` hands out the chunks queued with `feed`.

    With `context_len` set it refuses what SGLang's TokenizerManager refuses
    (`_validate_one_request`: prompt + reserved >= context length, or prompt +
    reserved + max_new_tokens > context length, raised as ValueError); the real
    client turns that into an aborted chunk carrying the message, and so does this.
    """

    def __init__(self, context_len=None, reserved_tokens=0):
        self.calls: list[tuple] = []
        self.pending: list[StreamChunk] = []
        self.submitted = {}
        self.streamed = {}  # rid -> the ids of its last chunk
        self.context_len = context_len
        self.reserved_tokens = reserved_tokens

    def feed(self, *chunks):
        for c in chunks:
            chunk = parse_chunk(c)
            self.streamed[chunk.rid] = chunk.output_ids
            self.pending.append(chunk)

    def submit(self, call):
        self.submitted[call.rid] = call
        self.calls.append(("submit", call.rid))
        refusal = self._refusal(call)
        if refusal:
            self.pending.append(StreamChunk(call.rid, [], None, None, FinishReason.ABORT, None, None, error=refusal))

    def _refusal(self, call):
        if self.context_len is None:
            return ""
        input_token_num = len(call.input_ids) + self.reserved_tokens
        if input_token_num >= self.context_len:
            return (f"The input ({input_token_num} tokens) is longer than the model's context length "
                    f"({self.context_len} tokens).")
        max_new = call.sampling_dict().get("max_new_tokens")
        if max_new is not None and max_new + input_token_num > self.context_len:
            return f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens."
        return ""

    def poll(self, timeout_s):
        out, self.pending = self.pending, []
        return out

    def abort(self, rid):
        """As TokenizerManager._handle_abort_req answers a streamed request: only its last id, if any."""
        self.calls.append(("abort", rid))
        last = self.streamed.get(rid, [])[-1:]
        self.feed(sglang_chunk(rid, last, finish={"type": "abort", "message": "aborted by user"}))

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


class _WaitingFakeSGLang(FakeSGLang):
    """A FakeSGLang whose `poll` waits a little when it has nothing, as SGLang's client does: a replica loop polling
    it would spin a core otherwise."""

    def poll(self, timeout_s):
        if not self.pending:
            time.sleep(min(timeout_s, 0.01))
        return super().poll(timeout_s)


class FakeSGLangEngine(SGLangEngine):
    """`SGLangEngine(model_dir, config, replica_id)` as the replica process constructs a backend, over a fake client
    (the [sglang] section's defaults, an EAGLE drafter at /drafter, SGLang's context checks)."""

    def __init__(self, model_dir, config=None, replica_id=0):
        config = SGLangBackendConfig(draft_model_path="/drafter")
        kwargs = engine_kwargs(config, model_dir, 1, adaptive_config_path="/unused.json")
        context_len = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
        self.fake = _WaitingFakeSGLang(context_len, sglang_reserved_tokens(kwargs, adaptive_spec_config(config)))
        super().__init__(model_dir, config, replica_id=replica_id, client=self.fake)


def make_engine(model_dir, **cfg):
    """An adapter over a fake that checks context lengths as SGLang would for this config."""
    config = SGLangBackendConfig(draft_model_path="/drafter", **cfg)
    kwargs = engine_kwargs(config, model_dir, 1, adaptive_config_path="/unused.json")
    context_len = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    fake = FakeSGLang(context_len, sglang_reserved_tokens(kwargs, adaptive_spec_config(config)))
    return SGLangEngine(model_dir, config, replica_id=1, client=fake), fake


def write_checkpoint(folder):
    (folder / "config.json").write_text(json.dumps(
        {"vocab_size": 64, "hidden_size": 8, "max_position_embeddings": 128, "eos_token_id": 2}))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(64, 8, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    return str(folder)


def serve_args(*argv: str):  # noqa: ANN201
    """`tlt rollout serve --model /unused --backend sglang ARGV`, parsed by the command's own parser."""
    import argparse

    from tlt.services.rollout import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(["--model", "/unused", "--backend", "sglang", *argv])


def replica_config(args) -> SGLangBackendConfig:  # noqa: ANN001
    """What a replica process resolves: the preset, then the environment serve exports for it."""
    from tlt.services.common.config import load_config
    from tlt.services.rollout import serve

    env: dict[str, str] = {}
    serve.export_preset(args.preset, env)
    serve.export_sglang_flags(args, env)
    return load_config(SGLangBackendConfig, "sglang", env["TLT_PRESET"], environ=env)
