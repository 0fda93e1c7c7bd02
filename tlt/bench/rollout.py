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
request per sample so that each keeps its own length). Both are built in tlt/bench/rollout_workload.py.

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

`--repeats R` runs the modes R times, interleaved: round r runs every mode once, in `--modes` order,
each on a fresh engine, before round r+1 starts. A rollout of a few seconds on a shared CPU has 10-30%
run-to-run noise and its tail lasts only tens of steps, so one run per mode cannot tell a 3% (or even a
30%) difference; interleaving makes slow drifts of the machine (another job starting, thermal or
frequency changes) hit every mode alike instead of whichever mode ran during them. With R > 1 each
mode's row is the median over its R runs of every figure above (wall_s, tok_per_s, tail_s,
tail_tok_per_s, each bucket's tok_per_s, ...; a figure missing from some runs, e.g. a bucket, is the
median over the runs that have it). Speed-ups are taken per round first (the mode's figure in round r
over off's in round r), then their median is reported, with the smallest and largest per-round ratio
[speedup_vs_off_range, tail4_speedup_range, buckets[label].speedup_vs_off_range: [min, max]]. Arm
counts are summed over the rounds (share and accept_len, and mean_accept_len, come from the sums).
The raw per-run results stay in the JSON [rounds: one list of per-mode results per round, each with
its round and run_index, the position in the order the runs happened; repeats: R]. Greedy: every run
of every round must emit the tokens of round 0's first mode (exit status 1 otherwise). R = 1 (the
default) reports exactly as before, without those fields.

`--warmup W` (default 1) first runs every mode W times untimed (fresh engines, outputs and bandits
discarded): the process's one-time costs (first forwards, allocator growth, lazily built kernels and
code paths) would otherwise land in the first timed run, `off` in round 0, and inflate every
speed-up over it (measured: 20-30% on a sub-second rollout, most of it in the full-batch bucket).

`--min-tokens K` (task workload) keeps only problems whose reference solution is at least K tokens
long under the model's tokenizer (the first such problems of the seeded stream; the solution length
grows by 6 characters per step, 32 steps at most, about 200 tokens with the task tokenizer): a workload
where every sequence is long, so the whole rollout is tail-like decode (batch <= `--prompts` x `--n`)
over about 150-200 steps or more (the model may run past its reference up to `--max-tokens`), e.g. with `--prompts 4 --n 1 --min-tokens 150 --max-tokens 256`. The model's
own response can be shorter or longer than the reference; the report gives the decoded lengths.

Issue #4's targets (CPU, warm-up drafter): tail4_speedup >= 2, speedup_vs_off >= 1.7, and the adaptive
modes' >=64 bucket within 3% of off, e.g. on
    tlt bench rollout --workload task --prompts 32 --n 8 --temperature 1.0 --drafter artifacts/drafter-tiny

`--clock cpu` times every step (and the run) by this process's CPU time instead of the wall clock
(the "wall_s" fields then hold CPU seconds; the JSON says `clock`). With one torch thread that is the
time the run would take on an otherwise idle core: other jobs on a shared machine inflate wall time
but not CPU time (cache and memory-bandwidth contention still show), so small differences, such
as the >= 64 bucket's, can be resolved; `tlt bench engine` reports CPU-time rates for the same reason.

`--hook-cost` also reports, per adaptive mode, what its decoder adds to a plain decode step at the
full batch (the `wants` and `observe_plain` hooks, the only SD work above the threshold, timed by
CPU time over 20,000 calls) as a share of that step's forward [hook_cost: {mode: {batch, sd_on,
hooks_us, forward_ms, hooks_share}}]: the >= 64 bucket's overhead without run-to-run noise.

`--bandit keep` carries each adaptive mode's bandit from one round to the next (round 0 starts cold,
round r from what round r-1 learned), as the bandit of a long-lived rollout server carries over from
one RL step's rollout to the next; `fresh` (the default) starts every run cold, so a short run spends
most of its verify steps exploring. The engine, its KV cache and the drafter are new in every run
either way.

