"""The policy under training: a `transformers` causal LM inside a DeepSpeed engine.

    Hugging Face folder -> AutoModelForCausalLM -> deepspeed.initialize(AdamW, LambdaLR)
    (prompt ids, response ids) x B -> TokenBatch (right-padded) -> per-token response logprobs

The optimizer is a plain `torch.optim.AdamW` handed to DeepSpeed, so DeepSpeed
builds no extension (the CPU install has DS_BUILD_OPS=0). ZeRO stage 0-3; at 3
the parameters are partitioned over the ranks (loaded partitioned under
deepspeed.zero.Init), so reading them whole (`state_dict_for_push`,
`save_pretrained`, weight_sync.policy_tensors) gathers them: a collective of
every rank. bf16 on GPU, fp32 on CPU; DeepSpeed does gradient clipping and accumulation
(`gradient_accumulation_steps` = mini / micro batch). The training loop calls
`backward(loss)` then `step()` once per micro-batch: DeepSpeed applies the
optimizer only at the accumulation boundary. Losses arrive already divided by
the whole mini-batch's token count (token-mean), so backward does NOT scale
them again by the accumulation steps.

`ReferencePolicy` is the frozen copy for the KL term: same logprob code, no
optimizer, no DeepSpeed.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tlt.model.layer_ops import gpu_sdpa
from tlt.services.common.seeds import torch_seed
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.grpo import entropy_from_logits
from tlt.services.trainer.logprob_chunks import (
    DEFAULT_CHUNK_TOKENS,
    chunkable_head,
    chunked_token_logprobs,
    head_input,
)


@dataclass(frozen=True)
class TokenBatch:
    """B (prompt, response) sequences, right-padded to one length L.

    input_ids, attention_mask: [B, L]. response_index: [B, R] positions of
    the logits that predict response token j (prompt_len - 1 + j), clamped
    into range on padding; response_ids, response_mask: [B, R].
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_index: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor

    @staticmethod
    def build(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int = 0) -> TokenBatch:
        if len(prompts) != len(responses) or not prompts:
            raise ValueError(f"need the same non-zero number of prompts and responses, got {len(prompts)}/{len(responses)}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (the first response token is predicted from it)")
        b = len(prompts)
        length = max(len(p) + len(r) for p, r in zip(prompts, responses))
        r_len = max(1, max(len(r) for r in responses))
        ids = torch.full((b, length), pad_id, dtype=torch.long)
        attn = torch.zeros((b, length), dtype=torch.long)
        r_idx = torch.zeros((b, r_len), dtype=torch.long)
        r_ids = torch.full((b, r_len), pad_id, dtype=torch.long)
        r_mask = torch.zeros((b, r_len), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            seq = list(p) + list(r)
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attn[i, : len(seq)] = 1
            r_idx[i] = torch.clamp(torch.arange(r_len) + len(p) - 1, max=length - 1)
            if r:
                r_ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
                r_mask[i, : len(r)] = 1.0
        return TokenBatch(ids, attn, r_idx, r_ids, r_mask)

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.response_index,
                                                   self.response_ids, self.response_mask)))


