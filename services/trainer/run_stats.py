"""A run's files -> one typed row per RL step (shared by the live table of `tlt run` and report.html).

    runs/<id>/metrics.jsonl    the trainer's StepMetrics per step (times measured where they happen,
                               SD counters summed over the step's completions, started_at)
    runs/<id>/timeline.jsonl   the rollout's status sampled every poll_interval_s (TimelineSample)
    runs/<id>/drafter.jsonl    the drafter's training windows (idle capacity it used), one per line
      -> StepRow: step time and its parts, tail time, reward, accuracy, SD share, acceptance,
                  idle windows used, drafter version

Tail time is measured on the sampled timeline: the part of the step's rollout
during which something ran and the running batch of every replica (each applies
the SD threshold to its own batch) was at most the tail threshold. It is a
sample-based estimate, exact to one poll interval.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO


@dataclass(frozen=True)
class TimelineSample:
    t: float  # unix seconds
    running: tuple[int, ...]  # per replica
    queued: tuple[int, ...]
    sd: tuple[bool, ...]  # speculative decoding on at the replica's last step
    policy: int
    drafter: int

    @property
    def total_running(self) -> int:
        return sum(self.running)

    @property
    def max_running(self) -> int:
        """The busiest replica's running batch: what each replica's SD threshold is compared with."""
        return max(self.running, default=0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> TimelineSample:
        d = json.loads(line)
        return TimelineSample(d["t"], tuple(d["running"]), tuple(d["queued"]), tuple(d["sd"]), d["policy"], d["drafter"])


@dataclass(frozen=True)
class IdleWindow:
    """A drafter training window on a replica's idle capacity."""

    worker_id: int
    replica_id: int
    start: float
    end: float
    micro_steps: int
    preempted: bool


@dataclass(frozen=True)
class StepRow:
    step: int
    policy_version: int
    started_at: float
    step_s: float
    rollout_s: float
    tail_s: float
    reward_s: float  # reward wait after the last completion arrived (scoring overlaps the rollout)
    logprobs_s: float
    update_s: float
    push_s: float
    reward: float
    accuracy: float
    response_len: float
    sd_share: float  # share of response tokens emitted by verify passes
    accept_len: float  # tokens per verify pass per sequence (incl. bonus); 0: no verify pass
    idle_windows: int  # drafter training windows (>= 1 micro-step) overlapping the step
    idle_train_s: float  # their overlap with the step, summed
    drafter_version: int
    lend_s: float = 0.0  # colocated: borrowing the rollout's devices and giving them back (lend_rollout_devices)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill -9 mid-write: the rest is still good
                continue
    return out


def open_append(path: Path) -> TextIO:
    """`path` opened to append JSON lines, starting on a new line: a launch killed mid-write (kill -9) left a cut
    last line, and the next launch's first record would join it and be lost with it when read (`read_jsonl`)."""
    cut = False
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as old:
            old.seek(-1, 2)
            cut = old.read(1) != b"\n"
    f = path.open("a")
    if cut:
        f.write("\n")
    return f


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinity (a diverged loss) as None, in nested dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_line(record: dict) -> str:
    """One JSONL line, strict JSON: a NaN or an infinity is null (bare NaN / Infinity, which Python writes by default,
    is refused by jq, JSON.parse and most readers other than Python's)."""
    return json.dumps(_finite(record), allow_nan=False) + "\n"


def trim_jsonl(path: Path, keep: Callable[[dict], bool]) -> None:
    """Rewrite a run's JSONL file with only the records `keep` accepts (atomically; resume bookkeeping)."""
    if not path.exists():
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json_line(r) for r in read_jsonl(path) if keep(r)))
    tmp.replace(path)


def trim_samples(run_dir: Path, steps_done: int) -> None:
    """On a resume from the checkpoint after `steps_done` steps, timeline.jsonl and drafter.jsonl keep what happened
    until the kept steps and evals ended: the interrupted launch's later samples and windows belong to steps (and an
    eval) run again, and the report drew them as rollouts of no step. Nothing kept on a start from no checkpoint.
    Left as they are where the kept records carry no times (files of an older version)."""
    if not steps_done:
        for name in ("timeline.jsonl", "drafter.jsonl"):
            (run_dir / name).unlink(missing_ok=True)
        return
    ends = [m["started_at"] + m["times"]["step_s"] for m in read_jsonl(run_dir / "metrics.jsonl")
            if m.get("step", steps_done) < steps_done and m.get("started_at") and "step_s" in m.get("times", {})]
    ends += [e["started_at"] + e["seconds"] for e in read_jsonl(run_dir / "eval.jsonl")
             if e.get("after_steps", steps_done + 1) <= steps_done and e.get("started_at")]
    if not ends:
        return
    cut = max(ends)
    trim_jsonl(run_dir / "timeline.jsonl", lambda s: s["t"] <= cut)
    trim_jsonl(run_dir / "drafter.jsonl", lambda w: w["start"] <= cut)


def read_timeline(path: Path) -> list[TimelineSample]:
    return [TimelineSample(d["t"], tuple(d["running"]), tuple(d["queued"]), tuple(d["sd"]), d["policy"], d["drafter"])
            for d in read_jsonl(path)]


def read_windows(path: Path) -> list[IdleWindow]:
    return [IdleWindow(**d) for d in read_jsonl(path)]


