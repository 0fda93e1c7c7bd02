"""`tlt bench rollout`: a long-tail rollout with speculative decoding off / static / adaptive / model-free.

A GRPO-like batch (`--prompts` prompts x `--n` samples) whose response lengths are heavy-tailed
(per-request max_tokens from a log-normal, eos ignored), decoded by the native engine in each mode.
Most sequences finish early and the last few decode at batch 1-4: the tail SD is for.

Greedy (`--temperature 0`, the default): every mode must emit exactly the tokens of the first mode
(lossless check, exit status 1 otherwise). Sampled (`--temperature T > 0`): each request samples at T
with its own seed. Speculation consumes random numbers differently from plain decoding, so modes
differ token by token while sampling the same distribution (proved statistically by
tests/test_lossless_sampling.py): no identity check then (JSON `identical_to_first_mode: null`, exit 0).

`--workload task` instead decodes the synthetic task's problems at their natural lengths (stop at eos,
capped by `--max-tokens`): the trained model's own long tail (problem step counts are zipf-distributed),
which is what a learned drafter was trained on. Greedy: `--prompts` x `--n` distinct problems (n
greedy samples of one problem would be identical). Sampled: `--prompts` problems, each one request of
`--n` samples (a GRPO group; the n-gram drafter also matches against the siblings).
`--workload synthetic` (the default) is the forced-length batch above on random-token prompts (one
request per sample so that each keeps its own length).

Reported per mode (JSON fields in brackets):
- wall time, tokens, tokens/s and speed-up over `off` [wall_s, tokens, tok_per_s, speedup_vs_off];
- the tail: seconds in engine steps whose batch is 1..`--threshold`, their share of the wall time and
  tokens/s [tail_s, tail_share, tail_tok_per_s];
- per batch-size bucket (1, 2-4, 5-16, 17-63, >=64; only those that occurred): tokens, seconds, steps,
  tokens/s and speed-up over off's same bucket [buckets]; tokens/s at batch <= 4 and its speed-up
  over off [tail4_tok_per_s, tail4_speedup];
- verify steps and their share of the decode-only steps [verify_steps, decode_steps, sd_step_share],
  tokens per sequence per verify step [mean_accept_len], and per arm how often it was chosen and its
  accept length [arms: {name: {verify_steps, share, seq_steps, emitted, accept_len}}].
A step's batch is the sequences the scheduler put in it (what the SD switch sees); a step's time is
the wall time of `engine.step()`, so bucket seconds add up to slightly less than wall_s.

Issue #4's targets (CPU, warm-up drafter): tail4_speedup >= 2, speedup_vs_off >= 1.7, and the adaptive
modes' >=64 bucket within 3% of off, e.g. on
    tlt bench rollout --workload task --prompts 32 --n 8 --temperature 1.0 --drafter artifacts/drafter-tiny

Modes: off; ngram (adaptive bandit, model-free drafter); static-ngram (one fixed arm, `--static-arm`);
learned and static-learned (the EAGLE drafter from `--drafter DIR`, skipped without it). `--arms
A,B,C` gives the adaptive modes' bandit these arms in every batch-size bucket (default: SpecConfig's
per-bucket arms). The model is `--model DIR`, else `artifacts/tiny` when it exists, else a random
checkpoint with the tiny preset's shape (a random model repeats itself a lot, which flatters the
n-gram drafter: say which model you used).
"""

from __future__ import annotations

import argparse
import json
import sys

MODES = ("off", "ngram", "static-ngram", "learned", "static-learned")
# batch-size buckets of the per-step report: (smallest, largest or None, label)
BUCKETS = ((1, 1, "1"), (2, 4, "2-4"), (5, 16, "5-16"), (17, 63, "17-63"), (64, None, ">=64"))
SAMPLED_NOTE = "sampled (distribution: tests/test_lossless_sampling.py)"


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
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, modes must match token for token; > 0: seeded sampling (no identity check)")
    parser.add_argument("--threshold", type=int, default=16, help="SD runs while the running batch is <= this")
    parser.add_argument("--static-arm", default="8_4_16", help="arm of the static modes")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms (steps_topk_drafttokens) of the adaptive modes' bandit in every "
                             "batch-size bucket, e.g. 6_1_7,8_1_9,8_4_16 (default: SpecConfig's per-bucket arms)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and sampling")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _request_seed(base: int, k: int) -> int:
    return base * 1_000_003 + k


