"""report.html of a run: the per-step table and its plots (PNG, matplotlib Agg), from the run's files.

    runs/<id>/{metrics,timeline,drafter}.jsonl -> StepRow per step (run_stats.py)
    runs/<id>/eval.jsonl                     -> held-out accuracy after 0, k, 2k, ... steps (evaluate.py)
      -> plots/step_time.png   stacked step-time parts per step (rollout split into tail / rest)
         plots/reward.png      mean reward and accuracy per step, held-out accuracy at each eval (and its
                               greedy accuracy, when the run scored it: eval_greedy)
         plots/heldout.png     each eval's held-out accuracy minus the first's, paired by problem, 95% intervals
                               (evals that kept per-problem counts)
         plots/timeline.png    running batch over time, SD on shaded, drafter idle windows, step starts,
                               held-out evals
         plots/accept.png      acceptance length and SD share per step
    runs/<id>/rollout_status.json            -> the rollout's speculation at the end: per replica the steps and
                                                accept length of each arm, the bandit's choices per bucket
      -> report.html           summary (held-out and rollout accuracy at start and end, mean step time),
                               the table, the plots, the speculation tables; a warning when policy/ holds
                               an older step than checkpoints/latest (its tlt_export.json; also on stderr)

Regenerate any time with `python -m tlt.services.trainer.report runs/<id>`.
"""

from __future__ import annotations

import html
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tlt.services.trainer.evaluate import EvalRecord, change, read_evals
from tlt.services.trainer.run_stats import (
    HEADER,
    IdleWindow,
    StepRow,
    TimelineSample,
    format_row,
    read_jsonl,
    read_timeline,
    read_windows,
    step_row,
)

if TYPE_CHECKING:
    from tlt.model.evaluate import PairedDifference


@dataclass(frozen=True)
class Summary:
    steps: int
    acc_start: float  # mean accuracy of the first k steps
    acc_end: float  # ... and of the last k steps
    reward_start: float
    reward_end: float
    k: int
    mean_step_s: float
    total_s: float


