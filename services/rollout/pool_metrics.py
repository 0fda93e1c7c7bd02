"""The replica pool on the rollout's GET /metrics (namespace `rollout`), read at scrape time: each replica's running,
queued, KV use, preemptions and liveness, the drafter feature sequences it dropped, the samples that spanned a policy
update (the SGLang backend counts them), its speculative decoding (spec_metrics.py) and garbage collections, and the
pool's running totals (tokens generated and prompted, HTTP and gRPC alike; deaths; re-dispatched requests) as counters.
A replica's own counts start from 0 in each of its processes: a restarted one's (another pid) are added from there.

A dead replica's gauges read nothing running: the stats of its last scrape (128 running, SD on) stayed on show.
"""

from __future__ import annotations

from typing import Any

from tlt.services.common.gc_heap import GcMetrics, GcPauses
from tlt.services.common.metrics import Metrics
from tlt.services.rollout.spec_metrics import SpecMetrics


class PoolMetrics:
    def __init__(self, metrics: Metrics) -> None:
        # shared with the gRPC API (server.py): the trainer's BatchGenerate traffic counts here too
        self.prompt = metrics.counter("prompt_tokens_total", "prompt tokens of the requests admitted, HTTP and gRPC: "
                                      "each prompt once whatever n, as OpenAI's usage.prompt_tokens")
        self.generated = metrics.counter("generated_tokens_total", "tokens the engines generated for HTTP and gRPC "
                                         "requests, counted at each engine step: a request whose client went away "
                                         "counts what its unfinished samples had generated, a re-dispatched sample's "
                                         "tokens count again as it regenerates them")
        self.running = metrics.gauge("replica_running", "running sequences per replica", ("replica",))
        self.queued = metrics.gauge("replica_queued", "queued sequences per replica", ("replica",))
        self.kv = metrics.gauge("replica_kv_usage", "KV cache use per replica (0..1)", ("replica",))
        self.alive = metrics.gauge("replica_alive", "1 when the replica process is serving", ("replica",))
        self.deaths = metrics.counter("replica_deaths", "replica processes that died or were killed (stall, update "
                                      "timeout) while serving", ("replica",))
        self.redispatched = metrics.counter("redispatched_requests", "requests whose unfinished samples were "
                                            "re-issued to another replica after theirs died (redispatch_limit)")
        self.preemptions = metrics.counter("replica_preemptions", "sequences preempted because the KV cache was full "
                                           "(their blocks freed, their tokens recomputed when they resume)",
                                           ("replica",))
        self.features_dropped = metrics.counter("replica_features_dropped", "finished sequences whose drafter "
                                                "features the replica dropped (no consumer keeping up with "
                                                "[rollout] features_push, or one sequence over a frame)", ("replica",))
        self.policy_spanning = metrics.counter("replica_policy_spanning", "samples running when a policy update was "
                                               "applied (stamped with policy_min); counted by the SGLang backend, "
                                               "whose update retracts them", ("replica",))
        self._seen: dict[tuple[str, int], tuple[int | None, int]] = {}  # (count, replica) -> (pid, its last total)
        self.spec = SpecMetrics(metrics)
        self.gc = GcMetrics(metrics)
        self._counted: dict[str, int] = {}  # pool totals already added to those counters (added at scrape)

    def scrape(self, pool: Any, replicas: list[Any], gc_pauses: GcPauses | None) -> None:
        """Set everything from the pool (a ReplicaPool) and its replicas' snapshot (`pool.snapshot()`)."""
        for s in replicas:
            r = str(s.replica_id)
            self.alive.labels(r).set(1 if s.alive else 0)
            if not s.alive:
                self.running.labels(r).set(0)
                self.queued.labels(r).set(0)
                self.kv.labels(r).set(0)
                self.spec.dead(s.replica_id)
            elif s.stats is not None:
                self.running.labels(r).set(s.stats.running)
                self.queued.labels(r).set(s.stats.queued)
                self.kv.labels(r).set(s.stats.kv_usage)
                self._count_replica(self.preemptions, "preemptions", s, s.stats.num_preemptions)
                self._count_replica(self.features_dropped, "features_dropped", s, s.stats.features_dropped)
                if "policy_spanning" in s.stats.spec:  # a backend that counts them (SGLang's)
                    self._count_replica(self.policy_spanning, "policy_spanning", s, s.stats.spec["policy_spanning"])
                self.spec.update(s.replica_id, s.stats.spec, s.pid)
                self.gc.update(f"replica-{s.replica_id}", s.stats.gc)
        if gc_pauses is not None:
            self.gc.update("front", gc_pauses.snapshot())
        self._count_up(self.redispatched, "redispatched", pool.redispatches)
        self._count_up(self.generated, "generated", pool.generated_tokens)
        self._count_up(self.prompt, "prompt", pool.prompt_tokens)
        for replica, deaths in pool.deaths.items():
            self._count_up(self.deaths.labels(str(replica)), f"deaths{replica}", deaths)

    def _count_replica(self, counter: Any, key: str, s: Any, total: int) -> None:
        """Add what a replica's running `total` grew since the last scrape; a restarted replica (another pid) counts
        from 0 again. The series is there (at 0) from the first scrape."""
        pid, seen = self._seen.get((key, s.replica_id), (s.pid, 0))
        now = int(total)
        if pid != s.pid or now < seen:
            seen = 0
        counter.labels(str(s.replica_id)).inc(max(now - seen, 0))
        self._seen[(key, s.replica_id)] = (s.pid, now)

    def _count_up(self, counter: Any, key: str, total: int) -> None:
        """Bring a Prometheus counter to the pool's running total (which only grows) by adding what is new."""
        counter.inc(total - self._counted.get(key, 0))
        self._counted[key] = total