@dataclass(frozen=True)
class TokenLogprobs:
    """Per response token: logprob under the model (at `temperature`), optional entropy.

    logprobs, mask, entropy: [B, R]. hidden: [B, L, H] last-layer states after
    the final norm (what lm_head sees), detached, when asked for (drafter data).
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


def response_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_hidden: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> TokenLogprobs:
    """Forward `batch` through `model` (a HF causal LM or a DeepSpeed engine around one).

    The entropy (`with_entropy`) is a detached diagnostic unless `entropy_grad` (an entropy bonus in the loss).

    logp(x_j) = z[x_j] - logsumexp(z), z = logits at response_index / temperature:
    the same temperature the rollout sampled with, so old / new / reference
    logprobs and the rollout's own logprobs are on one scale.

    The logits exist `chunk_tokens` response tokens at a time, recomputed in backward (logprob_chunks.py); 0, or a
    model whose forward changes lm_head's logits, builds all [B, R, V] at once (the reference the chunks are
    tested against).
    """
    # Only positions from the earliest response start get logits (logits_to_keep keeps the
    # last k): long prompts cost no lm_head work and no [B, L, V] memory.
    length = batch.input_ids.shape[1]
    first = int(batch.response_index.min())
    keep = length - first
    head = chunkable_head(model) if chunk_tokens > 0 else None
    # Off the CPU, SDPA without cuDNN's attention: it builds a plan per new input shape (25 ms a call, measured on an
    # H200 in the rollout engine, BENCHMARKS.md "GPU"), and every micro-batch pads to its own longest row. The
    # backward runs the backend the forward chose, except that gradient checkpointing recomputes the forward in the
    # backward pass: Policy.backward holds the same context. It ran so on an H200 in `tlt bench e2e` (session 31);
    # its speed was not compared without it.
    with gpu_sdpa(batch.input_ids), (head_input(head) if head is not None else contextlib.nullcontext()) as seen:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=with_hidden,
                    use_cache=False, logits_to_keep=keep)
    hidden = out.hidden_states[-1].detach() if with_hidden else None
    if head is not None:
        if len(seen) != 1:
            raise RuntimeError(f"lm_head ran {len(seen)} times in one forward; pass chunk_tokens=0 for this model")
        logp, entropy = chunked_token_logprobs(head, seen[0], first, batch.response_index, batch.response_ids,
                                               batch.response_mask, temperature, chunk_tokens, with_entropy,
                                               entropy_grad)
        return TokenLogprobs(logp, batch.response_mask, entropy, hidden)
    logits = out.logits  # [B, keep, V]; position p of the sequence is row p - first
    idx = (batch.response_index - first).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    z = torch.gather(logits, 1, idx).float() / temperature  # [B, R, V]
    chosen = torch.gather(z, 2, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    logp = (chosen - torch.logsumexp(z, dim=-1)) * batch.response_mask
    entropy = None
    if with_entropy:
        with torch.no_grad() if not entropy_grad else contextlib.nullcontext():
            entropy = entropy_from_logits(z, batch.response_mask)
    return TokenLogprobs(logp, batch.response_mask, entropy, hidden)


def _total_norm(params) -> float:
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0


def train_bf16(cfg: TrainerConfig) -> bool:
    """Whether the policy trains in bf16: `bf16`, else on with a GPU (fp32 on CPU)."""
    return torch.cuda.is_available() if cfg.bf16 is None else cfg.bf16


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(torch_seed(seed))


def lr_lambda(warmup: int, total: int, schedule: str):
    """Multiplier of the peak LR at optimizer update u: linear warm-up, then constant or cosine to 0."""

    def f(u: int) -> float:
        if warmup and u < warmup:
            return (u + 1) / warmup
        if schedule == "constant":
            return 1.0
        span = max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (u - warmup) / span)))

    return f


class _Zero3Loading:
    """What `transformers` asks of the HfDeepSpeedConfig it looks up (a weak reference) while loading a model.

    With one registered, `from_pretrained` builds the model inside `deepspeed.zero.Init(config)` (each parameter
    partitioned as it is created) and copies the checkpoint in one module at a time: no rank ever holds the
    whole model. transformers' own HfDeepSpeedConfig needs `accelerate`, which the trainer does not install;
    this holds exactly the two things transformers reads (`is_zero3()`, `.config`).
    """

    def __init__(self, ds_config: dict) -> None:
        self.config = ds_config

    def is_zero3(self) -> bool:
        return True


def load_hf_model(model_dir: str, dtype: torch.dtype, zero3_config: dict | None = None) -> torch.nn.Module:
    """The HF model in `model_dir`; with a ZeRO-3 DeepSpeed config, built already partitioned (collective)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"model_dir {model_dir!r} is not a Hugging Face checkpoint folder (no config.json); build the tiny "
            "model with `make model` (tlt model build --preset tiny --out artifacts/tiny) or set model_dir"
        )
    if zero3_config is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    loading = _Zero3Loading(zero3_config)
    set_hf_deepspeed_config(loading)
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    finally:  # later loads (the frozen reference model) are plain full models
        unset_hf_deepspeed_config()


# Extra `zero_optimization` settings at stage 3 (DeepSpeed's defaults otherwise). Of note: parameters of at most
# stage3_param_persistence_threshold (1e5) elements, norms and biases, stay whole on every rank after first use.
ZERO3_OPTIONS: dict = {}


