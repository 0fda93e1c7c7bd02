"""`tlt drafter warmup`: offline warm-up of the EAGLE drafter on the target's own features.

    tlt drafter warmup --model artifacts/tiny --out artifacts/tiny-drafter [--problems 64] [--epochs 4]

    task problems (synthetic long-tail task, ChatML prompts) --the target samples its own answers
      (the rollout's native engine, all in flight at once)--> post-final-norm last-layer features
      from the forwards that sampled them (collect.engine_samples)
    -> windows -> held-out split (1 sequence in 8) -> packed batches with segment masks
    -> AdamW (0.9, 0.95), grad clip 1.0, uniform noise U(-noise, noise) on input features,
       optionally training-time test (`--ttt-steps K`: the drafter also trained K-1 steps deep on its
       own outputs, `Drafter.forward_unrolled`)
    -> drafter folder (drafter_config.json + model.safetensors: own weights only) + warmup.json

Reports the held-out greedy acceptance length (offline chain simulation, acceptance.py) before and
after training. `--data reference` teacher-forces the task's reference solutions instead of
sampling (no generation; faster, but not the policy's own distribution).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import at_least, non_negative_float, out_folder, positive_float

    parser.add_argument("--model", required=True, help="the target checkpoint folder")
    parser.add_argument("--out", type=out_folder, required=True, help="where to write the drafter folder")
    parser.add_argument("--problems", type=at_least(8), default=64,
                        help="task problems to collect features on (1 in 8 is held out to score the drafter)")
    parser.add_argument("--epochs", type=at_least(1), default=4, help="passes over the training windows")
    parser.add_argument("--data", choices=("samples", "reference"), default="samples",
                        help="the model's own samples (default) or the task's reference solutions")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=160, help="longest sampled answer")
    parser.add_argument("--temperature", type=non_negative_float, default=1.0, help="sampling temperature of the target")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--noise", type=non_negative_float, default=0.1, help="uniform noise half-width on input features")
    parser.add_argument("--rows", type=at_least(1), default=8, help="packed rows per batch")
    parser.add_argument("--row-tokens", type=at_least(2), default=256, help="tokens per packed row")
    parser.add_argument("--depth", type=at_least(1), default=6, help="chain depth of the acceptance evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problems, sampling, init and training")
    parser.add_argument("--init", default="", help="start from this drafter folder instead of random")
    parser.add_argument("--ttt-steps", type=at_least(1), default=1,
                        help="training-time test: also train the drafter on its own outputs this many steps deep "
                             "(1 = off; each step costs about one more forward and backward)")


def split_heldout(samples: list, every: int = 8) -> tuple[list, list]:
    """(train, held): 1 sequence in `every` is held out with all its windows (`seq_id@start`), so a long
    answer cut into several windows never trains on the windows around the one it is scored on."""
    seq = [s.seq_id.rsplit("@", 1)[0] for s in samples]
    index = {k: i for i, k in enumerate(dict.fromkeys(seq))}
    held = [s for s, k in zip(samples, seq) if index[k] % every == every - 1]
    train = [s for s, k in zip(samples, seq) if index[k] % every != every - 1]
    return train, held


REPORT_FILE = "warmup.json"


def check_out(out_dir: str | Path) -> None:
    """ConfigError when `out_dir` holds files a drafter folder does not (a run folder, a data folder): the drafter's
    files were written among them. A new or empty folder, or an earlier drafter's (rewritten), is taken."""
    from tlt.model.drafter import CONFIG_FILE, WEIGHTS_FILE
    from tlt.services.common.config import ConfigError

    out = Path(out_dir)
    other = sorted(p.name for p in out.iterdir() if p.name not in (CONFIG_FILE, WEIGHTS_FILE, REPORT_FILE)) \
        if out.is_dir() else []
    if other:
        shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
        raise ConfigError(f"--out {out} holds other files than a drafter's ({shown}); give the drafter its own "
                          "folder (a new or empty one, or an earlier drafter's, e.g. artifacts/tiny-drafter)")


