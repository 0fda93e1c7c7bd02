"""`tlt bench e2e`: end-to-end RL steps, TLT against the baseline, same seeds, data and steps.

    tlt bench e2e [--preset cpu-tiny] [--steps 12] [--noise-seed 1] [--pairs 1] [--out runs/bench-e2e]

    TLT       `tlt run --seed S`             speculative decoding as [rollout.spec] says (adaptive),
                                             online drafter when the rollout drafts with a learned one
    baseline  `tlt run --seed S --baseline`  the same system with speculation off and no drafter
    noise     `tlt run --seed S --baseline --set trainer.sampling_seed=S'`  the baseline again with
                                             another sampling seed: the same prompts in the same order, other samples

Each is the real `tlt run` command in a subprocess, one after the other (they
share the machine). Reported: mean step time of each (all steps, and without
the first step, which includes warm-up), the step-time ratio baseline / TLT,
the rollout-time ratio, `rollout_bound` (the baseline's rollout share of a step, the ratio ceiling
1 / (1 - share) that even an instant rollout could not pass, and the ratio the measured rollout times
alone would give: TLT only speeds up rollouts), the held-out accuracy curves (eval.jsonl, when the
preset evaluates), and the reward curves overlaid in reward.png. The
reward curves "agree" when TLT's mean absolute per-step reward difference from
the baseline is at most 1.5x that between the two baselines (a noise
estimate from one pair of runs, hence the margin); the difference of the run
means is reported beside it. The noise run keeps the trainer seed (the data set
and its order, as TLT and the baseline share them) and changes only the
sampling seed the trainer seeds its rollout requests from (`trainer.sampling_seed`;
unset, it is the trainer seed): with another trainer seed it drew other prompts every
step, and prompt difficulty inflated the "noise" the check compares with. The
rollout's own `[rollout.engine] seed` would not do: it seeds only requests that
come unseeded, and the trainer's never do.

`--pairs K` runs TLT and the baseline K times, in alternating order (tlt, baseline, baseline, tlt,
tlt, ...: a machine that drifts slower or faster over the bench favours neither), and reports each
pair's step-time and rollout-time ratios with their median and range, the pooled ratios and each
side's spread (slowest over fastest mean step: the same work timed again; `pairs` in the summary).
On a shared VM two runs of one configuration can differ by 14% in step time (BENCHMARKS.md, "End
to end, Session 6"), on an H200 host by 45% (session 32), so one pair cannot resolve a ratio much
closer to 1 than that. The names of
pair k > 1 end in `-k`; `step_time_ratio` and the table's first rows stay pair 1's.
"""

from __future__ import annotations

import argparse

from tlt.cli_args import at_least, non_empty, out_folder


SKIP_NOISE = -1  # --noise-seed value that skips the repeated baseline run


def noise_seed(text: str) -> int:
    """argparse `type` of `--noise-seed`: a seed >= 0, or -1 to skip the noise run (any negative value skipped it:
    a mistyped seed silently dropped the noise estimate)."""
    try:
        return at_least(SKIP_NOISE)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a seed >= 0, or -1 to skip the noise run; got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="cpu-tiny", help="config preset name or .toml path")
    parser.add_argument("--steps", type=at_least(1), default=12, help="RL steps per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the TLT and baseline runs")
    parser.add_argument("--noise-seed", type=noise_seed, default=1,
                        help="sampling seed (trainer.sampling_seed) of the repeated baseline, which keeps --seed's "
                             "prompts (-1: skip it)")
    parser.add_argument("--pairs", type=at_least(1), default=1,
                        help="TLT / baseline pairs, in alternating order; the ratio's median and range over them")
    parser.add_argument("--model", type=non_empty, default=None, help="policy checkpoint folder (default: [run] model_dir)")
    parser.add_argument("--out", type=out_folder, default="runs/bench-e2e", help="folder for the three run folders and the results")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="passed to every `tlt run` (e.g. trainer.max_tokens=64); repeatable")


