"""`SGLangEngine`: SGLang behind the same interface as the native `LLMEngine`.

    add_request(GenerationRequest) -> n SGLang streams (rid "<request_id>#<i>")
    step()  -> poll the streams once -> (StepOutput per sample that advanced, CompletionOutput per finished)
    update_weights(kind, tensors, version) -> one SGLang weight-update session
    stats() -> running / queued / versions / spec counters (capacity events come from `running`)
    release() / resume() -> free GPU memory while the trainer runs (colocated), drafter re-pushed after

Weight-update sessions (sglang/srt/managers/scheduler_components/weight_updater.py
refuses tensor updates outside one):

    policy : pause(retract) -> begin("target") -> update(flush_cache=False) -> end -> flush_cache -> continue
    drafter: pause(in_place) -> begin("draft") -> update(flush_cache=False) -> end -> continue

A policy update retracts running requests (their KV is recomputed with the
new weights after `continue`; an in-place pause cannot flush the cache). A
sample that spans a policy update is stamped as the native engine stamps it
(`versions.policy` = the newest version, `versions.policy_min` = the one it
started under) and counted in `stats().spec["policy_spanning"]` (on /metrics as
rollout_replica_policy_spanning_total{replica}); the trainer
normally pushes between steps, when nothing runs. A drafter update leaves the
target's KV cache valid (drafts only change speed, never the output), so it
pauses in place and does not flush.

The drafter is kept on the CPU after every push and pushed again after
`resume()` brings back the weights: SGLang's resume restores only the target
model's buffers (`resume_memory_occupation` -> `_import_static_state(
tp_worker.model_runner.model, ...)`), a known way to lose the drafter. The
re-push restores parameters only, so launch.py also asks SGLang for
`enable_draft_weights_cpu_backup` when "weights" can be released (the draft
runner's buffers come back from the CPU copy). The target's weights are NOT
backed up: after releasing "weights" the trainer must push the policy before
the next rollout.

SGLang's `flush_cache` succeeds only when nothing waits or runs
(`Scheduler.flush_cache` -> `is_fully_idle()`, which counts the waiting
queue), and a retract pause moves running requests to the waiting queue. A
policy push while samples run therefore loads the new weights but its flush
is refused (SGLangError), leaving the radix cache with old-weight KV; push
between rollout steps, when nothing runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tlt.services.common.config import load_config
from tlt.services.common.logging import get_logger
from tlt.services.rollout.sglang_backend.client import SGLangClient
from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
from tlt.services.rollout.sglang_backend.model_info import ModelInfo, checkpoint_specs
from tlt.services.rollout.sglang_backend.requests import (
    SampleState,
    StreamChunk,
    generate_calls,
    sglang_drafter_tensors,
    split_rid,
    tensor_update_call,
)
from tlt.services.rollout.types import (
    CompletionOutput,
    FinishReason,
    GenerationRequest,
    SpecCounters,
    StepOutput,
    Versions,
)

log = get_logger("rollout.sglang")


@dataclass
class SGLangStats:
    running: int
    queued: int
    kv_usage: float
    versions: Versions
    num_preemptions: int
    steps: int
    spec: dict[str, Any] = field(default_factory=dict)


def resolve_config(config: Any) -> SGLangBackendConfig:
    """The [sglang] config of a replica.

    The replica hands every backend the native `[rollout.engine]` config
    (`services/rollout/replica.py`); SGLang's own knobs then come from the
    `[sglang]` section of the preset named by `TLT_PRESET` (set by compose and
    the Kubernetes manifests), with `TLT_SGLANG__<FIELD>` overrides on top.
    """
    if isinstance(config, SGLangBackendConfig):
        return config
    return load_config(SGLangBackendConfig, "sglang", os.environ.get("TLT_PRESET") or None)


class SGLangEngine:
    """One replica's SGLang engine, speaking the native engine's interface."""

    runs_sample_subsets = True  # add_request honours GenerationRequest.sample_indices (replica re-dispatch)

    def __init__(
        self,
        model_dir: str,
        config: SGLangBackendConfig | Any,
        replica_id: int = 0,
        client: SGLangClient | None = None,
        run_dir: str | None = None,
        poll_s: float = 0.02,
    ) -> None:
        config = resolve_config(config)
        self.config = config
        self.replica_id = replica_id
        self.model_config = ModelInfo.from_dir(model_dir)
        self.max_model_len = config.context_length or self.model_config.max_position_embeddings  # SGLang's
        # With EAGLE, SGLang counts reserved draft slots against the context length
        # (launch.reserved_tokens); requests are sized and checked against what is left.
        from tlt.services.rollout.sglang_backend.launch import reserved_tokens

        self.reserved_tokens = reserved_tokens(config)
        self.versions = Versions(policy=0, drafter=0 if config.speculative_algorithm != "none" else -1)
        self._model_dir = model_dir
        self._poll_s = poll_s
        if client is None:
            from tlt.services.rollout.sglang_backend.client import EngineClient
            from tlt.services.rollout.sglang_backend.launch import engine_kwargs, write_adaptive_config

            adaptive_path = None
            if config.speculative_algorithm != "none" and config.adaptive:
                import tempfile

                folder = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix=f"tlt-sglang-{replica_id}-"))
                adaptive_path = str(write_adaptive_config(config, folder))
            client = EngineClient.launch(engine_kwargs(config, model_dir, replica_id, adaptive_path))
        self._client = client
        self._samples: dict[str, SampleState] = {}
        self._released: set[str] = set()
        self._seed_warned = False  # "sglang_seed_ignored" logged (once)
        self._drafter: dict[str, Any] | None = None  # last pushed drafter, CPU copies
        self._steps = 0
        self._verify_steps = 0
        self._accepted = 0
        self._policy_spanning = 0
        self._drafter_repushes = 0
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (SGLang keeps its own copy in its tokenizer manager)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    # -- requests ---------------------------------------------------------------------

    def add_request(self, req: GenerationRequest) -> None:
        if self._released:
            # Released KV cache / CUDA graphs / weights are gone from the GPU; a request
            # scheduled now would run on freed memory.
            raise ValueError(f"the SGLang engine's {sorted(self._released)} are released "
                             "(the trainer holds the GPU); resume first")
        if any(s.request_id == req.request_id for s in self._samples.values()):
            raise ValueError(f"request {req.request_id!r} is already running")
        n_prompt = len(req.prompt_token_ids)
        limit = self.max_model_len - self.reserved_tokens  # what SGLang lets prompt + output use
        if n_prompt >= limit:
            raise ValueError(f"prompt of {n_prompt} tokens does not fit {self.max_model_len}"
                             + (f" ({self.reserved_tokens} reserved for drafts)" if self.reserved_tokens else ""))
        if req.params.max_tokens is not None and n_prompt + req.params.max_tokens > limit:
            raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({req.params.max_tokens}) does not fit "
                             f"{self.max_model_len}" + (f" ({self.reserved_tokens} reserved for drafts)"
                                                        if self.reserved_tokens else ""))
        default_max = limit - n_prompt
        if req.params.seed is not None and not self.config.deterministic_inference and not self._seed_warned:
            self._seed_warned = True  # once: an RL rollout seeds every request
            log.warning("sglang_seed_ignored", request_id=req.request_id,
                        hint="SGLang applies per-request seeds only with [sglang] deterministic_inference = true")
        calls = generate_calls(req, default_max, self.config.return_hidden_states)
        for i, call in zip(req.samples, calls):
            self._samples[call.rid] = SampleState(
                request_id=req.request_id,
                sample_index=i,
                prompt_token_ids=list(req.prompt_token_ids),
                policy_version=self.versions.policy,
                drafter_version=self.versions.drafter,
            )
            self._client.submit(call)

    def abort_request(self, request_id: str) -> None:
        """SGLang answers an abort with a final chunk (finish type "abort"), which step() reports."""
        for rid, s in list(self._samples.items()):
            if s.request_id == request_id:
                self._client.abort(rid)

    def has_unfinished(self) -> bool:
        return bool(self._samples)

    def holds(self, request_id: str) -> bool:
        """Whether a sample of the request is still in SGLang: an abort ends one only once step() reports its
        final chunk (SGLang may still be decoding it until then)."""
        return any(s.request_id == request_id for s in self._samples.values())

    def unfinished_emitted(self) -> list[tuple[str, int, int]]:
        """(request id, sample index, tokens emitted) of every sample SGLang still holds, counting what its stream
        has brought so far: SGLang may have decoded a few more under the old weights, never fewer. (Not checked
        against SGLang itself: that the hidden states it returns for those tokens after a retracting pause are
        still those of their own forwards, not of the re-prefill under the new weights.)"""
        return [(s.request_id, s.sample_index, len(s.token_ids)) for s in self._samples.values()]

    def load(self) -> tuple[int, int, float]:
        """(running, queued, KV use) as in stats(): every submitted sample counts as running, KV use is unknown."""
        return len(self._samples), 0, 0.0

    def step(self) -> tuple[list[StepOutput], list[CompletionOutput]]:
        """Collect what SGLang streamed since the last call (waits at most poll_s for something)."""
        steps: list[StepOutput] = []
        finished: list[CompletionOutput] = []
        for chunk in self._client.poll(self._poll_s):
            state = self._samples.get(chunk.rid)
            if state is None:  # a late chunk of a sample already reported
                continue
            new_ids, new_lps = _take_new(chunk, state)
            if new_ids or chunk.finish is not None:
                steps.append(StepOutput(state.request_id, state.sample_index, new_ids, new_lps,
                                        chunk.finish is not None, chunk.finish))
            if chunk.finish is not None:
                finished.append(self._complete(chunk, state))
                del self._samples[chunk.rid]
        self._steps += 1
        return steps, finished

    def _complete(self, chunk: StreamChunk, state: SampleState) -> CompletionOutput:
        spec = SpecCounters()
        if chunk.spec_verify_ct:
            spec = SpecCounters(verify_steps=chunk.spec_verify_ct, accepted_tokens=chunk.completion_tokens)
            self._verify_steps += chunk.spec_verify_ct
            self._accepted += chunk.completion_tokens
        request_id, sample_index = split_rid(chunk.rid)
        return CompletionOutput(
            request_id=request_id,
            sample_index=sample_index,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=list(state.token_ids),
            text=state.text,
            finish_reason=chunk.finish or FinishReason.ABORT,
            versions=self._versions_of(state),
            logprobs=state.logprobs,
            top_logprobs=state.top_logprobs,
            spec=spec,
            features=_features(chunk.hidden_states, len(state.token_ids)),
            replica_id=self.replica_id,
            error=chunk.error,
        )

    def _versions_of(self, state: SampleState) -> Versions:
        """As the native engine stamps: policy = newest version used, policy_min = oldest when mixed."""
        if state.policy_version == self.versions.policy:
            return Versions(policy=state.policy_version, drafter=self.versions.drafter)
        return Versions(policy=self.versions.policy, drafter=self.versions.drafter, policy_min=state.policy_version)

    # -- weights ------------------------------------------------------------------------

    def update_weights(self, kind: str, tensors: Mapping[str, Any], version: int) -> None:
        """Apply a validated policy or drafter update in one SGLang session."""
        if kind == "drafter" and self.config.speculative_algorithm == "none":
            # SGLang answers a draft update without a draft worker with success and loads nothing
            # (weight_updater.iter_weight_update_workers skips it): refused as the native engine refuses it
            raise ValueError("this engine has no speculative decoder to take drafter weights "
                             "([sglang] speculative_algorithm = 'none')")
        if "weights" in self._released:
            raise ValueError("weights are released; resume() before updating them")
        if version <= (self.versions.policy if kind == "policy" else self.versions.drafter):
            raise ValueError(f"{kind} version {version} is not newer than the serving one")
        if kind == "drafter":
            tensors = sglang_drafter_tensors(tensors)
        call = tensor_update_call(kind, list(tensors), version)
        self._validate(kind, tensors)
        named = list(tensors.items())
        t0 = time.perf_counter()
        if kind == "policy":
            for s in self._samples.values():
                s.spanned_policy_update = True
            self._policy_spanning += len(self._samples)
            self._client.pause_generation("retract")
            try:
                self._session(call, named)
                # The weights are replaced once the session ends, whether or not the flush
                # below succeeds: stamp what is loaded.
                self.versions = Versions(policy=version, drafter=self.versions.drafter)
                self._client.flush_cache()
            finally:
                self._client.continue_generation()
        else:
            self._client.pause_generation("in_place")
            try:
                self._session(call, named)
            finally:
                self._client.continue_generation()
            self._drafter = {k: _to_cpu(v) for k, v in tensors.items()}
            self.versions = Versions(policy=self.versions.policy, drafter=version)
        log.info("sglang_weights_updated", kind=kind, version=version, tensors=len(named),
                 seconds=round(time.perf_counter() - t0, 3))

    def _session(self, call: Any, named: list[tuple[str, Any]]) -> None:
        self._client.begin_weight_update(call.selector)
        try:
            self._client.update_weights_from_tensor(call, named)
        finally:
            self._client.end_weight_update()

    def _validate(self, kind: str, tensors: Mapping[str, Any]) -> None:
        """Names and shapes against the checkpoint on disk, before SGLang sees anything.

        SGLang loads a tensor update name by name, so a bad tensor found halfway
        would leave a partial update; checking everything first keeps a bad push
        from changing anything (ValueError: the replica reports it and goes on).
        """
        if not tensors:
            raise ValueError("weight update has no tensors")
        folder = self._model_dir if kind == "policy" else self.config.draft_model_path
        expected = checkpoint_specs(folder) if folder and Path(folder).is_dir() else None
        if expected is None:
            return
        if kind == "policy" and "lm_head.weight" not in expected and "model.embed_tokens.weight" in expected:
            expected["lm_head.weight"] = expected["model.embed_tokens.weight"]  # tied embeddings
        problems = []
        for name, t in tensors.items():
            if name not in expected:
                problems.append(f"unknown tensor {name!r}")
            elif tuple(t.shape) != expected[name][0]:
                problems.append(f"{name}: shape {tuple(t.shape)} != {expected[name][0]}")
        if problems:
            raise ValueError(f"{kind} update rejected, nothing applied: " + "; ".join(problems[:8]))

    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Names, shapes and dtypes of the policy weights, read from the safetensors headers."""
        return checkpoint_specs(self._model_dir)

    # -- colocation -------------------------------------------------------------------------

    def release(self) -> None:
        """Free GPU memory for the trainer (config.release_tags); only when nothing runs."""
        if self._samples:
            raise ValueError(f"cannot release while {len(self._samples)} samples run; wait for the rollout to end")
        tags = [t for t in self.config.release_tags if t not in self._released]
        if tags:
            self._client.release_memory_occupation(tags)
            self._released.update(tags)

    def resume(self) -> None:
        tags = sorted(self._released)
        if not tags:
            return
        self._client.resume_memory_occupation(tags)
        self._released.clear()
        if "weights" in tags and self._drafter is not None:
            call = tensor_update_call("drafter", list(self._drafter), self.versions.drafter)
            self._client.pause_generation("in_place")
            try:
                self._session(call, list(self._drafter.items()))
            finally:
                self._client.continue_generation()
            self._drafter_repushes += 1
            log.info("sglang_drafter_repushed", version=self.versions.drafter)

    # -- status -----------------------------------------------------------------------------

    def stats(self) -> SGLangStats:
        mean_accept = self._accepted / self._verify_steps if self._verify_steps else 0.0
        return SGLangStats(
            running=len(self._samples),
            queued=0,  # SGLang queues internally; every submitted sample counts as running here
            kv_usage=0.0,
            versions=self.versions,
            num_preemptions=0,
            steps=self._steps,
            spec={
                "mode": "adaptive" if self.config.adaptive else "static",
                "algorithm": self.config.speculative_algorithm,
                "verify_steps": self._verify_steps,
                "mean_accept_len": mean_accept,
                "policy_spanning": self._policy_spanning,
                "drafter_repushes": self._drafter_repushes,
                "released": sorted(self._released),
            },
        )

    def shutdown(self) -> None:
        self._client.shutdown()