`--engine reuse` keeps one engine per mode for every timed run instead (a replica's engine lives across
RL steps). Each engine is built and run once untimed after the warm-up, so first-touch costs (the
decode mirror's buffers, the drafter cache) are paid outside the timed runs; its prefix cache is reset
before every run, as a weight update resets it; its bandit starts cold in round 0 (the untimed run's
rewards, first-touch costs included, are dropped) and carries over from round to round (needs
`--bandit keep`); and each run's requests get new ids, so no drafter state keyed by request (the
n-gram index of a request's samples) carries the last run's tokens. Per-run speculation counts are
the engine's counters' differences. `fresh` (the default) builds every run's engine anew: on the CPU
that read 1.53x against reuse's 1.50x (BENCHMARKS.md, Session 34).

`--gc-freeze on` (the default) freezes the process's heap after the warm-up, as every rollout replica does
once it is up, and collects before every timed run (each run's engine is new, and the last one's garbage must
not be collected inside the next run); each result's `gc_s` is the seconds its run spent in the collector.
Without it a full collection (0.19-0.27 s of a 2-4 s run) can land inside a run (BENCHMARKS.md, Session 29).

`--device cuda --dtype bfloat16 --kernels triton --graphs cuda` runs the engines on a GPU (with `--clock wall`: CPU
time does not time a GPU, and `--hook-cost` is refused there): plain decode and verify steps replayed from CUDA graphs
captured as each run's engine is built, outside the timed run. `--kernels torch` (and `--graphs off`) is the eager
PyTorch path. `--drafter-graphs cuda` replays the learned drafter's chains from CUDA graphs too (captured as each
run's engine is built; the engine sizes the drafter cache for its context so that none lands inside a run).
Sessions 30-32's H200 figures: BENCHMARKS.md, "GPU (H200)".

`--chain-min-prob P` sets SpecConfig.chain_min_prob for the learned modes: each sequence's chain
(topk = 1 arms) stops at the first draft whose cumulative draft probability is below P, so drafts
unlikely to be accepted cost no verification (and, for greedy chains, no drafting once every row is cut;
sampled chains are drafted to full depth and judged against p restricted to what the cut keeps).

Modes: off; ngram (adaptive bandit, model-free drafter); static-ngram (one fixed arm, `--static-arm`);
learned and static-learned (the EAGLE drafter from `--drafter DIR`, skipped without it). `--arms
A,B,C` gives the adaptive modes' bandit these arms in every batch-size bucket, `--arms A,B/C,D/...` one
list per bucket (default: SpecConfig's per-bucket arms), and `--buckets 1,2,5,17,64` where the buckets start
(with `--arms`). `--verify-budget N` sets SpecConfig.verify_token_budget (0: none), e.g. for speculating at
every batch size (`--threshold 256`), where a static arm's draft_tokens x threshold must fit it. The model
is `--model DIR`, else `artifacts/tiny` when it exists, else a random checkpoint with the tiny preset's
shape (a random model repeats itself a lot, which flatters the n-gram drafter: say which model you used).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from tlt.cli_args import at_least
from tlt.bench.rollout_engine import (_bucket_arms, _engine_config, _first_problem, _hook_cost, _run_mode, _spec_config,
                                      _warm_up, build_engine, spec_delta)
from tlt.bench.rollout_report import add_speedups, median_result, mode_result, print_table
from tlt.bench.rollout_workload import synthetic_requests, task_requests

MODES = ("off", "ngram", "static-ngram", "learned", "static-learned")


def _whole(x: float) -> float | int:
    """28.0 -> 28 (a median of whole lengths is whole unless it falls between two)."""
    return int(x) if x == int(x) else x


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: artifacts/tiny, else a random tiny-shaped one)")
    parser.add_argument("--drafter", default=None, help="drafter folder for the learned modes")
    parser.add_argument("--modes", default="off,ngram,static-ngram,learned", help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--prompts", type=at_least(1), default=8, help="distinct prompts")
    parser.add_argument("--n", type=at_least(1), default=4, help="samples per prompt (a GRPO group)")
    parser.add_argument("--prompt-len", type=at_least(1), default=24, help="prompt length in tokens")
    parser.add_argument("--median-tokens", type=at_least(1), default=24, help="median response length")
    parser.add_argument("--max-tokens", type=at_least(1), default=320, help="longest response (the tail's cap)")
    parser.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma of response lengths (the tail's weight)")
    parser.add_argument("--workload", choices=("synthetic", "task"), default="synthetic",
                        help="forced log-normal lengths on random prompts, or task problems at natural lengths")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, modes must match token for token; > 0: seeded sampling (no identity check)")
    parser.add_argument("--threshold", type=at_least(1), default=16, help="SD runs while the running batch is <= this")
    parser.add_argument("--hysteresis", type=at_least(1), default=None,
                        help="SpecConfig.hysteresis_steps: decode steps at or below the threshold, after a step above "
                             "it, before SD switches on (default: SpecConfig's, as a server runs it; the bench used 2 "
                             "up to session 45)")
    parser.add_argument("--after-big-batch", action="store_true",
                        help="start every speculative run as an RL rollout's tail starts: after a step above the "
                             "threshold, so the hysteresis applies from its first step (a fresh engine, without it, "
                             "speculates at once: a server's first small requests)")
    parser.add_argument("--static-arm", default="8_4_16", help="arm of the static modes")
    parser.add_argument("--verify-budget", type=at_least(0), default=None,
                        help="SpecConfig.verify_token_budget: most draft tokens one verify step checks over the batch "
                             "(0 = no limit; default: SpecConfig's); a static arm needs draft_tokens x threshold "
                             "within it")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms (steps_topk_drafttokens) of the adaptive modes' bandit in every "
                             "batch-size bucket, e.g. 6_1_7,8_1_9,8_4_16, or one list per bucket with '/' between "
                             "them (default: SpecConfig's per-bucket arms)")
    parser.add_argument("--buckets", default=None,
                        help="comma-separated ascending batch sizes where the adaptive modes' bandit buckets start, "
                             "e.g. 1,2,5,17,64 (default: SpecConfig's 1,2,5,21)")
    parser.add_argument("--chain-min-prob", type=float, default=0.0,
                        help="learned modes, chain arms: cut each sequence's chain at the first draft whose cumulative "
                             "draft probability is below this (SpecConfig.chain_min_prob; 0 = full depth)")
    parser.add_argument("--chain-sampling", choices=("on", "off"), default="on",
                        help="learned modes, chain arms, sampled requests: draw drafts from the drafter's distribution "
                             "and verify by rejection sampling (on, SpecConfig.chain_sampling) or draft greedily and "
                             "verify by the tree walk (off)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the modes this many times, interleaved (round r runs every mode once), and report "
                             "medians, speed-ups as the median (min-max) of per-round ratios")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs of every mode before the timed rounds (0: none; the first timed run would "
                             "then also pay the process's one-time costs)")
    parser.add_argument("--bandit", choices=("fresh", "keep"), default="fresh",
                        help="adaptive modes: a cold bandit in every run (fresh), or each round's bandit starting from "
                             "the previous round's, as a rollout server's does across RL steps (keep)")
    parser.add_argument("--engine", choices=("fresh", "reuse"), default="fresh",
                        help="a new engine for every run (fresh), or one per mode reused by every timed run, warmed "
                             "once and its prefix cache reset before each run: a long-lived replica (reuse; needs "
                             "--bandit keep)")
    parser.add_argument("--min-tokens", type=at_least(0), default=0,
                        help="task workload: keep only problems whose reference solution has at least this many "
                             "tokens (0: off), for a workload of long sequences only")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time steps by the wall clock, or by this process's CPU time (one thread: what the run "
                             "takes on an otherwise idle core; robust to other load on a shared machine)")
    parser.add_argument("--hook-cost", action="store_true",
                        help="also time what the adaptive modes' decoder adds to a plain step at the full batch "
                             "(its hooks, by CPU time) against the step's forward: the >= 64 bucket's overhead, "
                             "measured directly instead of through run-to-run noise")
    parser.add_argument("--gc-freeze", choices=("on", "off"), default="on",
                        help="freeze the process's heap after the warm-up and collect before every timed run, as a "
                             "rollout replica freezes its heap once up ([rollout] gc_freeze): on, a full collection "
                             "no longer walks ~370,000 startup objects (0.19 s) inside whichever run it lands in")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads")
    parser.add_argument("--device", default="cpu", help="the engine's torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weights, activations and KV cache dtype")
    parser.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto",
                        help="EngineConfig.kernels: the decode/verify hot path (auto: triton on CUDA, torch on cpu)")
    parser.add_argument("--graphs", choices=("off", "cuda", "emulate"), default="off",
                        help="EngineConfig.decode_graphs: plain decode and SD verify steps replayed from CUDA graphs "
                             "per batch bucket (cuda: needs --device cuda and Triton kernels; captured as each run's "
                             "engine is built, outside the timed run)")
    parser.add_argument("--drafter-graphs", choices=("off", "cuda", "emulate"), default="off",
                        help="SpecConfig.drafter_graphs (learned modes): the drafter's chains replayed from CUDA "
                             "graphs per batch bucket (cuda: needs --device cuda; BENCHMARKS.md 'GPU (H200)')")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and sampling")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import gc
    import time

    from tlt.bench import resolve_model
    from tlt.services.common.gc_heap import GcPauses, freeze_heap, unfreeze_heap

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        print(f"error: --modes {args.modes!r} names no mode; choose from {list(MODES)}", file=sys.stderr)
        return 2
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"error: unknown modes {bad}; choose from {list(MODES)}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"error: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.warmup < 0:
        print(f"error: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return 2
    if args.engine == "reuse" and args.bandit != "keep":
        print("error: --engine reuse keeps each engine's bandit across runs: give --bandit keep", file=sys.stderr)
        return 2
    if args.min_tokens and args.workload != "task":
        print("error: --min-tokens needs --workload task", file=sys.stderr)
        return 2
    if not 0 <= args.chain_min_prob < 1:
        print(f"error: --chain-min-prob must be in [0, 1), got {args.chain_min_prob}", file=sys.stderr)
        return 2
    try:  # the engine's device, dtype, kernels and graphs, refused before the model loads
        _engine_config(args, 1, 64, 8)
    except ValueError as e:
        print(f"error: --device / --dtype / --kernels / --graphs: {_first_problem(e)}", file=sys.stderr)
        return 2
    if args.device != "cpu" and (args.clock == "cpu" or args.hook_cost):
        flag = "--clock cpu" if args.clock == "cpu" else "--hook-cost"
        print(f"error: {flag} times this process's CPU, not the work of device {args.device!r}"
              f"{': use --clock wall' if flag == '--clock cpu' else ''}", file=sys.stderr)
        return 2
    for flag, value in (("--temperature", args.temperature), ("--sigma", args.sigma)):
        if not (math.isfinite(value) and value >= 0):  # inf or nan would fail only after the model has loaded
            print(f"error: {flag} must be a finite number >= 0, got {value}", file=sys.stderr)
            return 2
    try:
        buckets, bucket_arms, given = _bucket_arms(args)
    except ValueError as e:
        print(f"error: --buckets {args.buckets!r} / --arms {args.arms!r}: {e}", file=sys.stderr)
        return 2
    ran = [m for m in modes if not (m.endswith("learned") and not args.drafter)]
    # every config a run builds, before the model loads; with no SD mode to run the flags are still checked
    # (as the adaptive mode's), so a bad value is refused rather than silently ignored
    for mode in [m for m in ran if m != "off"] or ["ngram"]:
        try:
            _spec_config(mode, args, None if mode.startswith("static") else bucket_arms, given)
        except ValueError as e:
            print(f"error: mode {mode}: the speculative decoding flags (--threshold, --static-arm, --arms, --buckets, "
                  f"--verify-budget, --chain-min-prob) make no valid SpecConfig: {_first_problem(e)}", file=sys.stderr)
            return 2
    model_dir, source = resolve_model(args.model)  # an explicit --model is checked (exit 2)
    import torch  # after every check: a wrong argument fails at once, not after torch has loaded

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device}: this torch ({torch.__version__}) sees no CUDA device", file=sys.stderr)
        return 2
    from tlt.model.folder import read_model_config
    from tlt.services.rollout.engine.config import context_limit
    from tlt.services.rollout.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)

    sampled = args.temperature > 0
    if args.workload == "task":
        try:
            requests, prompt_len = task_requests(model_dir, args)
        except ValueError as e:
            print(f"error: --min-tokens {args.min_tokens}: {e}", file=sys.stderr)
            return 2
    else:
        requests, lengths = synthetic_requests(args)
        prompt_len = args.prompt_len
    num_seqs = sum(r.n for r in requests)
    limit = context_limit(0, read_model_config(model_dir))
    if prompt_len + args.max_tokens > limit:
        print(f"error: prompts of {prompt_len} tokens + --max-tokens {args.max_tokens} are past the model's context "
              f"{limit}", file=sys.stderr)
        return 2
    total_ctx = min(prompt_len + args.max_tokens + 64, limit)

    def new_engine(mode: str) -> LLMEngine:
        return build_engine(model_dir, args, mode, num_seqs, total_ctx, bucket_arms, given)

    for _ in range(args.warmup):  # untimed: the process's one-time costs must not land in a timed run
        for mode in ran:
            _warm_up(new_engine(mode), requests)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    pauses = GcPauses(clock).install()  # the collector's seconds in each run, by the runs' clock
    if args.gc_freeze == "on":
        freeze_heap()
    rounds: list[list[dict]] = []  # per round, the results of the modes that ran, in --modes order
    reference, run_index = None, 0
    bandits: dict = {}  # --bandit keep: mode -> the bandit its last run ended with
    engines: dict = {}  # --engine reuse: mode -> its engine, run once untimed
    if args.engine == "reuse":
        for mode in ran:
            engines[mode] = new_engine(mode)
            _warm_up(engines[mode], requests)
            if engines[mode].spec_decoder is not None:  # round 0 starts cold, as --bandit keep's does on fresh engines
                engines[mode].spec_decoder.bandit = engines[mode].spec_decoder.new_bandit()
    try:
        for round_index in range(args.repeats):  # interleaved: every mode once per round
            row = []
            for mode in ran:
                engine = engines.get(mode) or new_engine(mode)
                if mode != "off" and args.bandit == "keep":
                    engine.spec_decoder.bandit = bandits.setdefault(mode, engine.spec_decoder.bandit)
                bandit = engine.spec_decoder.bandit if engine.spec_decoder is not None else None
                held = sum(a.samples for b in bandit.snapshot() for a in b.arms) if bandit is not None else 0
                engine.block_manager.reset_prefix_cache()  # a reused engine: as a weight update leaves it
                if args.after_big_batch and engine.spec_decoder is not None:  # as after an RL rollout's big batch
                    engine.spec_decoder.switch.update(args.threshold + 1)
                before = engine.stats().spec
                if args.gc_freeze == "on":
                    gc.collect()  # the last run's engine, untimed
                pauses.reset()
                if args.engine == "reuse":  # new request ids: a drafter's per-request state (the n-gram index of a
                    # request's samples) must not carry the last run's tokens, as a server sees new requests each step
                    run_requests = [dataclasses.replace(r, request_id=f"{r.request_id}@{run_index}") for r in requests]
                    outs, measured = _run_mode(engine, run_requests, args.threshold, clock)
                    outs = {(rid.rsplit("@", 1)[0], i): v for (rid, i), v in outs.items()}
                else:
                    outs, measured = _run_mode(engine, requests, args.threshold, clock)
                gc_s = sum(pauses.seconds)
                if reference is None:
                    reference = outs
                result = mode_result(mode, outs, measured, spec_delta(before, engine.stats().spec))
                result["gc_s"] = round(gc_s, 3)
                result["identical_to_first_mode"] = None if sampled else outs == reference
                if args.bandit == "keep" and bandit is not None and engine.spec_decoder.config.mode == "adaptive":
                    result["bandit_start_rewards"] = held  # rewards the bandit held when the run began (0: cold)
                if args.repeats > 1:
                    result["round"], result["run_index"] = round_index, run_index
                run_index += 1
                row.append(result)
            add_speedups(row)
            rounds.append(row)
    finally:  # the caller's process as it was (the tests call run() in-process)
        pauses.uninstall()
        if args.gc_freeze == "on":
            unfreeze_heap()
    per_mode = iter([row[j] for row in rounds] for j in range(len(ran)))  # column j: mode ran[j], all rounds
    results = []
    for mode in modes:
        if mode not in ran:
            results.append({"mode": mode, "skipped": "no --drafter given"})
            continue
        runs = next(per_mode)
        results.append(runs[0] if args.repeats == 1 else median_result(runs, sampled))
    if args.workload == "task":  # natural lengths: those the first mode decoded
        lengths = torch.tensor([len(v) for v in (reference or {}).values()] or [0], dtype=torch.float32)
    report = {"model": source, "device": args.device, "dtype": args.dtype, "kernels": args.kernels,
              "graphs": args.graphs, "workload": args.workload, "temperature": args.temperature,
              "requests": len(requests), "sequences": num_seqs,
              # the median (torch's median is the lower of the two middle values)
              "lengths_p50": _whole(statistics.median(lengths.flatten().tolist())), "lengths_max": int(lengths.max()),
              "threshold": args.threshold,
              "arms": list(bucket_arms[0]) if bucket_arms and len(set(bucket_arms)) == 1 else None,
              "buckets": list(buckets), "bucket_arms": [list(a) for a in bucket_arms] if bucket_arms else None,
              "clock": args.clock, "bandit": args.bandit, "results": results}
    if args.min_tokens:
        report["min_tokens"] = args.min_tokens
    if args.engine == "reuse":
        report["engine"] = "reuse"
    if args.hook_cost:
        report["hook_cost"] = {}
        for mode in (m for m in ran if m in ("ngram", "learned")):
            report["hook_cost"][mode] = _hook_cost(new_engine(mode), requests)
    if args.repeats > 1:
        report["repeats"] = args.repeats
        report["rounds"] = rounds
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report, args)
    if sampled:
        return 0
    return 0 if all(r["identical_to_first_mode"] for row in rounds for r in row) else 1