def _run(name: str, out, args: argparse.Namespace, seed: int, baseline: bool,  # noqa: ANN001
         extra: tuple[str, ...] = ()) -> int:
    import subprocess

    from tlt.cli import tlt_command
    from tlt.services.common.logging import get_logger

    cmd = tlt_command("run", "--quiet", "--preset", args.preset, "--steps", str(args.steps),
                      "--seed", str(seed), "--run-id", name, "--set", f"run.runs_dir={out}")
    if args.model:
        cmd += ["--model", args.model]
    if baseline:
        cmd.append("--baseline")
    for o in (*args.overrides, *extra):  # the run's own last: the noise run's sampling seed
        cmd += ["--set", o]
    get_logger("bench.e2e").info("bench_run", name=name, seed=seed, baseline=baseline, extra=list(extra))
    with (out / f"{name}.out").open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def planned_runs(seed: int, pairs: int, noise: int) -> dict[str, tuple[int, bool, tuple[str, ...]]]:
    """name -> (trainer --seed, --baseline, its own --set options), in run order. Every run has the same trainer
    seed (data set and order); the noise run changes only the seed its rollout requests are seeded from."""
    runs: dict[str, tuple[int, bool, tuple[str, ...]]] = {name: (seed, baseline, ()) for name, baseline in run_order(pairs)}
    if noise != SKIP_NOISE:
        runs["baseline-noise"] = (seed, True, (f"trainer.sampling_seed={noise}",))
    return runs


