"""Prometheus view of each replica's speculative decoding (GET /metrics, namespace `rollout`).

Every decision the adaptive engine takes is visible here, per replica: whether SD is on, how many
verify and plain steps ran (and why a step decoded plainly instead: no KV room for its drafts, no arm within
the verify-token budget), the last
step's wall time, the accept length, and per arm how often it was chosen and the tokens per
sequence it kept; with the adaptive mode, the bandit's view
per batch-size bucket (explored / exploited choices, each arm's median reward in tokens/s). The
values are read from the replicas' stats at scrape time (the engine keeps the running counts). The counts are
Prometheus counters (`*_total`): each scrape adds what a replica counted since the last one, and a replica that
restarted (another pid, its counts back at 0) adds what its new process counted, whether or not a scrape fell
between the restart and the new process passing the old one's total; as gauges of the replicas' totals they fell
to 0 at a restart, which rate() and increase() read as nothing happening.
"""

from __future__ import annotations

from typing import Any

from tlt.services.common.metrics import Metrics


class SpecMetrics:
    def __init__(self, metrics: Metrics) -> None:
        r = ("replica",)
        self.active = metrics.gauge("spec_active", "1 while speculative decoding is on (running batch <= threshold)", r)
        self.switches = metrics.counter("spec_switches", "times SD was switched on or off", r)
        self.verify = metrics.counter("spec_verify_steps", "engine steps run as one draft + verify pass", r)
        self.plain = metrics.counter("spec_plain_steps", "engine steps that emitted tokens without speculation (a "
                                     "prompt's last prefill chunk included; a prefill chunk that emits nothing is "
                                     "counted in neither this nor spec_verify_steps)", r)
        self.over_budget = metrics.counter("spec_over_budget_steps", "steps SD would have run but decoded plainly: "
                                           "no arm fit the verify-token budget at the batch size", r)
        self.no_room = metrics.counter("spec_no_room_steps", "steps an arm was chosen but its drafts did not fit (no "
                                       "KV blocks, or past the context limit) and decoded plainly", r)
        self.step = metrics.gauge("spec_last_step_seconds", "wall time of the last engine step whose arm the decoder "
                                  "chose (a verify step, or the adaptive mode's plain arm)", r)
        self.catch_up = metrics.counter("spec_catch_up_seconds", "drafter catch-up after steps without SD (in the "
                                        "step times; in the bandit's rewards only of the plain-arm steps that alone "
                                        "left it)", r)
        self.accept = metrics.gauge("spec_mean_accept_len", "tokens per sequence per verify step (bonus included)", r)
        self.arm_steps = metrics.counter("spec_arm_verify_steps", "steps run with each arm the decoder chose; arm "
                                       "\"plain\": the adaptive mode's plain decode step in the tail, counted in "
                                       "spec_plain_steps, not spec_verify_steps", ("replica", "arm"))
        self.last_arm = metrics.gauge("spec_last_arm", "1 for the arm of the replica's last step the decoder chose "
                                      "(verify or the plain arm)", ("replica", "arm"))
        self._last_arm: dict[str, str] = {}
        self._seen: dict[tuple, float] = {}  # each counted series' replica total at the last scrape
        self._pid: dict[str, int | None] = {}  # replica -> the pid of the process those totals are from
        self.arm_accept = metrics.gauge("spec_arm_accept_len", "tokens per sequence per verify step, by arm",
                                        ("replica", "arm"))
        self._accept_arms: dict[str, set[str]] = {}  # replica -> the arms its arm_accept series are set for
        self.bucket_choices = metrics.counter("spec_bandit_choices", "bandit choices per batch-size bucket, by kind",
                                            ("replica", "bucket", "kind"))
        self.arm_reward = metrics.gauge("spec_bandit_median_reward", "median reward (tokens/s) of an arm in a bucket",
                                        ("replica", "bucket", "arm"))
        self.arm_chosen = metrics.counter("spec_bandit_chosen", "steps an arm the bandit chose ran in a bucket (a choice withdrawn for lack of KV room is not counted)",
                                        ("replica", "bucket", "arm"))

    def _set_last_arm(self, r: str, arm: str | None) -> None:
        old = self._last_arm.pop(r, None)
        if old is not None and old != arm:
            self.last_arm.remove(r, old)
        if arm:
            self.last_arm.labels(r, arm).set(1)
            self._last_arm[r] = arm

    def _count(self, counter: Any, labels: tuple[str, ...], total: float) -> None:
        """Bring a counter series up by what the replica's running `total` grew since the last scrape; a total below
        the last one is a restarted replica's, counted from 0 (a caller that gives no pid)."""
        key = (id(counter), labels)
        last = self._seen.get(key, 0.0)
        counter.labels(*labels).inc(total - last if total >= last else total)
        self._seen[key] = total

    def dead(self, replica_id: int) -> None:
        """A dead replica speculates no more: SD off and no last arm (its counts stay until its restart resets them)."""
        r = str(replica_id)
        self.active.labels(r).set(0)
        self._set_last_arm(r, None)

    def update(self, replica_id: int, spec: dict[str, Any], pid: int | None = None) -> None:
        """Set the gauges and bring the counters of one replica up from its engine's spec stats (empty: no decoder
        attached); `pid`, the replica's process: another one than the last scrape's counts from 0."""
        if not spec:
            return
        r = str(replica_id)
        if self._pid.get(r, pid) != pid:  # a restarted replica: its totals start again from 0
            self._seen = {k: v for k, v in self._seen.items() if k[1][0] != r}
        self._pid[r] = pid
        self.active.labels(r).set(1 if spec.get("on") else 0)
        self._count(self.switches, (r,), spec.get("switches", 0))
        self._count(self.verify, (r,), spec.get("verify_steps", 0))
        self._count(self.plain, (r,), spec.get("plain_steps", 0))
        self._count(self.over_budget, (r,), spec.get("over_budget", 0))
        self._count(self.no_room, (r,), spec.get("no_room", 0))
        self.step.labels(r).set(spec.get("last_step_seconds", 0.0))
        self._count(self.catch_up, (r,), spec.get("catch_up_seconds", 0.0))
        self.accept.labels(r).set(spec.get("mean_accept_len", 0.0))
        self._set_last_arm(r, spec.get("last_arm"))
        arms = spec.get("arms", {})
        for name, a in arms.items():
            self._count(self.arm_steps, (r, name), a["verify_steps"])
            self.arm_accept.labels(r, name).set(a["emitted"] / a["seq_steps"] if a["seq_steps"] else 0.0)
        for name in self._accept_arms.get(r, set()) - arms.keys():  # a restarted replica's: not this process's steps
            self.arm_accept.remove(r, name)
        self._accept_arms[r] = set(arms)
        for b in spec.get("bandit", []):
            self._count(self.bucket_choices, (r, b["bucket"], "explored"), b["explored"])
            self._count(self.bucket_choices, (r, b["bucket"], "exploited"), b["exploited"])
            for a in b["arms"]:
                self._count(self.arm_chosen, (r, b["bucket"], a["arm"]), a["chosen"])
                if a["median_reward"] is not None:
                    self.arm_reward.labels(r, b["bucket"], a["arm"]).set(a["median_reward"])
                else:  # no data at the bucket's current batch size: drop a median left from another size
                    try:
                        self.arm_reward.remove(r, b["bucket"], a["arm"])
                    except KeyError:
                        pass
