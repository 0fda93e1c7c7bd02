"""`tlt bench rollout`: a long-tail rollout with speculative decoding off / static / adaptive / model-free.

A GRPO-like batch (`--prompts` prompts x `--n` samples) whose response lengths are heavy-tailed
(per-request max_tokens from a log-normal, eos ignored), decoded greedily by the native engine in
each mode. Most sequences finish early and the last few decode at batch 1-4: the tail SD is for.
Every mode must emit exactly the tokens of `off` (lossless check, exit status 1 otherwise).
Reports wall time, tokens/s, speed-up over `off`, tokens/s in the tail (steps with running batch <=
threshold), verify steps and mean tokens per sequence per verify step.

`--workload task` instead decodes the synthetic task's problems (`--prompts` x `--n` distinct ones)
greedily with their natural lengths (stop at eos, capped by `--max-tokens`): the trained model's own
long tail (problem step counts are zipf-distributed), which is what a learned drafter was trained on.
`--workload synthetic` (the default) is the forced-length batch above on random-token prompts.

Modes: off; ngram (adaptive bandit, model-free drafter); static-ngram (one fixed arm); learned and
static-learned (the EAGLE drafter from `--drafter DIR`, skipped without it). The model is `--model
DIR`, else `artifacts/tiny` when it exists, else a random checkpoint with the tiny preset's shape
(a random model repeats itself a lot, which flatters the n-gram drafter: say which model you used).
"""

from __future__ import annotations

import argparse
import json
import sys