def tail_seconds(samples: list[TimelineSample], t0: float, t1: float, threshold: int) -> float:
    """Time in [t0, t1] during which something ran and every replica's running batch was <= threshold (each sample
    holds until the next). Summed over replicas, a 6-replica rollout counted only its very end as tail."""
    total = 0.0
    for a, b in zip(samples, samples[1:]):
        lo, hi = max(a.t, t0), min(b.t, t1)
        if hi > lo and a.total_running >= 1 and a.max_running <= threshold:
            total += hi - lo
    return total


def step_row(m: dict, samples: list[TimelineSample], windows: list[IdleWindow], threshold: int) -> StepRow:
    times = m.get("times", {})
    t0 = float(m.get("started_at", 0.0))
    step_s = float(times.get("step_s", 0.0))
    rollout_s = float(times.get("rollout_s", 0.0))
    # windows that trained: one preempted before its first micro-step used no capacity
    overlap = [(w, min(w.end, t0 + step_s) - max(w.start, t0)) for w in windows if w.micro_steps > 0]
    overlap = [(w, s) for w, s in overlap if s > 0]
    verify = int(m.get("sd_verify_steps", 0))
    accepted = int(m.get("sd_accepted_tokens", 0))
    # over what the rollout generated (all rounds of dynamic sampling, overlong responses too), not over the tokens
    # trained on: a step that took 2 rounds showed a 200% share. Older metrics lines: the trained tokens
    tokens = int(m.get("sd_response_tokens", 0)) or int(m.get("tokens", 0))
    return StepRow(
        step=int(m["step"]), policy_version=int(m.get("policy_version", 0)), started_at=t0, step_s=step_s,
        rollout_s=rollout_s, tail_s=tail_seconds(samples, t0, t0 + rollout_s, threshold) if t0 else 0.0,
        reward_s=float(times.get("reward_tail_s", 0.0)), logprobs_s=float(times.get("old_logprobs_s", 0.0)),
        update_s=float(times.get("update_s", 0.0)), push_s=float(times.get("push_s", 0.0)),
        reward=float(m.get("reward_mean", 0.0)), accuracy=float(m.get("accuracy", 0.0)),
        response_len=float(m.get("response_len_mean", 0.0)),
        sd_share=accepted / tokens if tokens else 0.0, accept_len=accepted / verify if verify else 0.0,
        idle_windows=len(overlap), idle_train_s=sum(s for _, s in overlap),
        drafter_version=int(m.get("drafter_version", -1)), lend_s=float(times.get("lend_s", 0.0)),
    )


def step_rows(run_dir: Path, threshold: int) -> list[StepRow]:
    samples = read_timeline(run_dir / "timeline.jsonl")
    windows = read_windows(run_dir / "drafter.jsonl")
    return [step_row(m, samples, windows, threshold) for m in read_jsonl(run_dir / "metrics.jsonl")]


def settled(rows: list[StepRow], windows_known_at: float) -> int:
    """How many of `rows` (in step order) have every drafter window that overlaps them in drafter.jsonl.

    A window is written when it ends, and the one training on a step's idle capacity usually ends when
    the next step's rollout starts, after the step's line was written: a row shown at once would leave
    it out (`tlt run` showed only a 0-second window per step). A row is settled once a later step's line
    exists (that step's rollout preempted the window), or once the drafter showed no worker training at
    `windows_known_at` (unix time; math.inf without a drafter), after the step ended.
    """
    if not rows or windows_known_at >= rows[-1].started_at + rows[-1].step_s:
        return len(rows)
    return len(rows) - 1


HEADER = ("step", "time", "rollout", "tail", "reward", "logp", "update", "push", "R", "acc", "SD%", "accept",
          "idle", "drafter")


def format_row(r: StepRow) -> tuple[str, ...]:
    return (str(r.step), f"{r.step_s:.1f}s", f"{r.rollout_s:.1f}", f"{r.tail_s:.1f}", f"{r.reward_s:.2f}",
            f"{r.logprobs_s:.1f}", f"{r.update_s:.1f}", f"{r.push_s:.2f}", f"{r.reward:.3f}", f"{r.accuracy:.3f}",
            f"{100 * r.sd_share:.0f}", f"{r.accept_len:.2f}" if r.accept_len else "-",
            f"{r.idle_windows}/{r.idle_train_s:.1f}s" if r.idle_windows else "-",
            str(r.drafter_version) if r.drafter_version >= 0 else "-")


def log_fields(r: StepRow) -> dict[str, float | int | None]:
    """A row as `tlt run --quiet` logs it: numbers under their own names (the table's headers made `reward` the
    reward wait and every value a string)."""
    return {"step": r.step, "step_s": round(r.step_s, 2), "rollout_s": round(r.rollout_s, 2),
            "tail_s": round(r.tail_s, 2), "reward_wait_s": round(r.reward_s, 3), "logprobs_s": round(r.logprobs_s, 2),
            "update_s": round(r.update_s, 2), "push_s": round(r.push_s, 3), "reward": round(r.reward, 4),
            "accuracy": round(r.accuracy, 4), "sd_share": round(r.sd_share, 4),
            "accept_len": round(r.accept_len, 3) if r.accept_len else None, "idle_windows": r.idle_windows,
            "idle_train_s": round(r.idle_train_s, 2), "drafter_version": r.drafter_version if r.drafter_version >= 0
            else None}


WIDTHS = (4, 7, 7, 6, 6, 5, 6, 5, 6, 6, 4, 6, 10, 7)


def table_line(cells: tuple[str, ...]) -> str:
    return " ".join(c.rjust(w) for c, w in zip(cells, WIDTHS))
