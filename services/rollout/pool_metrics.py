"""The replica pool on the rollout's GET /metrics (namespace `rollout`), read at scrape time: each replica's running,
queued, KV use, preemptions and liveness, its speculative decoding (spec_metrics.py) and garbage collections, and the pool's
running totals (tokens generated and prompted, HTTP and gRPC alike; deaths; re-dispatched requests) as counters.

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
        self._preempted: dict[int, tuple[int, int]] = {}  # replica -> (pid, its engine's count at the last scrape)
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
                self._count_preemptions(s)
                self.spec.update(s.replica_id, s.stats.spec, s.pid)
                self.gc.update(f"replica-{s.replica_id}", s.stats.gc)
        if gc_pauses is not None:
            self.gc.update("front", gc_pauses.snapshot())
        self._count_up(self.redispatched, "redispatched", pool.redispatches)
        self._count_up(self.generated, "generated", pool.generated_tokens)
        self._count_up(self.prompt, "prompt", pool.prompt_tokens)
        for replica, deaths in pool.deaths.items():
            self._count_up(self.deaths.labels(str(replica)), f"deaths{replica}", deaths)

    def _count_preemptions(self, s: Any) -> None:
        """Add what a replica's engine preempted since the last scrape; a restarted replica (another pid) counts
        from 0 again."""
        pid, seen = self._preempted.get(s.replica_id, (s.pid, 0))
        now = int(s.stats.num_preemptions)
        if pid != s.pid or now < seen:
            seen = 0
        if now > seen:
            self.preemptions.labels(str(s.replica_id)).inc(now - seen)
        self._preempted[s.replica_id] = (s.pid, now)

    def _count_up(self, counter: Any, key: str, total: int) -> None:
        """Bring a Prometheus counter to the pool's running total (which only grows) by adding what is new."""
        counter.inc(total - self._counted.get(key, 0))
        self._counted[key] = total