MODES = ("off", "ngram", "static-ngram", "learned", "static-learned")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: artifacts/tiny, else a random tiny-shaped one)")
    parser.add_argument("--drafter", default=None, help="drafter folder for the learned modes")
    parser.add_argument("--modes", default="off,ngram,static-ngram,learned", help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (a GRPO group)")
    parser.add_argument("--prompt-len", type=int, default=24, help="prompt length in tokens")
    parser.add_argument("--median-tokens", type=int, default=24, help="median response length")
    parser.add_argument("--max-tokens", type=int, default=320, help="longest response (the tail's cap)")
    parser.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma of response lengths (the tail's weight)")
    parser.add_argument("--workload", choices=("synthetic", "task"), default="synthetic",
                        help="forced log-normal lengths on random prompts, or task problems at natural lengths")
    parser.add_argument("--threshold", type=int, default=16, help="SD runs while the running batch is <= this")
    parser.add_argument("--static-arm", default="8_4_16", help="arm of the static modes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and lengths")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _task_requests(model_dir, count: int, max_tokens: int, seed: int):  # noqa: ANN001, ANN202
    """`count` task problems as greedy requests that stop at eos; returns (requests, longest prompt)."""
    from transformers import AutoTokenizer

    from tlt.services.rollout.types import GenerationRequest, SamplingParams
    from tlt.task import format_prompt, generate_problems

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tuple(tok.encode(format_prompt(p))) for p in generate_problems(count, seed + 7_000_003)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [GenerationRequest(f"t{i}", p, params) for i, p in enumerate(ids)], max(len(p) for p in ids)


def _synthetic_requests(args: argparse.Namespace):  # noqa: ANN202
    """Random-token prompts with forced log-normal lengths (eos ignored); returns (requests, lengths [P, n])."""
    import torch

    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    g = torch.Generator().manual_seed(args.seed)
    lengths = (torch.randn(args.prompts, args.n, generator=g) * args.sigma).exp() * args.median_tokens
    lengths = lengths.round().clamp(1, args.max_tokens).long()
    prompts = [tuple(torch.randint(3, 200, (args.prompt_len,), generator=g).tolist()) for _ in range(args.prompts)]
    # One request per sample so that each has its own length (the n samples of one request share
    # max_tokens, and with eos ignored the tail would vanish). The n-gram drafter indexes siblings per
    # request, so here it matches each sample against its own context only: no sibling help.
    requests = [
        GenerationRequest(f"p{i}s{j}", prompts[i], SamplingParams(temperature=0.0, max_tokens=int(lengths[i, j]),
                                                                  ignore_eos=True))
        for i in range(args.prompts) for j in range(args.n)
    ]
    return requests, lengths


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.bench import resolve_model
    from tlt.services.rollout.spec.config import SpecConfig
    from tlt.services.rollout.spec.decoder import build_spec_decoder

    torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"error: unknown modes {bad}; choose from {list(MODES)}", file=sys.stderr)
        return 2
    resolved = resolve_model(args.model)
    if resolved is None:
        print(f"error: {args.model} is not a checkpoint folder", file=sys.stderr)
        return 2
    model_dir, source = resolved

    if args.workload == "task":
        requests, prompt_len = _task_requests(model_dir, args.prompts * args.n, args.max_tokens, args.seed)
    else:
        requests, lengths = _synthetic_requests(args)
        prompt_len = args.prompt_len
    total_ctx = prompt_len + args.max_tokens + 64
    results, reference = [], None
    for mode in modes:
        learned = mode.endswith("learned")
        if learned and not args.drafter:
            results.append({"mode": mode, "skipped": "no --drafter given"})
            continue
        engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=len(requests), max_model_len=total_ctx,
                                                   num_kv_blocks=len(requests) * (total_ctx // 16 + 2) + 64))
        if mode != "off":
            cfg = SpecConfig(mode="static" if mode.startswith("static") else "adaptive", threshold=args.threshold,
                             hysteresis_steps=2, static_arm=args.static_arm, drafter="learned" if learned else "ngram",
                             drafter_path=args.drafter or "")
            engine.spec_decoder = build_spec_decoder(cfg, engine.runner, engine.block_manager)
            engine.scheduler.on_release = engine.spec_decoder.release
        for r in requests:
            engine.add_request(r)
        outs: dict[str, list[int]] = {}
        tail_tokens, tail_time, steps = 0, 0.0, 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            running = len(engine.scheduler.running)
            ts = time.perf_counter()
            emitted, done = engine.step()
            dt = time.perf_counter() - ts
            steps += 1
            if 0 < running <= args.threshold:
                tail_tokens += sum(len(s.new_token_ids) for s in emitted)
                tail_time += dt
            for c in done:
                outs[c.request_id] = c.token_ids
        wall = time.perf_counter() - t0
        tokens = sum(len(v) for v in outs.values())
        spec = engine.stats().spec
        if reference is None:
            reference = outs
        identical = outs == reference
        results.append({
            "mode": mode, "wall_s": round(wall, 3), "tokens": tokens, "tok_per_s": round(tokens / wall, 1),
            "tail_tok_per_s": round(tail_tokens / tail_time, 1) if tail_time else None, "steps": steps,
            "verify_steps": spec.get("verify_steps", 0), "mean_accept_len": round(spec.get("mean_accept_len", 0.0), 2),
            "identical_to_first_mode": identical,
        })
    base = next((r for r in results if r.get("mode") == "off"), None)
    for r in results:
        if base and "wall_s" in r:
            r["speedup_vs_off"] = round(base["wall_s"] / r["wall_s"], 2)
    if args.workload == "task":  # natural lengths: those the first mode decoded
        lengths = torch.tensor([len(v) for v in (reference or {}).values()] or [0], dtype=torch.float32)
    report = {"model": source, "workload": args.workload, "sequences": len(requests),
              "lengths_p50": int(lengths.float().median()), "lengths_max": int(lengths.max()),
              "threshold": args.threshold, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"model: {source}; {len(requests)} sequences, response length p50 {report['lengths_p50']}, "
              f"max {report['lengths_max']}; SD threshold {args.threshold}")
        print(f"{'mode':<15}{'wall s':>8}{'tok/s':>8}{'speedup':>9}{'tail tok/s':>12}{'verify':>8}{'accept':>8}  lossless")
        for r in results:
            if "skipped" in r:
                print(f"{r['mode']:<15} skipped: {r['skipped']}")
                continue
            print(f"{r['mode']:<15}{r['wall_s']:>8.2f}{r['tok_per_s']:>8.1f}{r.get('speedup_vs_off', 0):>9.2f}"
                  f"{(r['tail_tok_per_s'] or 0):>12.1f}{r['verify_steps']:>8}{r['mean_accept_len']:>8.2f}  "
                  f"{'identical' if r['identical_to_first_mode'] else 'DIFFERENT'}")
    return 0 if all(r.get("identical_to_first_mode", True) for r in results) else 1
