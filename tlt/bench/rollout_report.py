"""`tlt bench rollout`'s figures: one run's result, medians over rounds, speed-ups and the table.

The per-mode measurements `rollout._run_mode` takes become result dicts here (fields documented in
rollout.py's module docstring); with `--repeats` the rounds are summarised by medians of per-round
ratios.
"""

from __future__ import annotations

import argparse
import statistics

# batch-size buckets of the per-step report: (smallest, largest or None, label)
BUCKETS = ((1, 1, "1"), (2, 4, "2-4"), (5, 16, "5-16"), (17, 63, "17-63"), (64, None, ">=64"))
SAMPLED_NOTE = "sampled (distribution: tests/test_lossless_sampling.py)"


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 1) if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _arm_summary(counts: dict[str, dict[str, int]]) -> dict:
    """Per-arm counts {name: {verify_steps, seq_steps, emitted}} -> the same plus choice share and accept
    length (emitted / seq_steps), most chosen first."""
    total = sum(a["verify_steps"] for a in counts.values())
    return {name: {**a, "share": round(a["verify_steps"] / total, 3) if total else 0.0,
                   "accept_len": round(a["emitted"] / a["seq_steps"], 2) if a["seq_steps"] else None}
            for name, a in sorted(counts.items(), key=lambda kv: -kv[1]["verify_steps"])}


def mode_result(mode: str, outs: dict, m: dict, spec: dict) -> dict:
    wall, tokens = m["wall"], sum(len(v) for v in outs.values())
    order = [label for _, _, label in BUCKETS]
    buckets = {label: {"tokens": t, "seconds": round(s, 6), "steps": n, "tok_per_s": _rate(t, s)}
               for label, (t, s, n) in sorted(m["buckets"].items(), key=lambda kv: order.index(kv[0]))}
    t4 = [m["buckets"][k] for k in ("1", "2-4") if k in m["buckets"]]
    arms = _arm_summary(spec.get("arms", {}))
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


def add_speedups(results: list[dict]) -> None:
    """Speed-ups over the first `off` result of `results` (one round), in place; none without off."""
    base = next((r for r in results if r.get("mode") == "off"), None)
    for r in results:
        if base is None or "wall_s" not in r:
            continue
        r["speedup_vs_off"] = round(base["wall_s"] / r["wall_s"], 2)
        # at T > 0 each mode decodes other samples (1-2% more or fewer tokens): an arm changes which draws a chain
        # accepts, and the adaptive bandit picks arms by measured speed, so a round's samples vary with it (a static
        # arm's are the same every round for seeded requests); the tokens/s ratio corrects the wall ratio for that
        r["tok_speedup_vs_off"] = _ratio(r["tok_per_s"], base["tok_per_s"])
        r["tail4_speedup"] = _ratio(r["tail4_tok_per_s"], base["tail4_tok_per_s"])
        for label, b in r["buckets"].items():
            b["speedup_vs_off"] = _ratio(b["tok_per_s"], base["buckets"].get(label, {}).get("tok_per_s"))


def _median(values: list, digits: int) -> float | None:
    """Median of the values that are not None (None if none), rounded like the field it summarizes."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    median = statistics.median(present)
    if all(isinstance(v, int) for v in present) and median == int(median):
        return int(median)  # counts stay ints unless the two middle runs of an even R differ
    return round(median, digits)


def _range(values: list) -> list | None:
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


# per-mode fields reported as the median over rounds, with their rounding (ints stay ints for odd R)
MEDIAN_FIELDS = {"wall_s": 3, "tokens": 1, "tok_per_s": 1, "tail_s": 3, "tail_share": 3, "tail_tok_per_s": 1,
                 "tail4_tok_per_s": 1, "steps": 1, "decode_steps": 1, "verify_steps": 1, "verified_seq_steps": 1,
                 "sd_step_share": 3, "gc_s": 3}
BUCKET_MEDIAN_FIELDS = {"tokens": 1, "seconds": 6, "steps": 1, "tok_per_s": 1}


def median_result(runs: list[dict], sampled: bool) -> dict:
    """One mode's R runs (one per round) as one result: medians, per-round speed-up medians and ranges, summed arms."""
    out: dict = {"mode": runs[0]["mode"]}
    for key, digits in MEDIAN_FIELDS.items():
        out[key] = _median([r[key] for r in runs], digits)
    buckets = {}
    for _, _, label in BUCKETS:
        present = [r["buckets"][label] for r in runs if label in r["buckets"]]
        if not present:
            continue
        b = {key: _median([x[key] for x in present], digits) for key, digits in BUCKET_MEDIAN_FIELDS.items()}
        b["runs"] = len(present)  # the runs in which this bucket occurred (the medians are over those)
        if "speedup_vs_off" in present[0]:
            ratios = [x["speedup_vs_off"] for x in present]
            b["speedup_vs_off"], b["speedup_vs_off_range"] = _median(ratios, 2), _range(ratios)
        buckets[label] = b
    out["buckets"] = buckets
    summed: dict[str, dict[str, int]] = {}
    for r in runs:
        for name, a in r["arms"].items():
            acc = summed.setdefault(name, {"verify_steps": 0, "seq_steps": 0, "emitted": 0})
            for key in acc:
                acc[key] += a[key]
    out["arms"] = _arm_summary(summed)
    # over verify steps, as each run's own figure: the bandit's "plain" arm (one token per sequence, no verify
    # pass) is an arm choice, not a verify step, and counting it pulled the accept length towards 1
    verified = [a for name, a in summed.items() if name != "plain"]
    seq_steps = sum(a["seq_steps"] for a in verified)
    out["mean_accept_len"] = (round(sum(a["emitted"] for a in verified) / seq_steps, 2) if seq_steps
                              else _median([r["mean_accept_len"] for r in runs], 2))
    out["identical_to_first_mode"] = None if sampled else all(r["identical_to_first_mode"] for r in runs)
    for key in ("speedup_vs_off", "tok_speedup_vs_off", "tail4_speedup"):
        if key in runs[0]:
            ratios = [r[key] for r in runs]
            out[key], out[key + "_range"] = _median(ratios, 2), _range(ratios)
    return out


