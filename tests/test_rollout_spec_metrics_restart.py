"""The `rollout_spec_*` counters on GET /metrics keep a restarted replica's counts.

A scrape adds what a replica counted since the last one. A restart was seen only as a total below the last scrape's;
when no scrape fell between the restart and the new process passing its old total, the old process's counts were
lost (32 verify steps, then 64 by the new process, read 64). The replica's pid tells the processes apart.

Real parts: the rollout server on 127.0.0.1 (one real replica process, the native engine, the default adaptive
speculative decoding), HTTP; the test SIGKILLs the replica by the pid the server reports (a process it started).
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.common.metrics import Metrics
from tlt.services.rollout.spec_metrics import SpecMetrics


def _sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"replica": "0", **labels})


def test_a_new_process_past_the_old_total_adds_to_it():
    """Totals 100 (pid 11), then 150 by the restarted process (pid 12) with no scrape between: 250, per series."""
    metrics = Metrics("rollout")
    spec = SpecMetrics(metrics)

    def stats(n: int) -> dict:
        return {"on": True, "verify_steps": n, "arms": {"8_1_9": {"verify_steps": n, "emitted": 0, "seq_steps": 0}},
                "bandit": [{"bucket": "1", "explored": n, "exploited": 0,
                            "arms": [{"arm": "8_1_9", "chosen": n, "median_reward": None}]}]}

    spec.update(0, stats(100), pid=11)
    spec.dead(0)  # a scrape while it restarts
    spec.update(0, stats(150), pid=12)
    assert _sample(metrics, "rollout_spec_verify_steps_total") == 250
    assert _sample(metrics, "rollout_spec_arm_verify_steps_total", arm="8_1_9") == 250
    assert _sample(metrics, "rollout_spec_bandit_chosen_total", bucket="1", arm="8_1_9") == 250
    assert _sample(metrics, "rollout_spec_bandit_choices_total", bucket="1", kind="explored") == 250
    spec.update(0, stats(170), pid=12)  # the same process again: what it counted since
    assert _sample(metrics, "rollout_spec_verify_steps_total") == 270


def _verify_total(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    m = re.search(r'^rollout_spec_verify_steps_total\{replica="0"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_counts_of_a_killed_replica_stay_after_its_restart(tmp_path):
    model = tiny_checkpoint(tmp_path / "model")
    with ServerThread(model, replicas=1, max_restarts=1) as s:
        base = s.base_url.removesuffix("/v1")

        def work(k: int) -> int:
            for i in range(k):
                r = httpx.post(f"{s.base_url}/completions", timeout=120, json={
                    "model": s.model_name, "prompt": f"{i}+{i}=", "max_tokens": 30, "ignore_eos": True,
                    "temperature": 0})
                assert r.status_code == 200, r.text
            return s.call(s.server.pool.snapshot())[0].stats.spec["verify_steps"]

        before = work(1)
        assert before > 0 and _verify_total(base) == before
        old = s.server.replica_pids()[0]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (s.server.pool.replicas[0].alive and s.server.replica_pids()[0] != old):
            assert time.monotonic() < deadline, "the replica was not restarted"
            time.sleep(0.1)
        after = work(2)  # no scrape until the new process has passed the old one's total
        assert after > before
        assert _verify_total(base) == before + after


def test_per_arm_accept_lengths_are_the_serving_process_s():
    """spec_arm_accept_len is a gauge of the process's own steps: after a restart, an arm the new process has not run
    had kept the dead process's figure (through later restarts too), beside GetStatus's empty arms and a
    spec_mean_accept_len of 0."""
    metrics = Metrics("rollout")
    spec = SpecMetrics(metrics)
    arms = {"8_1_9": {"verify_steps": 4, "emitted": 8, "seq_steps": 5},
            "5_1_6": {"verify_steps": 2, "emitted": 6, "seq_steps": 4}}
    spec.update(0, {"on": True, "arms": arms}, pid=11)
    assert _sample(metrics, "rollout_spec_arm_accept_len", arm="8_1_9") == 1.6
    assert _sample(metrics, "rollout_spec_arm_accept_len", arm="5_1_6") == 1.5
    spec.dead(0)
    spec.update(0, {"on": False, "arms": {}}, pid=12)  # restarted, no step yet
    assert _sample(metrics, "rollout_spec_arm_accept_len", arm="8_1_9") is None
    assert _sample(metrics, "rollout_spec_arm_accept_len", arm="5_1_6") is None
    spec.update(0, {"on": True, "arms": {"5_1_6": {"verify_steps": 1, "emitted": 3, "seq_steps": 1}}}, pid=12)
    assert _sample(metrics, "rollout_spec_arm_accept_len", arm="5_1_6") == 3.0
    assert _sample(metrics, "rollout_spec_arm_accept_len", arm="8_1_9") is None
    assert _sample(metrics, "rollout_spec_arm_verify_steps_total", arm="8_1_9") == 4  # counters keep their counts


def test_one_replica_s_restart_leaves_the_others_counts_and_each_count_reads_its_own_field():
    """A restart of replica 0 forgets replica 0's last totals only: replica 1's next scrape adds what it counted
    since, not its whole total again. Each series reads its own field (no_room is not over_budget), and a dead
    replica's SD is off until it reports again."""
    metrics = Metrics("rollout")
    spec = SpecMetrics(metrics)

    def stats(n: int) -> dict:
        return {"on": True, "verify_steps": n, "no_room": 3, "over_budget": 5, "last_arm": "8_1_9"}

    spec.update(0, stats(10), pid=11)
    spec.update(1, stats(40), pid=21)
    spec.dead(0)
    assert _sample(metrics, "rollout_spec_active") == 0 and _sample(metrics, "rollout_spec_last_arm", arm="8_1_9") is None
    spec.update(0, stats(2), pid=12)  # replica 0 restarted
    spec.update(1, stats(41), pid=21)  # replica 1 ran on: one step more
    assert _sample(metrics, "rollout_spec_verify_steps_total") == 12
    assert _sample(metrics, "rollout_spec_verify_steps_total", replica="1") == 41
    assert _sample(metrics, "rollout_spec_no_room_steps_total", replica="1") == 3
    assert _sample(metrics, "rollout_spec_over_budget_steps_total", replica="1") == 5
    assert _sample(metrics, "rollout_spec_active") == 1