def deepspeed_config(cfg: TrainerConfig, world_size: int, bf16: bool) -> dict:
    per_update = cfg.micro_batch_size * world_size
    if cfg.mini_batch_size % per_update:  # a ConfigError: `tlt train` says it in one line (a ValueError: traceback)
        from tlt.services.common.config import ConfigError

        raise ConfigError(
            f"mini_batch_size ({cfg.mini_batch_size}) must be a multiple of micro_batch_size x ranks "
            f"({cfg.micro_batch_size} x {world_size}); lower micro_batch_size or raise mini_batch_size"
        )
    zero = {"stage": cfg.zero_stage, **(ZERO3_OPTIONS if cfg.zero_stage == 3 else {})}
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.mini_batch_size // per_update,
        "train_batch_size": cfg.mini_batch_size,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def disable_dropout(model: torch.nn.Module) -> int:
    """Zero every dropout of `model` in place (its config, and so its saved checkpoints, unchanged); returns how many
    were non-zero. Old logprobs come from an eval-mode pass and the update from a train-mode one: with dropout on, the
    first mini-batch would not be on-policy (ratio != 1) and clipping and approx_kl would measure dropout noise.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, changed = 0.0, changed + 1
        for name in ("attention_dropout", "dropout"):  # the float attention modules pass to sdpa while training
            value = getattr(module, name, None)
            if isinstance(value, float) and value:
                setattr(module, name, 0.0)
                changed += 1
    return changed


class Policy:
    """The trained policy: DeepSpeed engine + weight version (one per finished RL step)."""

    def __init__(self, cfg: TrainerConfig, model: torch.nn.Module | None = None, version: int = 0) -> None:
        import deepspeed

        from tlt.services.trainer.distributed import init_process_group

        self.cfg = cfg
        self.version = version
        on_gpu = torch.cuda.is_available()
        self.bf16 = train_bf16(cfg)
        if not on_gpu:  # 0: torch's default, but never more than a container's CPU quota allows
            from tlt.services.common.cpus import usable_cores

            threads = cfg.torch_threads or min(torch.get_num_threads(), usable_cores())
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        seed_everything(cfg.seed)
        init_process_group()
        self.world_size = torch.distributed.get_world_size()
        self.rank = torch.distributed.get_rank()
        ds_config = deepspeed_config(cfg, self.world_size, self.bf16)
        if model is None:  # ZeRO-3: loaded partitioned. A model passed in whole is partitioned by initialize()
            model = load_hf_model(cfg.model_dir, torch.float32, ds_config if cfg.zero_stage == 3 else None)
        disable_dropout(model)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self._input_use_cache = model.config.use_cache  # the export says what the input said (save_pretrained)
        model.config.use_cache = False
        self.model_config = model.config
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)
        updates_per_step = cfg.ppo_epochs * (cfg.sequences_per_step // cfg.mini_batch_size)  # every pass's updates
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(cfg.warmup_steps, cfg.steps * updates_per_step, cfg.lr_schedule)
        )
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        _undo_init_step(self.optimizer)
        self.device = torch.device(self.engine.device)  # this rank's device (cuda:LOCAL_RANK on GPU)
        # DeepSpeed reports the global grad norm from its ZeRO / bf16 optimizers only;
        # with ZeRO 0 in fp32 it clips with torch and discards the norm, so we measure it.
        self._own_grad_norm = cfg.zero_stage == 0 and not self.bf16
        self._grad_norm: float | None = None

    def keep_configured_settings(self) -> None:
        """After a checkpoint's optimizer and LR-scheduler state were loaded: lr, weight_decay and betas back to this
        run's config, the Adam moments and the schedule's position kept. load_checkpoint brings back the saved
        param_groups and the scheduler's base_lrs, so a run resumed with a new lr (`--set trainer.lr=1e-5` after
        diverged steps), weight_decay or betas silently trained with the old ones."""
        cfg, scheduler = self.cfg, self.scheduler
        scheduler.base_lrs = [cfg.lr] * len(scheduler.base_lrs)
        # the groups the scheduler sets the lr of: the same dicts DeepSpeed's optimizer steps with (ZeRO too)
        for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
            group.update(initial_lr=cfg.lr, lr=cfg.lr * factor(scheduler.last_epoch), weight_decay=cfg.weight_decay,
                         betas=tuple(cfg.adam_betas))
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # get_last_lr()

    # -- forward ------------------------------------------------------------------
    def logprobs(self, batch: TokenBatch, with_entropy: bool = False, with_hidden: bool = False,
                 entropy_grad: bool = False) -> TokenLogprobs:
        return response_logprobs(self.engine, batch.to(self.device), self.cfg.temperature, with_entropy, with_hidden,
                                 entropy_grad, self.cfg.logprob_chunk_tokens)

    # -- update ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients; `loss` is already normalised over the mini-batch (no GAS scaling)."""
        with gpu_sdpa(loss):  # gradient checkpointing recomputes the forward here, outside response_logprobs' context
            self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> bool:
        """One micro-batch done; returns True when DeepSpeed applied an optimizer update."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary and self._own_grad_norm:
            self._grad_norm = _total_norm(self.engine.module.parameters())
        self.engine.step()
        if boundary and not self._own_grad_norm:
            g = self.engine.get_global_grad_norm()
            self._grad_norm = None if g is None else float(g)
        return boundary

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last optimizer update."""
        return self._grad_norm

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def gathers(self) -> bool:
        """ZeRO-3: each rank holds a partition of the weights; reading them whole (a push, the export) is a
        collective every rank must take part in, in the same order, even where only rank 0 uses the result."""
        return self.cfg.zero_stage == 3

    def _comm_device(self) -> torch.device:
        """Where a collective's tensor must be: the GPU under NCCL, the CPU under gloo."""
        import torch.distributed as dist

        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def all_reduce_stats(self, sums: dict[str, float], tokens: int, max_diff: float) -> tuple[dict[str, float], int, float]:
        """Sum per-rank diagnostic sums and token counts over the ranks (max for the logprob gap)."""
        import torch.distributed as dist

        keys = sorted(sums)
        dev = self._comm_device()
        t = torch.tensor([sums[k] for k in keys] + [float(tokens)], dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        m = torch.tensor([max_diff], dtype=torch.float64, device=dev)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        vals = t.tolist()
        return dict(zip(keys, vals[:-1])), int(vals[-1]), float(m.item())

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks (a collective every rank calls), on CPU."""
        import torch.distributed as dist

        x = t.to(self._comm_device())
        dist.all_reduce(x)
        return x.cpu()

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        """Full weights in HF names, on CPU. ZeRO 0-2 keep full parameters on every rank; under ZeRO-3 they are
        gathered: a collective every rank must call, and only rank 0 gets them (other ranks: {})."""
        from tlt.services.trainer.weight_sync import full_state_dict

        return full_state_dict(self.engine.module)

    def save_pretrained(self, out_dir: str) -> None:
        """The policy as a Hugging Face folder, written by rank 0. Every rank calls it: under ZeRO-3 the weights
        are gathered (collective) and rank 0 writes them; at stages 0-2 the other ranks return at once."""
        from tlt.model.files import share_weights
        from tlt.services.trainer.weight_sync import full_state_dict

        config = self.engine.module.config
        config.use_cache = self._input_use_cache  # off for training only: generation from the export wants the cache
        try:
            if self.gathers:
                state = full_state_dict(self.engine.module, keep=self.rank == 0)
                if self.rank == 0:
                    self.engine.module.save_pretrained(out_dir, state_dict=state)
            elif self.rank == 0:
                self.engine.module.save_pretrained(out_dir)
        finally:
            config.use_cache = False
        if self.rank == 0:
            share_weights(out_dir)  # safetensors wrote them 0600: the rollout server may run as another user


class ModelMismatchError(ValueError):
    """A model folder that cannot serve with the policy (the KL reference of another vocabulary)."""


class ReferencePolicy:
    """Frozen reference model for the KL term (eval mode, no grad, no optimizer).

    With `vocab_size` (the policy's), a reference of another vocabulary is refused: its KL would compare unrelated
    token ids (a larger vocabulary) or fail deep in a step after a whole rollout (a smaller one).
    """

    def __init__(self, model_dir: str, device: torch.device, temperature: float, dtype: torch.dtype = torch.float32,
                 vocab_size: int | None = None):
        if vocab_size is not None:
            from transformers import AutoConfig

            ref_vocab = getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True), "vocab_size", None)
            if ref_vocab != vocab_size:
                raise ModelMismatchError(
                    f"reference_model_dir {model_dir!r} has a vocabulary of {ref_vocab} tokens, the policy "
                    f"{vocab_size}: the KL reference must share the policy's tokenizer (leave reference_model_dir "
                    "empty to use model_dir)")
        self.model = load_hf_model(model_dir, dtype).to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.temperature = temperature

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        return response_logprobs(self.model, batch.to(self.device), self.temperature).logprobs


def _undo_init_step(wrapper: object) -> None:
    """bf16 (or fp16) without ZeRO: DeepSpeed wraps the AdamW in FP16_UnfusedOptimizer, whose constructor runs one
    AdamW step on zero gradients to create its state. That step left Adam's step count at 1 before training (every
    bias correction one update off: the first update was 0.74x its size) and applied the decoupled weight decay once
    to the fp32 master weights (x (1 - lr * weight_decay)); ZeRO 1-3 do neither. Undone here: the master weights are
    the model's (what they were copied from) and the AdamW state is empty, as the first real step expects."""
    if type(wrapper).__name__ != "FP16_UnfusedOptimizer":
        return
    with torch.no_grad():
        for low, master in zip(wrapper.fp16_groups, wrapper.fp32_groups):  # type: ignore[attr-defined]
            for p, m in zip(low, master):
                m.copy_(p.detach().to(m.dtype))
    wrapper.optimizer.state.clear()  # type: ignore[attr-defined]