def _task_requests(model_dir, args: argparse.Namespace):  # noqa: ANN001, ANN202
    """Task problems that stop at eos; returns (requests, longest prompt).

    Greedy: prompts x n distinct problems, one sample each. Sampled: `prompts` problems, each one
    seeded request of n samples (a GRPO group)."""
    from transformers import AutoTokenizer

    from tlt.services.rollout.types import GenerationRequest, SamplingParams
    from tlt.task import format_prompt, generate_problems

    sampled = args.temperature > 0
    count = args.prompts if sampled else args.prompts * args.n
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tuple(tok.encode(format_prompt(p))) for p in generate_problems(count, args.seed + 7_000_003)]
    if sampled:
        requests = [GenerationRequest(f"t{i}", p, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                                 seed=_request_seed(args.seed, i)), n=args.n)
                    for i, p in enumerate(ids)]
    else:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        requests = [GenerationRequest(f"t{i}", p, params) for i, p in enumerate(ids)]
    return requests, max(len(p) for p in ids)


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
    seeded = args.temperature > 0
    requests = [
        GenerationRequest(f"p{i}s{j}", prompts[i], SamplingParams(
            temperature=args.temperature, max_tokens=int(lengths[i, j]), ignore_eos=True,
            seed=_request_seed(args.seed, i * args.n + j) if seeded else None))
        for i in range(args.prompts) for j in range(args.n)
    ]
    return requests, lengths


def _bucket(batch: int) -> str:
    return next(label for lo, hi, label in BUCKETS if batch >= lo and (hi is None or batch <= hi))


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 1) if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _spec_config(mode: str, args: argparse.Namespace, bucket_arms):  # noqa: ANN001, ANN202
    from tlt.services.rollout.spec.config import SpecConfig

    learned = mode.endswith("learned")
    extra = {} if bucket_arms is None else {"bucket_arms": bucket_arms}
    return SpecConfig(mode="static" if mode.startswith("static") else "adaptive", threshold=args.threshold,
                      hysteresis_steps=2, static_arm=args.static_arm, drafter="learned" if learned else "ngram",
                      drafter_path=args.drafter or "", **extra)


def _run_mode(engine, requests, threshold: int) -> tuple[dict, dict]:  # noqa: ANN001
    """Decode `requests` to the end on `engine`, timing every step; returns (outputs, measurements)."""
    import time

    scheduled: list = [None]  # the batch of the step being run (wraps the engine's scheduler call)
    schedule = engine.scheduler.schedule

    def probe():  # noqa: ANN202
        scheduled[0] = schedule()
        return scheduled[0]

    engine.scheduler.schedule = probe
    dec = engine.spec_decoder
    for r in requests:
        engine.add_request(r)
    outs: dict[tuple[str, int], list[int]] = {}
    buckets: dict[str, list] = {}  # label -> [tokens, seconds, steps]
    tail_tokens, tail_time, steps, decode_steps, verify_steps, verified_seq_steps = 0, 0.0, 0, 0, 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        scheduled[0] = None
        v0 = dec.verify_steps if dec is not None else 0
        ts = time.perf_counter()
        emitted, done = engine.step()
        dt = time.perf_counter() - ts
        steps += 1
        batch = scheduled[0]
        size = len(batch.seqs) if batch is not None else 0
        new = sum(len(s.new_token_ids) for s in emitted)
        if size > 0:
            b = buckets.setdefault(_bucket(size), [0, 0.0, 0])
            b[0] += new
            b[1] += dt
            b[2] += 1
            decode_steps += batch.is_decode_only
            if size <= threshold:
                tail_tokens += new
                tail_time += dt
        if dec is not None and dec.verify_steps > v0:
            verify_steps += 1
            verified_seq_steps += len(emitted)
        for c in done:
            outs[(c.request_id, c.sample_index)] = c.token_ids
    wall = time.perf_counter() - t0
    engine.scheduler.schedule = schedule
    return outs, {"wall": wall, "buckets": buckets, "tail_tokens": tail_tokens, "tail_time": tail_time,
                  "steps": steps, "decode_steps": decode_steps, "verify_steps": verify_steps,
                  "verified_seq_steps": verified_seq_steps}


