"""LLMEngine: the native rollout engine's public API (the servers code against this).

    add_request(GenerationRequest) -> n Sequences queued
    step():  schedule -> (draft -> verify -> accept, when a SpecDecoder is attached and wants this
             decode batch) or (run: one forward + logits of emitting rows -> sample) -> emit
    -> (StepOutputs of this step, CompletionOutputs finished this step)

`enable_spec(SpecConfig, drafter)` attaches speculative decoding (tlt.services.rollout.spec);
without it every step is a plain decode. Emission checks stops token by token, so a verify step
that accepted several tokens never overshoots max_tokens, a stop id or a stop string.
Aborted requests (`abort_request`) are dropped silently: nothing is emitted for them.

Weight swaps (`update_weights`) are validated entirely with the loader's
checks, then applied in place between two steps (callers never call it during
`step`). In-flight sequences CONTINUE with the new weights (their cached K/V
is kept): every step records its policy version on each sequence it ran (a
prefill chunk that emits nothing included: its K/V feeds the later tokens) and
a completion is stamped `versions.policy` = newest version used and
`versions.policy_min` = oldest when they differ (None when one version did all
of it), so a mixed rollout is always visible to the trainer.
The prefix cache is reset by a policy swap: a request added after it never
reuses prompt K/V computed with the old weights.

Kernels (`EngineConfig.kernels`): "auto" runs the PyTorch path on CPU (TorchScript + oneDNN,
unchanged) and, on CUDA, the Triton kernels of `tlt.kernels` for the decode and verify steps
(fused add+RMSNorm, RoPE, paged decode / tree attention over the paged KV cache; prefill
attention stays SDPA; see tlt/model/kernel_ops.py). tests/test_engine_kernels.py checks it under
TRITON_INTERPRET=1 on CPU, and tests/test_engine_cuda.py (`pytest -m gpu`) on a GPU: passed on an H200
in session 30 (BENCHMARKS.md, "GPU").
`EngineConfig.decode_graphs` ("cuda", with kernels = "triton") replays plain decode steps from CUDA
graphs captured per batch-size bucket (`decode_graphs.py`); its "emulate" mode (the same padded static
buffers, no graphs) is tested on CPU, the "cuda" mode by tests/test_engine_cuda.py on the H200.

Features (`return_features`): row i is the last-layer hidden state (post
final norm) at the position that produced token_ids[i], taken from the same
forward that sampled it, as fp16.
"""

from __future__ import annotations

import hashlib
import itertools
import numbers
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tlt.model.config import ModelConfig
from tlt.model.folder import TOKENIZER_FILES, has_tokenizer
from tlt.model.loader import CheckpointError, expected_tensors, load_checkpoint, validate_tensors
from tlt.model.transformer import build_model
from tlt.services.common.logging import get_logger
from tlt.services.rollout.engine.block_manager import BlockManager
from tlt.services.rollout.engine.config import EngineConfig, context_limit
from tlt.services.rollout.engine.decode_graphs import default_buckets
from tlt.services.rollout.engine.detok import continuation_text
from tlt.services.rollout.engine.model_runner import ModelRunner
from tlt.services.rollout.engine.sampler import sample
from tlt.services.rollout.engine.scheduler import Scheduler
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.engine.stop import check_stop
from tlt.services.rollout.types import CompletionOutput, FinishReason, GenerationRequest, StepOutput, Versions