def summarize(rows: list[StepRow]) -> Summary:
    if not rows:
        return Summary(0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0)
    k = max(1, min(5, len(rows) // 4))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return Summary(len(rows), mean([r.accuracy for r in rows[:k]]), mean([r.accuracy for r in rows[-k:]]),
                   mean([r.reward for r in rows[:k]]), mean([r.reward for r in rows[-k:]]), k,
                   mean([r.step_s for r in rows]), sum(r.step_s for r in rows))


# No sample for this long: nothing was sampled (a resumed run's launcher was down, or the rollout did
# not answer), so the timeline plot holds no value across it. Polls of a loaded 2-core machine were
# measured up to 7 s apart (a status call times out after 5 s).
GAP_S = 30.0


def _held(ts: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Step-plot points where each sample holds until the next one, but not across a gap of GAP_S."""
    xs, out = [], []
    for i, (t, y) in enumerate(zip(ts, ys)):
        xs.append(t)
        out.append(y)
        if i + 1 < len(ts) and ts[i + 1] - t > GAP_S:  # the line stops here and starts again at the next sample
            xs.append(t)
            out.append(math.nan)
    return xs, out


def _unit_span(values: list[float]) -> tuple[float, float]:
    """y limits for accuracy (0..1) that also hold every finite reward: a user's reward may be -1 or 2."""
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = min([0.0, *finite]), max([1.0, *finite])
    pad = 0.02 * (hi - lo)
    return lo - pad, hi + pad


def _plots(rows: list[StepRow], samples: list[TimelineSample], windows: list[IdleWindow], out: Path,
           threshold: int, evals: list[EvalRecord] = ()) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    steps = [r.step for r in rows]
    made = []

    fig, ax = plt.subplots(figsize=(9, 4))
    parts = [("rollout (tail)", [r.tail_s for r in rows]), ("rollout (rest)", [max(0.0, r.rollout_s - r.tail_s) for r in rows]),
             ("reward wait", [r.reward_s for r in rows]), ("old logprobs", [r.logprobs_s for r in rows]),
             ("update", [r.update_s for r in rows]), ("weight push", [r.push_s for r in rows])]
    if any(r.lend_s for r in rows):  # colocated: the devices borrowed from the rollout and given back
        parts.append(("device lend", [r.lend_s for r in rows]))
    bottom = [0.0] * len(rows)
    for label, vals in parts:
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(steps, [r.step_s for r in rows], "k.", label="step total")
    ax.set_xlabel("step"), ax.set_ylabel("seconds"), ax.set_title("Step time breakdown")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout(), fig.savefig(out / "step_time.png", dpi=90), plt.close(fig)
    made.append(("step_time.png", "Step time and its parts (tail = rollout time with every replica's running batch "
                                  f"<= {threshold})"))

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(steps, [r.reward for r in rows], "o-", label="mean reward")
    ax.plot(steps, [r.accuracy for r in rows], "s--", label="accuracy (the step's rollout)")
    if evals:
        # eval after k steps sits between step k-1 and step k (before step 0 for k = 0)
        first, greedy = evals[0], _greedy_evals(evals)
        label = f"held-out accuracy ({first.problems} problems x {first.samples}, T={first.temperature:g})"
        if greedy:  # two held-out curves: the legend says which is which
            label = f"held-out, sampled ({first.problems} problems, T = {first.temperature:g}, {first.samples} per problem)"
        ax.plot([e.after_steps - 0.5 for e in evals], [e.accuracy for e in evals], "D-", color="black", lw=2,
                label=label)
        if greedy:
            ax.plot([e.after_steps - 0.5 for e in greedy], [e.greedy_accuracy for e in greedy], "^-", color="tab:red",
                    lw=2, label="held-out, greedy")
    ax.set_xlabel("step"), ax.set_ylim(*_unit_span([r.reward for r in rows])), ax.legend()
    ax.set_title("Reward and accuracy per step")
    fig.tight_layout(), fig.savefig(out / "reward.png", dpi=90), plt.close(fig)
    made.append(("reward.png", "Mean reward and accuracy of each step's rollout (its prompts differ step to step); "
                               "held-out accuracy on one fixed problem set"))

    changes = [(e.after_steps, d) for e in evals[1:] if (d := change(evals[0], e))]  # paired with the first eval
    if changes:
        made.append(_change_plot(plt, evals[0], changes, out))

    if samples:
        t0 = samples[0].t
        fig, ax = plt.subplots(figsize=(11, 4))
        ts = [s.t - t0 for s in samples]
        several = max(len(s.running) for s in samples) > 1  # the threshold is each replica's: the busiest is drawn
        xs, ys = _held(ts, [float(s.max_running) for s in samples])
        ax.step(xs, ys, where="post", lw=0.8, label="running batch (busiest replica)" if several else "running batch")
        ymax = max(1, threshold, max(s.max_running for s in samples))  # what is drawn (the queue is not)
        on = [any(s.sd) and s.total_running > 0 for s in samples]  # a replica's flag holds its last step's state
        for a, b, flag in zip(ts, ts[1:], on):
            if flag and b - a <= GAP_S:
                ax.axvspan(a, b, color="tab:green", alpha=0.25, lw=0)
        for w in windows:
            if w.micro_steps > 0:  # as the table's idle column: a window preempted before its first step used nothing
                ax.axvspan(w.start - t0, w.end - t0, ymin=0.9, ymax=1.0, color="tab:purple", alpha=0.6, lw=0)
        for r in rows:
            if r.started_at:
                ax.axvline(r.started_at - t0, color="grey", lw=0.5, ls=":")
        timed = [e for e in evals if e.started_at]  # eval.jsonl lines from before started_at was kept: not drawn
        for e in timed:  # the rollout serves the eval set between steps: not a step's rollout
            ax.axvspan(e.started_at - t0, e.started_at - t0 + e.seconds, color="grey", alpha=0.15, lw=0,
                       gid="held-out eval")
        # the tail threshold (the report's --threshold; the SD threshold unless [run] tail_threshold): the green
        # shading is where the rollout really speculated
        ax.axhline(threshold, color="tab:red", lw=0.7, ls="--", label=f"tail threshold {threshold}")
        ax.set_ylim(0, ymax * 1.15)
        ax.plot([], [], color="tab:green", alpha=0.4, lw=6, label="SD on")
        ax.plot([], [], color="tab:purple", alpha=0.6, lw=6, label="drafter idle window")
        if timed:
            ax.plot([], [], color="grey", alpha=0.3, lw=6, label="held-out eval")
        ax.set_xlabel("seconds since the first sample (dotted: step starts)"), ax.set_ylabel("sequences")
        ax.set_title("Running batch over time"), ax.legend(fontsize=8, loc="upper right")
        fig.tight_layout(), fig.savefig(out / "timeline.png", dpi=90), plt.close(fig)
        made.append(("timeline.png", "Rollout running batch (sampled), speculative decoding on/off, drafter training windows, held-out evals (grey)"))

    fig, ax = plt.subplots(figsize=(9, 4))
    # no verify pass: acceptance length is undefined (the table's "-"), a gap rather than a 0
    ax.plot(steps, [r.accept_len or math.nan for r in rows], "o-", label="acceptance length (tokens / verify)")
    ax.set_xlabel("step"), ax.set_ylabel("tokens per verify pass")
    ax2 = ax.twinx()
    ax2.plot(steps, [100 * r.sd_share for r in rows], "s--", color="tab:orange", label="SD share of tokens (%)")
    ax2.set_ylabel("% of response tokens from verify passes"), ax2.set_ylim(0, 100)
    dv = [r.drafter_version for r in rows]
    if any(v >= 0 for v in dv):
        for r in (r for r in rows if r.accept_len):
            ax.annotate(f"d{r.drafter_version}", (r.step, r.accept_len), fontsize=7, textcoords="offset points", xytext=(0, 5))
    ax.set_title("Speculative decoding per step (labels: drafter version)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8)
    fig.tight_layout(), fig.savefig(out / "accept.png", dpi=90), plt.close(fig)
    made.append(("accept.png", "Acceptance length and the share of tokens produced by speculative verify passes"))
    return made


def _change_plot(plt, first: EvalRecord, changes: list[tuple[int, dict[str, PairedDifference]]],  # noqa: ANN001
                 out: Path) -> tuple[str, str]:
    """heldout.png: each eval's accuracy minus the first eval's (`change`, by steps done), in points, paired by
    problem (the evals score the same problems with the same random numbers), with 95% intervals; 0 is "no change"."""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for name, color, marker, dx in (("sampled", "black", "D", -0.15), ("greedy", "tab:red", "^", 0.15)):
        points = [(k, by_name[name]) for k, by_name in changes if name in by_name]
        if not points:
            continue
        xs = [first.after_steps - 0.5 + dx] + [k - 0.5 + dx for k, _ in points]
        ys = [0.0] + [100 * d.mean for _, d in points]
        err = [0.0] + [100 * 1.96 * d.se for _, d in points]
        label = (f"sampled (T = {first.temperature:g}, {first.samples} per problem)"
                 if name == "sampled" and first.temperature > 0 else "greedy")
        ax.errorbar(xs, ys, yerr=err, fmt=f"{marker}-", color=color, capsize=3, lw=1.5, label=label)
    ax.axhline(0.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step"), ax.set_ylabel("points since the first eval")
    ax.set_title(f"Held-out accuracy change, paired by problem ({first.problems} problems; bars: 95% intervals)")
    ax.legend(fontsize=8)
    fig.tight_layout(), fig.savefig(out / "heldout.png", dpi=90), plt.close(fig)
    return ("heldout.png", "Held-out accuracy minus the first eval's, paired by problem (the evals share problems and "
                           "random numbers, so most of the noise cancels): an interval above 0 is a rise beyond noise")


def _trainer_config(run_dir: Path) -> dict:
    """[trainer] of the run's resolved config.toml; {} when it cannot be read."""
    import tomllib

    try:
        trainer = tomllib.loads((run_dir / "config.toml").read_text()).get("trainer", {})
    except (OSError, ValueError):
        return {}
    return trainer if isinstance(trainer, dict) else {}


def _configured_eval_problems(run_dir: Path) -> int | None:
    """[trainer] eval_problems of the run's resolved config.toml; None when it cannot be read."""
    value = _trainer_config(run_dir).get("eval_problems")
    return value if isinstance(value, int) else None


# `tlt model eval --against` at these sizes: 4,000 sampled completions per policy, ~0.6 points of paired s.e. on the
# tiny model against ~1.2 for 800 in-run and ~1 for cpu-tiny's 1,600 (BENCHMARKS.md, "End to end", Session 40),
# ~2.5 min on 2 cores
SHARPER_CHECK_PROBLEMS, SHARPER_CHECK_SAMPLES = 500, 8


def sharper_check(run_dir: Path, evals: list[EvalRecord]) -> str | None:
    """The command of a paired check sharper than the run's own evals, when the last eval's sampled change since the
    first is within its own noise (its 95% interval holds 0) and such a check exists: the run scored the synthetic
    held-out draw at temperature 1 (`tlt model eval` samples no other data, at no other temperature) and saved its
    policy. None otherwise. Its completions run to `tlt model eval`'s own length limit (7 tokens per reasoning step),
    not [trainer] max_tokens: its accuracies differ a little from the run's, and its paired change is its own."""
    if len(evals) < 2 or evals[0].temperature != 1.0:
        return None
    d = change(evals[0], evals[-1]).get("sampled")
    if d is None or not d.ci95[0] <= 0.0 <= d.ci95[1] or not (run_dir / "policy").is_dir():
        return None
    trainer = _trainer_config(run_dir)  # read only for a run that needs the check
    start = trainer.get("model_dir")
    if trainer.get("eval_data_path") or not isinstance(start, str):
        return None
    import shlex

    return (f"tlt model eval --model {shlex.quote(str(run_dir / 'policy'))} --against {shlex.quote(start)} "
            f"--n {SHARPER_CHECK_PROBLEMS} --samples {SHARPER_CHECK_SAMPLES}")


def _eval_line(evals: list[EvalRecord], eval_problems: int | None = None, check: str | None = None) -> str:
    if not evals:
        if eval_problems == 0:
            return "<p>No held-out eval in this run ([trainer] eval_problems = 0).</p>"
        return "<p>No held-out eval recorded (eval.jsonl is missing or empty: the run stopped before its first).</p>"
    first, last = evals[0], evals[-1]
    curve = ", ".join(f"{e.after_steps}: {e.accuracy:.3f}" for e in evals)
    line = (f"<p>Held-out accuracy ({first.problems} problems x {first.samples} samples, temperature "
            f"{first.temperature:g}): <b>{first.accuracy:.3f}</b> after {first.after_steps} steps &rarr; "
            f"<b>{last.accuracy:.3f}</b> after {last.after_steps} steps{_paired(first, last, 'sampled')} "
            f"(every eval: {curve})")
    greedy = _greedy_evals(evals)
    if greedy:
        g0, g1 = greedy[0], greedy[-1]
        curve = ", ".join(f"{e.after_steps}: {e.greedy_accuracy:.3f}" for e in greedy)
        line += (f";\ngreedy (one completion per problem): <b>{g0.greedy_accuracy:.3f}</b> after {g0.after_steps} "
                 f"steps &rarr; <b>{g1.greedy_accuracy:.3f}</b> after {g1.after_steps} steps"
                 f"{_paired(g0, g1, 'greedy')} (every eval: {curve})")
    line += ".</p>"
    d = change(first, last).get("sampled") if check else None  # `check` is given only when there is one
    if d is not None:
        line += (f"\n<p>The sampled change is within this eval's noise: with {first.problems * first.samples} sampled "
                 f"completions an eval cannot tell a change under about {100 * 1.96 * d.se:.1f} points from none. A "
                 f"sharper paired check of the trained policy against the start "
                 f"({SHARPER_CHECK_PROBLEMS * SHARPER_CHECK_SAMPLES} sampled completions each): "
                 f"<code>{html.escape(check)}</code>.</p>")
    return line


def _paired(first: EvalRecord, last: EvalRecord, name: str) -> str:
    """', a change of +1.2 points (paired s.e. 0.8; 95% -0.4 .. +2.8)' when both records hold per-problem counts."""
    d = change(first, last).get(name)
    if d is None:
        return ""
    lo, hi = d.ci95
    return (f", a change of <b>{100 * d.mean:+.1f} points</b> (paired s.e. {100 * d.se:.1f}; 95% {100 * lo:+.1f} .. "
            f"{100 * hi:+.1f})")


def _greedy_evals(evals: list[EvalRecord]) -> list[EvalRecord]:
    """The evals that scored greedy in a pass of their own (eval_greedy at a temperature > 0): at T = 0 the sampled
    accuracy is the greedy one, shown once; records from before eval_greedy (or with it off) have none."""
    return [e for e in evals if e.greedy_accuracy is not None and e.temperature > 0]


def _rollout_line(s: Summary) -> str:
    if not s.steps:
        return "<p>No step finished, so no rollout accuracy or reward.</p>"
    k = f"the first {s.k} steps" if s.k > 1 else "the first step"
    last = f"the last {s.k} steps" if s.k > 1 else "the last step"
    return (f"<p>Rollout accuracy: <b>{s.acc_start:.3f}</b> (mean of {k}) &rarr; <b>{s.acc_end:.3f}</b> ({last});\n"
            f"mean reward {s.reward_start:.3f} &rarr; {s.reward_end:.3f}.</p>")


def _median_cell(arm: dict) -> str:
    """An arm's median reward, or "-" where it has none at the bucket's latest batch size: the gRPC status carries
    that as 0 (proto3 has no None), and a reward, tokens per second of a step that emitted at least one, never is."""
    median = float(arm.get("median_reward", 0.0))
    return f"{median:.0f}" if median > 0 else "-"


def _spec_section(run_dir: Path) -> str:
    """The rollout's speculation as its last status had it (rollout_status.json, written by `tlt run` at the end;
    protobuf's JSON mapping: int64 counts come as strings, absent lists as nothing): "" without the file."""
    path = run_dir / "rollout_status.json"
    if not path.exists():
        return ""
    try:
        status = json.loads(path.read_text())
        replicas, since = status.get("replicas", []), int(status.get("since_step", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return "<h2>Speculative decoding</h2><p>rollout_status.json could not be read.</p>"
    esc = html.escape
    parts = ["<h2>Speculative decoding at the end of the run</h2>"]
    if since:  # a resumed run's last launch: its rollout server started counting then
        parts.append(f"<p>As the last launch's rollout server counted them: steps {since + 1} on (the run was resumed "
                     f"after step {since}, and a rollout server starts its counts over).</p>")
    for r in replicas:
        spec = r.get("spec") or {}
        if spec.get("mode", "off") == "off":
            continue
        parts.append(f"<p>replica {int(r.get('replica_id', 0))}: mode <code>{esc(str(spec.get('mode')))}</code>, "
                     f"{int(spec.get('verify_steps', 0))} verify steps, {int(spec.get('plain_steps', 0))} plain steps, "
                     f"mean accept length {float(spec.get('mean_accept_len', 0.0)):.2f}, "
                     f"{int(spec.get('switches', 0))} switches, {int(spec.get('no_room', 0))} steps without room for "
                     f"drafts, {int(spec.get('over_budget', 0))} over the verify budget.</p>")
        arms = "".join(f"<tr><td>{esc(a.get('arm', ''))}</td><td>{int(a.get('steps', 0))}</td>"
                       f"<td>{float(a.get('accept_len', 0.0)):.2f}</td></tr>" for a in spec.get("arms", []))
        if arms:
            parts.append(f"<table><tr><th>arm</th><th>steps</th><th>accept length</th></tr>{arms}</table>")
        rows = "".join(f"<tr><td>{esc(b.get('bucket', ''))}</td><td>{int(b.get('explored', 0))}</td>"
                       f"<td>{int(b.get('exploited', 0))}</td><td>{esc(a.get('arm', ''))}</td>"
                       f"<td>{int(a.get('chosen', 0))}</td><td>{int(a.get('samples', 0))}</td>"
                       f"<td>{_median_cell(a)}</td></tr>"
                       for b in spec.get("bandit", []) for a in b.get("arms", []))
        if rows:
            parts.append("<p>The bandit per batch-size bucket (median reward: tokens/s at the bucket's latest batch "
                         "size; -: the arm has no reward at that size yet):</p><table><tr><th>bucket</th><th>explored</th><th>exploited</th><th>arm</th>"
                         f"<th>chosen</th><th>rewards held</th><th>median reward</th></tr>{rows}</table>")
    return "\n".join(parts) if len(parts) > (2 if since else 1) else ""


def _config_threshold(run_dir: Path) -> int:
    """The tail threshold `tlt run` used when run.json cannot say: the SD threshold of the run's config.toml
    ([run] tail_threshold is folded into run.json only), else 32."""
    import tomllib

    try:
        spec = tomllib.loads((run_dir / "config.toml").read_text()).get("rollout", {}).get("spec", {})
        return int(spec.get("threshold", 32)) if spec.get("mode", "adaptive") != "off" else 32
    except (OSError, ValueError, TypeError, AttributeError):
        return 32


def _run_file(run_dir: Path) -> dict:
    """The run's run.json; {} when there is none, or (said in a warning) when it cannot be read: the report is still
    written from the run's metrics (a damaged run.json ended `tlt report` in a traceback)."""
    if not (run_dir / "run.json").exists():
        return {}
    from tlt.services.common.logging import get_logger
    from tlt.services.trainer.procs import ServiceError
    from tlt.services.trainer.run_folder import read_run_file

    try:
        return read_run_file(run_dir)
    except ServiceError as e:
        get_logger("report").warning("run_file_unreadable", error=str(e).split("; ")[0],
                                     using="the tail threshold of config.toml unless --threshold; preset and "
                                           "switches unknown")
        return {}


def _export_line(run_dir: Path) -> str:
    """A warning when policy/ is not the latest checkpoint's policy (run_folder.stale_export); "" when it is."""
    from tlt.services.trainer.run_folder import stale_export

    why = stale_export(run_dir)
    return f'<p style="color:#b00"><b>Export out of date:</b> {html.escape(why)}</p>' if why else ""


def _drafter_line(run_dir: Path) -> str:
    """Where the run's online drafter went (drafter/export.py's export_run_drafter); "" when it wrote none."""
    from tlt.services.drafter.export import RUN_DRAFTER
    from tlt.services.trainer.run_folder import export_record

    record = export_record(run_dir / RUN_DRAFTER)
    if record is None:
        return ""
    after, version = record.get("policy_steps_done"), record.get("drafter_version", "?")
    first = "; the drafter the run started with: no trained one passed the acceptance gate" if version == 0 else ""
    return (f"<p>Online drafter: <code>{RUN_DRAFTER}/</code> holds the drafter the rollout served last (version "
            f"{html.escape(str(version))}{first}), for the policy in <code>policy/</code>"
            f"{'' if after is None else f' (after {html.escape(str(after))} steps)'}: <code>tlt rollout serve --model "
            f"{html.escape(str(run_dir / 'policy'))} --drafter {html.escape(str(run_dir / RUN_DRAFTER))}</code>"
            ".</p>")


def write_report(run_dir: str | Path, threshold: int | None = None) -> Path:
    """threshold: the tail threshold; None: the run's own (run.json, as `tlt run` wrote the report), else 32."""
    run_dir = Path(run_dir)
    info = _run_file(run_dir)
    if threshold is None:
        threshold = int(info.get("tail_threshold") or _config_threshold(run_dir))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    samples = read_timeline(run_dir / "timeline.jsonl")
    windows = read_windows(run_dir / "drafter.jsonl")
    rows = [step_row(m, samples, windows, threshold) for m in metrics]
    evals = read_evals(run_dir / "eval.jsonl")
    plots = _plots(rows, samples, windows, run_dir / "plots", threshold, evals) if rows else []
    s = summarize(rows)
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in format_row(r)) + "</tr>" for r in rows)
    figs = "".join(f'<figure><img src="plots/{name}" alt="{esc(cap)}"><figcaption>{esc(cap)}</figcaption></figure>'
                   for name, cap in plots)
    switches = info.get("switches")

    def switch(name: str) -> str:
        return "unknown (no run.json)" if switches is None else "on" if switches.get(name) else "off"

    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>TLT run {esc(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}figure{{margin:1em 0}}img{{max-width:100%}}</style>
</head><body><h1>TLT run <code>{esc(run_dir.name)}</code></h1>
<p>preset <code>{esc(str(info.get('preset', '?')))}</code>, speculative decoding <b>{switch('speculation')}</b>,
online drafter <b>{switch('drafter')}</b>, {s.steps} steps,
mean step {s.mean_step_s:.1f} s, total {s.total_s:.0f} s.</p>
{_eval_line(evals, _configured_eval_problems(run_dir), sharper_check(run_dir, evals))}
{_rollout_line(s)}
{_export_line(run_dir)}
{_drafter_line(run_dir)}
{figs}
<h2>Per step</h2><p>times in seconds; tail = rollout time with every replica's running batch at most {threshold},
something running (sampled);
reward = reward wait after the last completion (scoring overlaps the rollout); SD% = response tokens from
speculative verify passes; accept = tokens per verify pass; idle = drafter training windows during the step.</p>
<table><tr>{head}</tr>{body}</table>
{_spec_section(run_dir)}</body></html>"""
    path = run_dir / "report.html"
    path.write_text(page)
    return path


def add_arguments(parser) -> None:  # noqa: ANN001 - argparse.ArgumentParser
    parser.add_argument("run_dir", help="a run folder written by `tlt run` (runs/<id>)")
    from tlt.cli_args import at_least

    parser.add_argument("--threshold", type=at_least(1), default=None,
                        help="tail threshold (running batch); default: the run's own, from run.json")


def run(args) -> int:  # noqa: ANN001 - argparse.Namespace
    """`tlt report RUN_DIR`: (re)write RUN_DIR/report.html and its plots from the run's files."""
    run_dir = Path(args.run_dir)
    # run.json alone: a run stopped before its first step (a fresh trainer deletes metrics.jsonl until then)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "run.json").is_file():
        print(f"tlt report: {run_dir} holds no metrics.jsonl; give a run folder written by `tlt run` (runs/<id>)",
              file=sys.stderr)
        return 2  # a usage error, as every tlt command reports one
    print(write_report(run_dir, args.threshold))
    from tlt.services.trainer.run_folder import stale_export

    if why := stale_export(run_dir):  # the run's policy/ is not its latest checkpoint's: said where it is read
        print(f"tlt report: warning: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    print(write_report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