def _mode_result(mode: str, outs: dict, m: dict, spec: dict) -> dict:
    wall, tokens = m["wall"], sum(len(v) for v in outs.values())
    order = [label for _, _, label in BUCKETS]
    buckets = {label: {"tokens": t, "seconds": round(s, 6), "steps": n, "tok_per_s": _rate(t, s)}
               for label, (t, s, n) in sorted(m["buckets"].items(), key=lambda kv: order.index(kv[0]))}
    t4 = [m["buckets"][k] for k in ("1", "2-4") if k in m["buckets"]]
    arm_total = sum(a["verify_steps"] for a in spec.get("arms", {}).values())
    arms = {name: {**a, "share": round(a["verify_steps"] / arm_total, 3) if arm_total else 0.0,
                   "accept_len": round(a["emitted"] / a["seq_steps"], 2) if a["seq_steps"] else None}
            for name, a in sorted(spec.get("arms", {}).items(), key=lambda kv: -kv[1]["verify_steps"])}
    return {
        "mode": mode, "wall_s": round(wall, 3), "tokens": tokens, "tok_per_s": round(tokens / wall, 1),
        "tail_s": round(m["tail_time"], 3), "tail_share": round(m["tail_time"] / wall, 3) if wall else 0.0,
        "tail_tok_per_s": _rate(m["tail_tokens"], m["tail_time"]),
        "tail4_tok_per_s": _rate(sum(b[0] for b in t4), sum(b[1] for b in t4)),
        "buckets": buckets, "steps": m["steps"], "decode_steps": m["decode_steps"],
        "verify_steps": spec.get("verify_steps", 0), "verified_seq_steps": m["verified_seq_steps"],
        "sd_step_share": round(m["verify_steps"] / m["decode_steps"], 3) if m["decode_steps"] else 0.0,
        "mean_accept_len": round(spec.get("mean_accept_len", 0.0), 2), "arms": arms,
    }


def _print_table(report: dict, args: argparse.Namespace) -> None:
    results = report["results"]
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    print(f"model: {report['model']}; {report['sequences']} sequences ({report['requests']} requests, {sampling}), "
          f"response length p50 {report['lengths_p50']}, max {report['lengths_max']}; SD threshold {args.threshold}")
    print(f"{'mode':<15}{'wall s':>8}{'tok/s':>8}{'speedup':>9}{'tail s':>8}{'tail%':>7}{'tail tok/s':>12}"
          f"{'b<=4 x':>8}{'verify':>8}{'SD%':>6}{'accept':>8}  lossless")
    ran = [r for r in results if "skipped" not in r]
    for r in results:
        if "skipped" in r:
            print(f"{r['mode']:<15} skipped: {r['skipped']}")
            continue
        same = r["identical_to_first_mode"]
        lossless = SAMPLED_NOTE if same is None else ("identical" if same else "DIFFERENT")
        print(f"{r['mode']:<15}{r['wall_s']:>8.2f}{r['tok_per_s']:>8.1f}{r.get('speedup_vs_off') or 0:>9.2f}"
              f"{r['tail_s']:>8.2f}{100 * r['tail_share']:>6.0f}%{r['tail_tok_per_s'] or 0:>12.1f}"
              f"{r.get('tail4_speedup') or 0:>8.2f}{r['verify_steps']:>8}{100 * r['sd_step_share']:>5.0f}%"
              f"{r['mean_accept_len']:>8.2f}  {lossless}")
    labels = [label for _, _, label in BUCKETS if any(label in r["buckets"] for r in ran)]
    if labels:
        print("tokens/s per batch-size bucket (x: over off's same bucket; JSON has tokens and seconds)")
        print(f"{'mode':<15}" + "".join(f"{'batch ' + label:>18}" for label in labels))
        for r in ran:
            cells = []
            for label in labels:
                b = r["buckets"].get(label)
                if b is None or b["tok_per_s"] is None:
                    cells.append(f"{'-':>18}")
                else:
                    x = f" ({b['speedup_vs_off']:.2f}x)" if b.get("speedup_vs_off") is not None else ""
                    cells.append(f"{b['tok_per_s']:.1f}{x}".rjust(18))
            print(f"{r['mode']:<15}" + "".join(cells))
    with_arms = [r for r in ran if r["arms"]]
    if with_arms:
        print("arms (verify steps chosen, share, accept length = tokens per sequence per verify step)")
        for r in with_arms:
            print(f"{r['mode']:<15}" + " | ".join(
                f"{name} {a['verify_steps']} ({100 * a['share']:.0f}%) acc {a['accept_len'] or 0:.2f}"
                for name, a in r["arms"].items()))