def _to_cpu(t: Any) -> Any:
    return t.detach().to("cpu", copy=True) if hasattr(t, "detach") else t


def _take_new(chunk: StreamChunk, state: SampleState) -> tuple[list[int], list[float] | None]:
    """The tokens (and their logprobs) a chunk adds to what the sample streamed; recorded in state.

    SGLang's chunks repeat every id so far, except the last of an aborted sample: for a streamed
    request TokenizerManager._handle_abort_req sends only the last id (parse_chunk rebuilds the others
    from its logprobs when they were asked for), and a stream that raises ends with none. A chunk short
    of ids adds nothing, its text included, and the result keeps what was streamed.
    """
    if chunk.short:
        return [], None
    known = len(state.token_ids)
    new_ids = chunk.output_ids[known:]
    end = known + len(new_ids)
    new_lps = None
    if chunk.logprobs is not None and len(chunk.logprobs) >= end:
        new_lps = chunk.logprobs[known:end]
        if known == 0 or state.logprobs is not None:
            state.logprobs = (state.logprobs or []) + new_lps
    if chunk.top_logprobs is not None and len(chunk.top_logprobs) >= end:
        if known == 0 or state.top_logprobs is not None:
            state.top_logprobs = (state.top_logprobs or []) + chunk.top_logprobs[known:end]
    state.token_ids.extend(new_ids)
    if chunk.text is not None and len(chunk.output_ids) >= known:
        state.text = chunk.text
    return new_ids, new_lps


def _features(hidden: Any, n_tokens: int) -> Any:
    """SGLang's hidden states -> fp16 [n_tokens, hidden], row i = the state that produced token i.

    SGLang returns the prefill's rows first (one [prompt_len, H] block, the
    last of which produced the first output token), then one row per accepted
    token fed back in decode (`_append_decode_hidden_states` in
    sglang/srt/managers/scheduler_components/batch_result_processor.py, which
    in speculative mode appends only accepted tokens). The last n_tokens rows
    are therefore the states at positions prompt_len - 1 .. prompt_len + n - 2:
    the native engine's definition of features.
    """
    if hidden is None or n_tokens == 0:
        return None
    import torch

    rows: list[Any] = []
    for item in hidden:
        t = torch.as_tensor(item, dtype=torch.float32)
        rows.extend(t.reshape(-1, t.shape[-1]))
    if len(rows) < n_tokens:
        raise ValueError(f"SGLang returned {len(rows)} hidden-state rows for {n_tokens} tokens")
    return torch.stack(rows[-n_tokens:]).to(torch.float16)