def _mean(xs: list[float]) -> float | None:
    """None for no values (`--steps 1` has no step after the first): not 0, which reads as a measurement."""
    return sum(xs) / len(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either was not measured or b is 0 (a 0.0 read as "infinitely slower")."""
    return a / b if a is not None and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else abs(a - b)


def _cell(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _drafter_cell(r: dict) -> str:
    """The table's "drafter trained" cell: micro-steps in how many windows, and the serving drafter's first and last
    versions ("-" for a run without a drafter service and no learned drafter)."""
    versions = [v for v in r["drafter_version"] if v >= 0]
    if not r["drafter_windows"] and not versions:
        return "-"
    served = f"v{versions[0]} -> v{versions[-1]}" if versions else "no drafter served"
    return f"{r['drafter_micro_steps']} micro-steps in {r['drafter_windows']} windows, {served}"


def pair_names(k: int) -> tuple[str, str]:
    """The TLT and baseline run names of pair k (1-based): "tlt" / "baseline", then "tlt-k" / "baseline-k"."""
    sfx = "" if k == 1 else f"-{k}"
    return f"tlt{sfx}", f"baseline{sfx}"


def run_order(pairs: int) -> list[tuple[str, bool]]:
    """(run name, baseline?) in the order they run: pair k is "tlt-k" / "baseline-k" ("tlt" / "baseline"
    for k = 1), TLT first in odd pairs and the baseline first in even ones."""
    if pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {pairs}")
    order: list[tuple[str, bool]] = []
    for k in range(1, pairs + 1):
        tlt, base = pair_names(k)
        pair = [(tlt, False), (base, True)]
        order += pair if k % 2 else pair[::-1]
    return order


def pair_ratios(results: dict[str, dict], pairs: int) -> dict:
    """Per pair: baseline / TLT mean step time and mean rollout time; with their median and range. Pooled: the
    baselines' summed mean steps over the TLT runs' (every run weighs the same). Spread: each side's slowest over
    fastest mean step, the same work timed again (on one H200 host the same baseline ran 2.40 s and 3.49 s a step:
    a ratio is worth no more than that spread)."""
    import statistics

    runs = [tuple(results[name] for name in pair_names(k)) for k in range(1, pairs + 1)]  # (tlt, baseline) each

    def side(key: str, baseline: bool) -> list:
        return [r[baseline][key] for r in runs]

    def ratios(key: str) -> list:
        return [_ratio(b, t) for t, b in zip(side(key, False), side(key, True))]

    def pooled(key: str) -> float | None:
        t, b = side(key, False), side(key, True)
        return None if None in t or None in b else _ratio(sum(b), sum(t))

    def spread(xs: list) -> float | None:
        return None if None in xs or not min(xs) else max(xs) / min(xs)

    def stats(key: str, name: str) -> dict:
        xs = ratios(key)
        known = [x for x in xs if x is not None]
        return {f"{name}_ratios": xs, f"{name}_ratio_median": statistics.median(known) if known else None,
                f"{name}_ratio_range": [min(known), max(known)] if known else None, f"{name}_ratio_pooled": pooled(key)}

    return {**stats("mean_step_s", "step_time"), **stats("mean_rollout_s", "rollout_time"),
            "baseline_step_spread": spread(side("mean_step_s", True)),
            "tlt_step_spread": spread(side("mean_step_s", False))}


def rollout_bound(t: dict, b: dict) -> dict:
    """What the rollout alone can explain of the step-time ratio (Amdahl's law on the measured means).

    rollout_share: the baseline's rollout time over its step time. step_ratio_ceiling: the ratio if TLT's
    rollout took no time at all and nothing else changed, 1 / (1 - share): the most any rollout speed-up can
    give on this preset (TLT attacks only the rollout). step_ratio_from_rollout: the ratio if TLT's steps
    differed from the baseline's only by the measured rollout times; the measured ratio falls short of it by
    what TLT costs outside the rollout (the drafter service's share of the cores, for one).
    """
    step_b, roll_b, roll_t = b["mean_step_s"], b["mean_rollout_s"], t["mean_rollout_s"]
    if not step_b or roll_b is None or roll_t is None:
        return {"rollout_share": None, "step_ratio_ceiling": None, "step_ratio_from_rollout": None}
    rest = step_b - roll_b  # None, not infinity, where it is 0: results.json stays strict JSON
    return {"rollout_share": roll_b / step_b, "step_ratio_ceiling": _ratio(step_b, rest if rest > 0 else None),
            "step_ratio_from_rollout": _ratio(step_b, rest + roll_t if rest + roll_t > 0 else None)}


def run(args: argparse.Namespace) -> int:
    import json
    import shutil
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tlt.services.common.logging import get_logger
    from tlt.services.trainer.evaluate import read_evals
    from tlt.services.trainer.run_stats import read_windows, step_rows

    log = get_logger("bench.e2e")
    out = Path(args.out)
    runs = planned_runs(args.seed, args.pairs, args.noise_seed)
    # each run starts afresh: its old folder is deleted below, so only ever a run folder (`--out .` in the
    # repository named ./tlt, the package)
    from tlt.services.common.config import ConfigError, preset_path

    preset_path(args.preset)  # an unknown preset: ConfigError now, not in the first run's log
    taken = [str(out / n) for n in runs if (out / n).exists() and not (out / n / "run.json").is_file()]
    if taken:
        raise ConfigError(f"--out {args.out}: {', '.join(taken)} is not a run folder (no run.json), and the bench "
                          "deletes each run's old folder before it starts; give another --out (e.g. runs/bench-e2e)")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (seed, baseline, extra) in runs.items():
        if (out / name).exists():
            shutil.rmtree(out / name)  # a fresh run each time (an existing folder would be resumed)
        rc = _run(name, out, args, seed, baseline, extra)
        if rc != 0:
            log.error("bench_run_failed", name=name, rc=rc, log=str(out / f"{name}.out"))
            return rc
        rows = step_rows(out / name, 32)
        info = json.loads((out / name / "run.json").read_text())
        evals = read_evals(out / name / "eval.jsonl")
        windows = read_windows(out / name / "drafter.jsonl")
        results[name] = {
            "eval_after_steps": [e.after_steps for e in evals], "eval_accuracy": [e.accuracy for e in evals],
            # the evals' greedy pass ([trainer] eval_greedy), None where an eval had none
            "eval_greedy_accuracy": [e.greedy_accuracy for e in evals],
            "seed": seed, "sampling_seed": int(extra[0].split("=")[1]) if extra else None,
            "switches": info["switches"], "steps": len(rows),
            "step_s": [r.step_s for r in rows], "rollout_s": [r.rollout_s for r in rows],
            "reward": [r.reward for r in rows], "accuracy": [r.accuracy for r in rows],
            "sd_share": [r.sd_share for r in rows], "accept_len": [r.accept_len for r in rows],
            "mean_step_s": _mean([r.step_s for r in rows]), "mean_step_s_after_first": _mean([r.step_s for r in rows[1:]]),
            "mean_rollout_s": _mean([r.rollout_s for r in rows]), "mean_reward": _mean([r.reward for r in rows]),
            # what the online drafter did: the serving drafter's version per step (-1: none), its training windows
            # (session 37's GPU runs trained 0-1 micro-steps in 6 steps, unseen until drafter.jsonl was read by hand)
            "drafter_version": [r.drafter_version for r in rows],
            "drafter_windows": len(windows), "drafter_micro_steps": sum(w.micro_steps for w in windows),
        }
    t, b = results["tlt"], results["baseline"]
    summary = {
        "steps": args.steps, "preset": args.preset, "overrides": args.overrides,
        "tlt_switches": t["switches"],
        "step_time_ratio": _ratio(b["mean_step_s"], t["mean_step_s"]),
        "step_time_ratio_after_first": _ratio(b["mean_step_s_after_first"], t["mean_step_s_after_first"]),
        "rollout_time_ratio": _ratio(b["mean_rollout_s"], t["mean_rollout_s"]),
        "reward_diff_tlt_vs_baseline": _diff(t["mean_reward"], b["mean_reward"]),
        "rollout_bound": rollout_bound(t, b),  # what the rollout alone can explain of the ratio (pair 1)
        "reward_step_mad_tlt_vs_baseline": _mean([abs(x - y) for x, y in zip(t["reward"], b["reward"])]),
    }
    if args.pairs > 1:
        summary["pairs"] = pair_ratios(results, args.pairs)
    if "baseline-noise" in results:
        n = results["baseline-noise"]
        summary["reward_diff_noise"] = _diff(n["mean_reward"], b["mean_reward"])
        summary["reward_step_mad_noise"] = _mean([abs(x - y) for x, y in zip(n["reward"], b["reward"])])
        mad, noise = summary["reward_step_mad_tlt_vs_baseline"], summary["reward_step_mad_noise"]
        summary["rewards_agree"] = None if mad is None or noise is None else mad <= 1.5 * noise

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, r in results.items():
        line = ax.plot(range(len(r["reward"])), r["reward"], "o-" if name == "tlt" else "s--", alpha=0.5, ms=3,
                       label=f"{name} (seed {r['seed']}, mean step {_cell(r['mean_step_s'], '.1f')} s)")[0]
        if r["eval_accuracy"]:
            ax.plot([k - 0.5 for k in r["eval_after_steps"]], r["eval_accuracy"], "D-", lw=2, color=line.get_color(),
                    label=f"{name}: held-out accuracy")
        greedy = [(k, g) for k, g in zip(r["eval_after_steps"], r["eval_greedy_accuracy"]) if g is not None]
        if greedy:
            ax.plot([k - 0.5 for k, _ in greedy], [g for _, g in greedy], "^:", lw=2, color=line.get_color(),
                    label=f"{name}: held-out greedy")
    ax.set_xlabel("step"), ax.set_ylabel("mean reward / accuracy"), ax.set_title("Reward per step: TLT vs baseline")
    ax.legend(fontsize=8)
    fig.tight_layout(), fig.savefig(out / "reward.png", dpi=90), plt.close(fig)
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": results}, indent=2))
    print(json.dumps(summary, indent=2))
    print("| run | seed | SD | drafter | drafter trained | mean step s | w/o first | mean rollout s | mean reward | "
          "held-out accuracy |\n|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        held = " -> ".join(f"{a:.3f}" for a in r["eval_accuracy"]) or "-"
        greedy = [g for g in r["eval_greedy_accuracy"] if g is not None]
        if greedy:
            held += " (greedy " + " -> ".join(f"{g:.3f}" for g in greedy) + ")"
        print(f"| {name} | {r['seed']} | {'on' if r['switches']['speculation'] else 'off'} | "
              f"{'on' if r['switches']['drafter'] else 'off'} | {_drafter_cell(r)} | {_cell(r['mean_step_s'], '.2f')} | "
              f"{_cell(r['mean_step_s_after_first'], '.2f')} | {_cell(r['mean_rollout_s'], '.2f')} | "
              f"{_cell(r['mean_reward'], '.3f')} | {held} |")
    log.info("bench_done", out=str(out), plot=str(out / "reward.png"))
    return 0