def run(args: argparse.Namespace) -> int:
    import torch

    from tlt.bench import resolve_model
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.spec.config import SpecConfig
    from tlt.services.rollout.spec.decoder import build_spec_decoder

    torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"error: unknown modes {bad}; choose from {list(MODES)}", file=sys.stderr)
        return 2
    if not args.temperature >= 0:  # also rejects nan
        print(f"error: --temperature must be >= 0, got {args.temperature}", file=sys.stderr)
        return 2
    bucket_arms = None
    if args.arms is not None:
        arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        bucket_arms = tuple(arms for _ in SpecConfig().bucket_thresholds)  # the same arms in every bucket
        try:
            _spec_config("ngram", args, bucket_arms)
        except ValueError as e:
            print(f"error: --arms {args.arms!r}: {e}", file=sys.stderr)
            return 2
    resolved = resolve_model(args.model)
    if resolved is None:
        print(f"error: {args.model} is not a checkpoint folder", file=sys.stderr)
        return 2
    model_dir, source = resolved

    sampled = args.temperature > 0
    if args.workload == "task":
        requests, prompt_len = _task_requests(model_dir, args)
    else:
        requests, lengths = _synthetic_requests(args)
        prompt_len = args.prompt_len
    num_seqs = sum(r.n for r in requests)
    total_ctx = prompt_len + args.max_tokens + 64
    results, reference = [], None
    for mode in modes:
        if mode.endswith("learned") and not args.drafter:
            results.append({"mode": mode, "skipped": "no --drafter given"})
            continue
        engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=num_seqs, max_model_len=total_ctx,
                                                   num_kv_blocks=num_seqs * (total_ctx // 16 + 2) + 64))
        if mode != "off":
            cfg = _spec_config(mode, args, bucket_arms if not mode.startswith("static") else None)
            engine.spec_decoder = build_spec_decoder(cfg, engine.runner, engine.block_manager)
            engine.scheduler.on_release = engine.spec_decoder.release
        outs, measured = _run_mode(engine, requests, args.threshold)
        if reference is None:
            reference = outs
        result = _mode_result(mode, outs, measured, engine.stats().spec)
        result["identical_to_first_mode"] = None if sampled else outs == reference
        results.append(result)
    base = next((r for r in results if r.get("mode") == "off"), None)
    for r in results:
        if base is None or "wall_s" not in r:
            continue
        r["speedup_vs_off"] = round(base["wall_s"] / r["wall_s"], 2)
        r["tail4_speedup"] = _ratio(r["tail4_tok_per_s"], base["tail4_tok_per_s"])
        for label, b in r["buckets"].items():
            b["speedup_vs_off"] = _ratio(b["tok_per_s"], base["buckets"].get(label, {}).get("tok_per_s"))
    if args.workload == "task":  # natural lengths: those the first mode decoded
        lengths = torch.tensor([len(v) for v in (reference or {}).values()] or [0], dtype=torch.float32)
    report = {"model": source, "workload": args.workload, "temperature": args.temperature,
              "requests": len(requests), "sequences": num_seqs,
              "lengths_p50": int(lengths.float().median()), "lengths_max": int(lengths.max()),
              "threshold": args.threshold, "arms": list(bucket_arms[0]) if bucket_arms else None, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report, args)
    if sampled:
        return 0
    return 0 if all(r.get("identical_to_first_mode", True) for r in results) else 1