def run(args: argparse.Namespace) -> int:
    import json
    import random
    import time

    from tlt.model.folder import check_checkpoint

    # CheckpointError naming the folder (tlt: one line, exit 2), not a transformers trace; before torch loads
    check_checkpoint(args.model)
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from tlt.model.tokenizer import load_tokenizer

    from tlt.services.common.logging import get_logger
    from tlt.services.common.seeds import torch_seed
    from tlt.services.drafter.acceptance import mean_accept_length
    from tlt.services.drafter.collect import engine_samples, last_hidden, to_samples
    from tlt.services.drafter.packing import pack
    from tlt.services.drafter.training import make_optimizer, micro_step, new_drafter
    from tlt.task.problems import format_prompt, generate_problems

    log = get_logger("drafter.warmup")
    if args.init:
        from tlt.model.drafter import check_drafter_folder, read_drafter_config

        check_drafter_folder(args.init)  # before minutes of sampling, not after
        read_drafter_config(args.init, args.model)  # a config that is not one, too
    if (Path(args.out) / "config.json").is_file():  # the drafter's model.safetensors would replace the model's
        from tlt.services.common.config import ConfigError

        raise ConfigError(f"--out {args.out} is a model checkpoint folder (config.json); give the drafter its own "
                          "folder (e.g. artifacts/tiny-drafter)")
    check_out(args.out)
    torch.manual_seed(torch_seed(args.seed))
    t0 = time.time()
    tok = load_tokenizer(args.model)
    problems = generate_problems(args.problems, seed=args.seed + 1000)
    prompts = [tok(format_prompt(p), add_special_tokens=False)["input_ids"] for p in problems]
    samples = []
    if args.data == "samples":
        with tqdm(total=len(prompts), desc="target samples", unit="problem") as bar:
            samples = engine_samples(args.model, prompts, args.max_new_tokens, args.temperature, seed=args.seed,
                                     window_tokens=args.row_tokens, progress=bar.update)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        for i, (p, prob) in enumerate(zip(tqdm(prompts, desc="reference features", unit="problem"), problems)):
            ids = torch.tensor([p + tok(prob.solution + "<|im_end|>", add_special_tokens=False)["input_ids"]])
            samples += to_samples(f"p{i}", ids[0], last_hidden(model, ids)[0], len(p), 0, args.row_tokens)
    rng = random.Random(args.seed)
    train, held = split_heldout(samples)
    t_collect = time.time() - t0
    drafter = new_drafter(args.model, args.init, seed=args.seed)
    drafter.eval()
    before, steps_walked = mean_accept_length(drafter, held, args.depth)
    opt = make_optimizer(drafter, args.lr)
    gen = torch.Generator().manual_seed(torch_seed(args.seed))
    steps = 0
    for epoch in range(args.epochs):
        order = train[:]
        rng.shuffle(order)
        batches = []
        while order:
            batch, used = pack(order, args.rows, args.row_tokens)
            if batch is None:
                break
            ids = {id(s) for s in used}
            order = [s for s in order if id(s) not in ids]
            batches.append(batch)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch")
        for batch in bar:
            res = micro_step(drafter, opt, batch, grad_clip=1.0, noise=args.noise, generator=gen,
                             ttt_steps=args.ttt_steps)
            steps += 1
            bar.set_postfix(loss=f"{float(res.loss.detach()):.3f}", top1=f"{res.top1:.2f}")
    drafter.eval()
    after, _ = mean_accept_length(drafter, held, args.depth)
    out = Path(args.out)
    drafter.save(out)
    report = {"model": str(args.model), "problems": args.problems, "data": args.data,
              "train_windows": len(train), "heldout_windows": len(held), "heldout_steps": steps_walked,
              "train_tokens": sum(len(s) for s in train), "steps": steps, "epochs": args.epochs, "ttt_steps": args.ttt_steps,
              "accept_len_before": before, "accept_len_after": after, "depth": args.depth,
              "collect_s": round(t_collect, 1), "total_s": round(time.time() - t0, 1)}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    log.info("drafter_warmup_done", out=str(out), **{k: report[k] for k in
             ("accept_len_before", "accept_len_after", "steps", "total_s")})
    print(json.dumps(report, indent=2))
    return 0