log = get_logger("rollout.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    running: int
    queued: int  # waiting, including preempted sequences
    kv_usage: float  # fraction of KV blocks in use, 0..1
    versions: Versions
    num_preemptions: int
    steps: int
    prefix_hit_blocks: int = 0
    prefix_tail_copies: int = 0  # partial prompt tails copied from a sibling instead of recomputed
    spec: dict = field(default_factory=dict)  # filled by the speculative decoder when attached


class LLMEngine:
    runs_sample_subsets = True  # add_request honours GenerationRequest.sample_indices (backends.py)

    def __init__(self, model_dir: str | Path, config: EngineConfig, replica_id: int = 0) -> None:
        from tlt.model.tokenizer import load_tokenizer

        self.config = config
        self.replica_id = replica_id
        if config.threads:
            torch.set_num_threads(config.threads)
        self.dtype = DTYPES[config.dtype]
        self.device = torch.device(config.device)
        cfg, tensors = load_checkpoint(model_dir, dtype=self.dtype, device=self.device)
        self.model_config: ModelConfig = cfg
        self.max_model_len = context_limit(config.max_model_len, cfg)
        self.model = build_model(cfg, tensors, dtype=self.dtype, device=self.device,
                                 max_len=self.max_model_len + 128,  # + room for draft-tree positions
                                 kernels=config.kernels)
        del tensors
        if not has_tokenizer(model_dir):
            raise CheckpointError(f"{model_dir} has no tokenizer files ({' / '.join(TOKENIZER_FILES)})")
        self.tokenizer = load_tokenizer(model_dir)
        num_blocks = config.num_kv_blocks or self._blocks_for_budget(config.kv_cache_mb)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_sharing)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        buckets = config.decode_graph_buckets or default_buckets(config.max_num_seqs)
        self.runner = ModelRunner(self.model, config.block_size, num_blocks, config.decode_graphs, buckets,
                                  -(-(self.max_model_len + 128) // config.block_size))  # + draft-tree room
        self.versions = Versions(policy=0, drafter=-1)
        self.eos_ids = frozenset(cfg.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._seqs: dict[str, list[Sequence]] = {}
        self._seed_counter = itertools.count()
        self._seed_base = host_seed(config.seed)
        self._steps = 0
        self._failed: Exception | None = None  # a step raised: the engine refuses to step again (step)
        self.spec_decoder = None  # a SpecDecoder replaces plain decode for small batches when attached
        log.info("engine_ready", replica=replica_id, arch=cfg.architecture, layers=cfg.num_layers,
                 kv_blocks=num_blocks, block_size=config.block_size, max_model_len=self.max_model_len,
                 kernels=self.model.kernels)
        if num_blocks < self._blocks_per_seq():
            self._warn_kv_cache_short(num_blocks)

    def _blocks_for_budget(self, mb: float) -> int:
        c = self.model_config
        per_block = 2 * c.num_layers * self.config.block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        enough = self.config.max_num_seqs * self._blocks_per_seq()  # never more than can be used
        return max(1, min(int(mb * 2**20 // per_block), enough))

    def _warn_kv_cache_short(self, num_blocks: int) -> None:
        """The cache cannot hold one max_model_len sequence: every request whose prompt + max_tokens (by default the
        rest of max_model_len) passes it is refused. vLLM refuses to start; this warns (tests use tiny caches)."""
        c, bs, need = self.model_config, self.config.block_size, self._blocks_per_seq()
        if self.config.num_kv_blocks:
            fix = f"raise [rollout.engine] num_kv_blocks to at least {need}"
        else:
            per_block = 2 * c.num_layers * bs * c.num_kv_heads * c.head_dim * self.dtype.itemsize
            fix = f"raise [rollout.engine] kv_cache_mb to at least {need * per_block / 2**20:.4g}"
        log.warning("kv_cache_short", replica=self.replica_id, kv_blocks=num_blocks, block_size=bs,
                    kv_tokens=num_blocks * bs, max_model_len=self.max_model_len,
                    hint=f"the KV cache holds {num_blocks * bs} tokens, less than one max_model_len "
                         f"({self.max_model_len}) sequence: a request needing more (prompt + max_tokens; max_tokens "
                         f"defaults to the rest of max_model_len) is refused; {fix} ({need} blocks of {bs}), "
                         "or lower max_model_len")

    def _blocks_per_seq(self) -> int:
        return (self.max_model_len + self.config.block_size - 1) // self.config.block_size

    # ------------------------------------------------------------------ requests
    def add_request(self, req: GenerationRequest) -> None:
        p = req.params
        p.validate()
        n_prompt = len(req.prompt_token_ids)
        if n_prompt == 0:
            raise ValueError("prompt is empty")
        if req.request_id in self._seqs:
            raise ValueError(f"request id {req.request_id!r} is already running")
        if not isinstance(req.n, int) or req.n < 1:
            raise ValueError(f"n must be a positive integer, got {req.n!r}")
        samples = req.samples  # ValueError unless distinct indices below n
        if n_prompt >= self.max_model_len:
            raise ValueError(f"prompt has {n_prompt} tokens; the context limit is {self.max_model_len}")
        vocab = self.model_config.vocab_size
        if any(not _token_id(t) or not 0 <= t < vocab for t in req.prompt_token_ids):  # 5.0: the block hash
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")  # failed at every later step
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context limit {self.max_model_len}"
            )
        if self.block_manager.blocks_needed(n_prompt + max_tokens) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt + max_tokens ({n_prompt + max_tokens} tokens) does not fit in the KV cache "
                f"({self.block_manager.num_blocks} blocks of {self.config.block_size}); raise num_kv_blocks/kv_cache_mb"
            )
        seed = p.seed if p.seed is not None else hash((self._seed_base, self.replica_id, next(self._seed_counter)))
        seqs = [Sequence(req.request_id, i, req.prompt_token_ids, p, max_tokens, seed, self.eos_ids) for i in samples]
        self._seqs[req.request_id] = seqs
        for s in seqs:
            self.scheduler.add(s)

    def abort_request(self, request_id: str) -> None:
        """Drop a request's sequences and free their KV; nothing is emitted for them. Unknown ids are ignored."""
        for seq in self._seqs.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq)
        if self.spec_decoder is not None:
            self.spec_decoder.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def steps_run(self) -> int:
        """Steps that computed a batch (a prefill chunk that emits nothing included): the replica's progress."""
        return self._steps

    def holds(self, request_id: str) -> bool:
        """Whether any sequence of the request is still here (an abort drops them at once)."""
        return request_id in self._seqs

    def unfinished_emitted(self) -> list[tuple[str, int, int]]:
        """(request id, sample index, tokens emitted) of every unfinished sequence, running or waiting: where a
        policy push lands in each (the replica cuts their drafter features there)."""
        return [(s.request_id, s.sample_index, len(s.token_ids) - s.prompt_len)
                for s in (*self.scheduler.running, *self.scheduler.waiting)]

    def load(self) -> tuple[int, int, float]:
        """(running, queued, KV use): what a capacity event carries; cheap, the replica reads it after every step
        (`stats()` builds the spec counters too)."""
        return len(self.scheduler.running), len(self.scheduler.waiting), self.block_manager.usage()

    # ------------------------------------------------------------------ the step
    def step(self) -> tuple[list[StepOutput], list[CompletionOutput]]:
        """schedule -> copy partial prompt tails -> (draft -> verify -> accept) or run + sample -> emit.

        A step that raises leaves the scheduler's and the block manager's state for a batch never computed (a
        sequence may count a shared prefix block as cached that nobody wrote), so every later step raises too,
        naming the first failure: the replica process ends on it, and an in-process caller cannot go on."""
        if self._failed is not None:
            raise RuntimeError(f"an earlier step failed ({self._failed!r}); this engine's state is not usable: "
                               "make a new engine") from self._failed
        try:
            return self._step()
        except Exception as e:
            self._failed = e
            raise

    def _step(self) -> tuple[list[StepOutput], list[CompletionOutput]]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return [], []
        self._steps += 1
        if batch.copies:  # partial prompt tails other sequences computed (BlockManager): before any forward
            self.runner.copy_tails(batch.copies)
        for seq in batch.seqs:  # a prefill chunk emits nothing, yet its K/V is of these weights: count it too
            seq.record_version(self.versions.policy)
        if self.spec_decoder is not None and self.spec_decoder.wants(batch):
            emissions = self.spec_decoder.decode(batch.seqs)  # None: no KV room for drafts, decode plainly
            if emissions is not None:
                result = self._emit(batch.seqs, [e.token_ids for e in emissions], [e.logprobs for e in emissions],
                                    [e.hidden for e in emissions], [e.top_logprobs for e in emissions],
                                    verified=True)
                # the bandit's reward: the tokens kept (a stop drops the rest of a path) over the whole step
                self.spec_decoder.finish_step(start, sum(len(s.new_token_ids) for s in result[0]))
                return result
        out = self.runner.run(batch)
        self.scheduler.update(batch)
        if not out.emit_seqs:
            return [], []
        res = sample(out.logits, out.emit_seqs)
        result = self._emit(out.emit_seqs, [[t] for t in res.token_ids], [[lp] for lp in res.logprobs],
                            out.hidden[:, None, :], [[t] for t in res.top_logprobs], verified=False)
        if self.spec_decoder is not None:
            self.spec_decoder.observe_plain(out.emit_seqs, out.hidden)
            self.spec_decoder.finish_step(start)  # the bandit chose the "plain" arm for this step (else no-op)
        return result

    def _emit(self, seqs, tokens, logprobs, hidden, tops, verified: bool) -> tuple[list[StepOutput], list[CompletionOutput]]:
        """Append each sequence's new tokens with per-token stop checks (tokens after a stop are dropped)."""
        steps: list[StepOutput] = []
        done: list[CompletionOutput] = []
        rows = None  # the step's features on the CPU: one conversion for the batch, not one per sequence
        if any(s.features is not None for s in seqs):
            if isinstance(hidden, torch.Tensor):  # a plain step: [B, 1, H]
                rows = hidden.to(device="cpu", dtype=torch.float16).unbind(0)
            else:  # a verify step: one [len, H] chunk per sequence (a copy and a device sync each were B of both)
                rows = torch.cat(list(hidden)).to(device="cpu", dtype=torch.float16).split([h.shape[0] for h in hidden])
        for k, seq in enumerate(seqs):
            if verified:
                seq.spec.verify_steps += 1
            else:
                seq.spec.plain_decode_steps += 1
            new: list[int] = []
            reason = None
            for j, tok in enumerate(tokens[k]):
                seq.token_ids.append(tok)
                new.append(tok)
                if seq.logprobs is not None:
                    seq.logprobs.append(logprobs[k][j])
                if seq.top_logprobs is not None:
                    seq.top_logprobs.append(tops[k][j] if tops is not None and tops[k] is not None else {})
                reason = check_stop(seq, tok, self.tokenizer, self.max_model_len)
                if reason is not None:
                    break
            if seq.features is not None:  # one [len(new), H] chunk per step
                # its own copy: a view of `rows` would keep the step's whole batch alive while this sequence runs
                seq.features.append(rows[k][: len(new)].clone())
            if verified:  # the tokens kept: a stop or max_tokens cuts the rest of an accepted path
                seq.spec.accepted_tokens += len(new)
            steps.append(StepOutput(seq.request_id, seq.sample_index, new,
                                    None if seq.logprobs is None else seq.logprobs[len(seq.logprobs) - len(new):],
                                    finished=reason is not None, finish_reason=reason,
                                    new_top_logprobs=None if seq.top_logprobs is None
                                    else seq.top_logprobs[len(seq.top_logprobs) - len(new):]))
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                done.append(self._completion(seq))
        return steps, done

    def _completion(self, seq: Sequence) -> CompletionOutput:
        group = self._seqs.get(seq.request_id)
        if group is not None and all(s.is_finished for s in group):
            del self._seqs[seq.request_id]
            if self.spec_decoder is not None:
                self.spec_decoder.forget(seq.request_id)
        oldest, newest = seq.policy_versions or (self.versions.policy, self.versions.policy)
        text = seq.text
        if text is None:  # one decode after the prompt's last tokens (a SentencePiece decoder strips the first
            # token's space), whether or not the request had stop strings: the same tokens, the same text
            out = seq.output_ids
            if seq.finish_reason is FinishReason.STOP and out and (out[-1] in seq.stop_ids or out[-1] in seq.eos_ids):
                # the stop token (stop_token_ids, eos) that ended it stays in token_ids, not in the text, even when
                # it is plain text, as vLLM v1 (its detokenizer skips a stop-terminated request's last token
                # unless include_stop_str_in_output) and SGLang (trim_matched_stop) have it
                out = out[:-1]
            text = continuation_text(self.tokenizer, seq.token_ids[: seq.prompt_len], out)
        return CompletionOutput(
            request_id=seq.request_id,
            sample_index=seq.sample_index,
            prompt_token_ids=seq.token_ids[: seq.prompt_len],
            token_ids=seq.output_ids,
            text=text,
            finish_reason=seq.finish_reason,
            versions=Versions(policy=newest, drafter=self.versions.drafter, policy_min=oldest if oldest != newest else None),
            logprobs=seq.logprobs,
            top_logprobs=seq.top_logprobs,
            features=torch.cat(seq.features) if seq.features else (None if seq.features is None else torch.empty(0)),
            spec=seq.spec,
            replica_id=self.replica_id,
        )

    # ------------------------------------------------------------------ weights
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (shape, self.dtype) for k, shape in expected_tensors(self.model_config).items()}

    def update_weights(self, kind: str, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Validate every tensor (names, shapes, dtype) first, then copy in place; a bad update changes nothing."""
        if kind == "drafter":
            if self.spec_decoder is None:
                raise ValueError("this engine has no speculative decoder to take drafter weights")
            self.spec_decoder.update_weights(tensors, version)
            self.versions = Versions(policy=self.versions.policy, drafter=version)
            return
        if kind != "policy":
            raise ValueError(f"unknown weight kind {kind!r}; expected 'policy' or 'drafter'")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an integer, got {version!r}")
        if not tensors:
            raise ValueError("weight update has no tensors")
        validate_tensors(self.model_config, tensors, partial=True, dtype=self.dtype, finite=True)
        self.model.load_weights({k: v.to(self.device) for k, v in tensors.items()})
        # cached prefix K/V was computed with the old weights: a new request must not reuse it
        self.block_manager.reset_prefix_cache()
        self.versions = Versions(policy=version, drafter=self.versions.drafter)
        log.info("weights_updated", replica=self.replica_id, kind=kind, version=version, tensors=len(tensors))

    # ------------------------------------------------------------------ speculative decoding
    def enable_spec(self, spec_config, drafter=None) -> None:
        """Attach a SpecDecoder (tlt.services.rollout.spec) that replaces plain decode for small batches.
        A learned drafter is `drafter`, or else loaded from `spec_config.drafter_path`."""
        from tlt.services.rollout.spec.decoder import build_spec_decoder

        decoder = build_spec_decoder(spec_config, self.runner, self.block_manager, drafter, self.config.max_num_seqs,
                                     self.max_model_len, self.replica_id)  # the bandit's seed: the replica's own
        if decoder is None:  # mode off
            return
        self.spec_decoder = decoder
        self.scheduler.on_release = decoder.release
        if spec_config.drafter == "learned":  # common.proto: 0 = the drafter loaded at start (-1: none, n-gram)
            self.versions = Versions(policy=self.versions.policy, drafter=0)

    # ------------------------------------------------------------------ helpers
    def stats(self) -> EngineStats:
        spec = self.spec_decoder.stats() if self.spec_decoder is not None else {}
        return EngineStats(
            running=len(self.scheduler.running),
            queued=len(self.scheduler.waiting),
            kv_usage=self.block_manager.usage(),
            versions=self.versions,
            num_preemptions=self.scheduler.num_preemptions,
            steps=self._steps,
            prefix_hit_blocks=self.block_manager.shared_hits,
            prefix_tail_copies=self.block_manager.tail_copies,
            spec=spec,
        )

    def generate(self, requests: list[GenerationRequest],
                 progress: Callable[[int], object] | None = None) -> list[CompletionOutput]:
        """Add every request, step until all are done; completions in request order, then sample order (the samples
        each request runs: `sample_indices` when given). The list is checked whole first (ValueError): a bad request
        must not leave those before it running with no caller. `progress(k)` is called after each step that finished
        k > 0 of them (a progress bar's `update`)."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(i in self._seqs for i in ids):
            raise ValueError("generate() needs distinct request ids that are not already running")
        samples = [r.samples for r in requests]  # ValueError for bad sample_indices, before any request is added
        added: list[str] = []
        try:
            for r in requests:
                self.add_request(r)  # its own checks (context, KV fit, params) may refuse a later request
                added.append(r.request_id)
        except ValueError:
            for request_id in added:  # nothing of the list stays running with no caller
                self.abort_request(request_id)
            raise
        wanted = {r.request_id for r in requests}
        got: dict[tuple[str, int], CompletionOutput] = {}
        while any(k in self._seqs for k in wanted) and self.has_unfinished():
            _, done = self.step()
            for c in done:
                got[(c.request_id, c.sample_index)] = c
            if progress is not None and (k := sum(c.request_id in wanted for c in done)):
                progress(k)
        return [got[(r.request_id, i)] for r, indices in zip(requests, samples) for i in indices]


def _token_id(t: object) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)  # numpy / torch ints too


def host_seed(seed: int) -> int:
    """The base of the seeds of requests that give none: [rollout.engine] seed mixed with the host's name.

    Rollout servers started from one config (pods of a deployment) would otherwise draw the same random
    numbers for their i-th requests: the same prompt sent to two of them got the same samples. A rerun on
    the same host still repeats its draws (tuples of ints hash the same in every process).
    """
    digest = hashlib.blake2b(f"{seed}:{socket.gethostname()}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