def _x(value: float | None, span: list | None = None) -> str:
    """A speed-up cell: `1.52`, or `1.52 (1.40-1.61)` with the per-round range; `-` when there is none (a missing
    figure printed as a measured 0.00)."""
    if value is None:
        return "-"
    text = f"{value:.2f}"
    return f"{text} ({span[0]:.2f}-{span[1]:.2f})" if span else text


def _num(value: float | None, digits: int) -> str:
    """A figure, or `-` when none was measured."""
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(report: dict, args: argparse.Namespace) -> None:
    results = report["results"]
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    repeats = report.get("repeats", 1)
    print(f"model: {report['model']}; {report['sequences']} sequences ({report['requests']} requests, {sampling}), "
          f"response length p50 {report['lengths_p50']}, max {report['lengths_max']}; SD threshold {args.threshold}")
    wx, wb = (18, 18) if repeats > 1 else (9, 8)  # speed-up cells carry the per-round range with repeats
    if report.get("device", "cpu") != "cpu":
        print(f"engine on {report['device']} ({report['dtype']}, kernels {report['kernels']}, graphs {report['graphs']})")
    if report.get("clock") == "cpu":
        print("times are CPU seconds of this process (--clock cpu), not wall-clock seconds")
    if args.bandit == "keep":
        print("adaptive modes keep their bandit from round to round (--bandit keep; round 0 starts cold)")
    if repeats > 1:
        print(f"median of {repeats} interleaved rounds (speed-ups: median of per-round ratios over off, "
              f"(min-max) over rounds; arms: summed)")
    print(f"{'mode':<15}{'wall s':>8}{'tok/s':>8}{'speedup':>{wx}}{'tail s':>8}{'tail%':>7}{'tail tok/s':>12}"
          f"{'b<=4 x':>{wb}}{'verify':>8}{'SD%':>6}{'accept':>8}  lossless")
    ran = [r for r in results if "skipped" not in r]
    for r in results:
        if "skipped" in r:
            print(f"{r['mode']:<15} skipped: {r['skipped']}")
            continue
        same = r["identical_to_first_mode"]
        lossless = SAMPLED_NOTE if same is None else ("identical" if same else "DIFFERENT")
        print(f"{r['mode']:<15}{r['wall_s']:>8.2f}{r['tok_per_s']:>8.1f}"
              f"{_x(r.get('speedup_vs_off'), r.get('speedup_vs_off_range')):>{wx}}"
              f"{r['tail_s']:>8.2f}{100 * r['tail_share']:>6.0f}%{_num(r['tail_tok_per_s'], 1):>12}"
              f"{_x(r.get('tail4_speedup'), r.get('tail4_speedup_range')):>{wb}}{r['verify_steps']:>8}"
              f"{100 * r['sd_step_share']:>5.0f}%{_num(r['mean_accept_len'] if r['verify_steps'] else None, 2):>8}"
              f"  {lossless}")
    labels = [label for _, _, label in BUCKETS if any(label in r["buckets"] for r in ran)]
    if labels:
        print("tokens/s per batch-size bucket (x: over off's same bucket; JSON has tokens and seconds)")
        width = 27 if repeats > 1 else 18
        print(f"{'mode':<15}" + "".join(f"{'batch ' + label:>{width}}" for label in labels))
        for r in ran:
            cells = []
            for label in labels:
                b = r["buckets"].get(label)
                if b is None or b["tok_per_s"] is None:
                    cells.append(f"{'-':>{width}}")
                else:
                    span = b.get("speedup_vs_off_range")
                    x = "" if b.get("speedup_vs_off") is None else (
                        f" ({b['speedup_vs_off']:.2f}x, {span[0]:.2f}-{span[1]:.2f})" if span
                        else f" ({b['speedup_vs_off']:.2f}x)")
                    cells.append(f"{b['tok_per_s']:.1f}{x}".rjust(width))
            print(f"{r['mode']:<15}" + "".join(cells))
    if args.temperature != 0 and any(r.get("tok_speedup_vs_off") is not None for r in ran):
        print("sampled: each mode decodes other samples, so the speed-up by tokens/s (the same work per second) "
              "beside the wall-time one: " + ", ".join(
                  f"{r['mode']} {_x(r.get('tok_speedup_vs_off'), r.get('tok_speedup_vs_off_range'))}" for r in ran))
    for mode, h in report.get("hook_cost", {}).items():
        print(f"{mode}: SD hooks {h['hooks_us']:.2f} us per plain step at batch {h['batch']} (SD on: {h['sd_on']}), "
              f"forward {h['forward_ms']:.2f} ms: {100 * h['hooks_share']:.4f}% of the step (CPU time)")
    with_arms = [r for r in ran if r["arms"]]
    if with_arms:
        print("arms (verify steps chosen, share, accept length = tokens per sequence per verify step)")
        for r in with_arms:
            print(f"{r['mode']:<15}" + " | ".join(
                f"{name} {a['verify_steps']} ({100 * a['share']:.0f}%) acc {_num(a['accept_len'], 2)}"
                for name, a in r["arms"].items()))
