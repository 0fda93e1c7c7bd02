"""`tlt model build`: train the task tokenizer and pre-train a preset model into a Hugging Face folder.

Pipeline: tokenizer (BPE on task text) -> packed training stream (task
problems as ChatML, several per row, each with its own position ids so
attention never crosses a problem boundary, loss on the assistant turn only)
-> Qwen2ForCausalLM pre-training (fp32, AdamW, warm-up + cosine) -> save
(config, generation config, safetensors, tokenizer) -> held-out evaluation
on the rollout's native engine (evaluate.py) -> `.complete` with the build's
key facts.

Reproducible: everything is seeded and the run is a fixed number of steps.
A wall-clock guard (`time_budget_s`) stops early on a slow machine; then the
model differs from the seeded one, and `.complete` says so
(`stopped_by_time: true`). The build happens in a temporary sibling folder
that is renamed into place at the end, so `DIR/.complete` exists only for a
finished build (the Makefile rebuilds when it is missing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRAIN_SEED_OFFSET = 17  # training problems use seed + this (+ the row index stream); eval uses another offset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import at_least, out_folder, positive_float
    from tlt.model.presets import MODEL_PRESETS  # plain dicts: no heavy import

    parser.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS), help="model preset")
    parser.add_argument("--out", type=out_folder, required=True,
                        help="output folder (built in a temp folder, renamed at the end; replaces an older model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of tokenizer data, init, training data")
    parser.add_argument("--max-steps", type=at_least(1), default=None, help="override the preset's optimizer steps")
    parser.add_argument("--time-budget", type=positive_float, default=None,
                        help="override the training wall-clock guard (s)")
    parser.add_argument("--eval-n", type=at_least(0), default=200, help="held-out problems evaluated at the end (0: skip)")
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: the preset's)")


def packed_batches(tokenizer: Any, seq_len: int, batch_size: int, seed: int) -> Iterator[dict[str, Any]]:
    """Endless stream of packed rows: input_ids, labels (-100 outside assistant turns), per-problem position_ids."""
    import torch

    from tlt.task import format_prompt, generate_problems

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    chunk = 0
    pending: list[tuple[list[int], list[int]]] = []
    while True:
        if not pending:
            problems = generate_problems(512, seed=seed + TRAIN_SEED_OFFSET + 7919 * chunk)
            chunk += 1
            prompts = tokenizer([format_prompt(p) for p in problems])["input_ids"]
            answers = tokenizer([p.solution for p in problems])["input_ids"]
            # The prompt ends with "assistant\n" and the solution starts with a digit: tokenizing the
            # two parts separately gives the same ids as tokenizing their concatenation.
            pending = [(pr + an + [eos], [-100] * len(pr) + an + [eos]) for pr, an in zip(prompts, answers)]
            pending.reverse()
        ids = torch.full((batch_size, seq_len), pad, dtype=torch.long)
        labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)
        pos = torch.zeros((batch_size, seq_len), dtype=torch.long)
        for row in range(batch_size):
            col = 0
            while pending and col + len(pending[-1][0]) <= seq_len:
                doc, lab = pending.pop()
                n = len(doc)
                ids[row, col : col + n] = torch.tensor(doc)
                labels[row, col : col + n] = torch.tensor(lab)
                pos[row, col : col + n] = torch.arange(n)
                col += n
            if pending and col == 0:
                raise ValueError(f"a problem of {len(pending[-1][0])} tokens does not fit seq_len={seq_len}")
            pos[row, col:] = torch.arange(seq_len - col)  # padding forms its own (loss-free) segment
        yield {"input_ids": ids, "labels": labels, "position_ids": pos}


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to lr over `warmup` steps, then cosine decay to lr * min_ratio at `total`."""
    import math

    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(
    preset: str,
    out: str | Path,
    *,
    seed: int = 0,
    max_steps: int | None = None,
    time_budget_s: float | None = None,
    eval_n: int = 200,
    threads: int | None = None,
) -> dict[str, Any]:
    """Build `preset` into `out` (see the module docstring); returns the facts written to `out/.complete`."""
    import torch

    from tlt.model.presets import MODEL_PRESETS
    from tlt.services.common.logging import get_logger

    log = get_logger("model.build")
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(MODEL_PRESETS)}")
    spec = MODEL_PRESETS[preset]
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        from tlt.services.common.config import ConfigError

        # the finished build takes the place of `out` and what was there is deleted: only ever an older model
        raise ConfigError(f"{out} holds files and is not a model folder (no config.json); the build replaces its "
                          "--out, so give a new or empty folder")
    train = dict(spec["train"])
    steps = max_steps if max_steps is not None else train["max_steps"]
    budget = time_budget_s if time_budget_s is not None else train["time_budget_s"]
    torch.set_num_threads(threads or train["threads"])

    from tlt.services.common.signals import unwind_on_termination

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Ctrl-C, SIGTERM (a container's stop, `timeout`) or a failure: no half-built temp folder is left beside --out
    # (another pid would never clean it)
    with unwind_on_termination("build_terminated", "model.build"):
        try:
            facts = _train_into(tmp, preset, spec, train, steps, budget, seed=seed, eval_n=eval_n)
            _swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("build_finished", out=str(out), **{k: v for k, v in facts.items() if k != "accuracy_by_steps"})
    return facts


def _train_into(tmp: Path, preset: str, spec: dict[str, Any], train: dict[str, Any], steps: int, budget: float, *,
                seed: int, eval_n: int) -> dict[str, Any]:
    """Tokenizer, pre-training and eval of `preset` written into `tmp`; returns the facts (also in tmp/.complete)."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from tlt.model.evaluate import NativeGenerator, eval_problems, evaluate
    from tlt.model.files import share_weights
    from tlt.model.testing import config_for, pad_vocab
    from tlt.model.tokenizer import build_tokenizer
    from tlt.services.common.logging import get_logger

    log = get_logger("model.build")
    t_start = time.monotonic()
    tokenizer = build_tokenizer(tmp, seed=seed)
    config = config_for(
        "qwen2", pad_vocab(len(tokenizer)), tokenizer.eos_token_id, tokenizer.pad_token_id, **spec["model"]
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train["lr"],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    batches = packed_batches(tokenizer, train["seq_len"], train["batch_size"], seed)
    log.info("build_started", preset=preset, seed=seed, steps=steps, params=sum(p.numel() for p in model.parameters()))

    t_train = time.monotonic()
    tokens = loss_tokens = 0
    done = 0
    ema_loss = None
    stopped_by_time = False
    bar = tqdm(total=steps, desc=f"pre-train {preset}", unit="step", dynamic_ncols=True)
    for step in range(steps):
        if time.monotonic() - t_train > budget:
            stopped_by_time = True
            log.warning("time_budget_reached", step=step, budget_s=budget)
            break
        lr = lr_at(step, lr=train["lr"], warmup=train["warmup_steps"], total=steps, min_ratio=train["min_lr_ratio"])
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next(batches)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done += 1
        tokens += batch["input_ids"].numel()
        loss_tokens += int((batch["labels"] != -100).sum())
        ema_loss = loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * loss.item()
        bar.update(1)
        if step % 25 == 0 or step == steps - 1:
            log.debug("train_step", step=step, loss=round(loss.item(), 4), lr=lr, tokens=tokens)
        bar.set_postfix(loss=f"{ema_loss:.3f}", lr=f"{lr:.1e}", tok_s=f"{tokens / (time.monotonic() - t_train):.0f}")
    bar.close()
    train_s = time.monotonic() - t_train

    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(tmp)
    share_weights(tmp)  # safetensors wrote them 0600
    facts: dict[str, Any] = {
        "preset": preset,
        "seed": seed,
        "steps": done,
        "planned_steps": steps,
        "stopped_by_time": stopped_by_time,
        "train_seconds": round(train_s, 1),
        "train_tokens": tokens,
        "train_tokens_per_s": round(tokens / train_s, 1),
        "final_loss": round(ema_loss, 4) if ema_loss is not None else None,
        "params": sum(p.numel() for p in model.parameters()),
        # what the weights depend on besides the seed: the build is bit-for-bit repeatable on one machine, but
        # another CPU (its vector width: torch's kernels sum in another order) or torch release trains another model
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "train_threads": torch.get_num_threads(),
        "weights_sha256": _digest(tmp / "model.safetensors"),
    }
    if eval_n > 0:
        # the rollout's engine on the saved folder, all problems in flight on the training threads: 12 s on the
        # CI CPU for what `transformers` generate's padded batches did in 55-85 s of a 355 s build (session 37)
        report = evaluate(None, None, eval_problems(eval_n, seed), samples=1, seed=seed,
                          native=NativeGenerator(tmp, threads=torch.get_num_threads()))
        facts.update(
            eval_n=report.n,
            eval_engine=report.engine,
            eval_seconds=round(report.seconds, 1),
            accuracy=report.accuracy,
            sampled_accuracy=report.sampled_accuracy,
            p50_len=report.p50_len,
            p99_len=report.p99_len,
            tail_ratio=round(report.tail_ratio, 3),
            accuracy_by_steps=report.accuracy_by_steps,
        )
    facts["build_seconds"] = round(time.monotonic() - t_start, 1)
    facts["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (tmp / ".complete").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def _digest(path: Path) -> str:
    """sha256 of a file (the first 16 hex digits): two builds with the same one are the same model."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished temp folder to `out`, replacing an older one (a rename is atomic on one filesystem)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def run(args: argparse.Namespace) -> int:
    facts = build_model(
        args.preset,
        args.out,
        seed=args.seed,
        max_steps=args.max_steps,
        time_budget_s=args.time_budget,
        eval_n=args.eval_n,
        threads=args.threads,
    )
    print(json.dumps(facts, indent=2))
    return 0
