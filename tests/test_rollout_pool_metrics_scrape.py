"""The replica pool's GET /metrics view (services/rollout/pool_metrics.py), scraped from a pool and its replicas'
snapshot: values the server tests (tests/test_rollout_grpc.py, test_rollout_restarts.py) do not read, found unpinned by
session 55's mutation audit: a live replica's queued and KV gauges, each replica's own deaths, the front's GC.

Real parts: PoolMetrics on a real Metrics registry, read back through its Prometheus text (what /metrics serves);
the pool and the snapshot are plain namespaces with the fields the server's carry (ReplicaPool, pool.snapshot()).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from tlt.services.common.gc_heap import GcPauses
from tlt.services.common.metrics import Metrics
from tlt.services.rollout.pool_metrics import PoolMetrics


def _value(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^rollout_{name}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _replica(i: int, alive: bool = True, running: int = 0, queued: int = 0, kv: float = 0.0) -> SimpleNamespace:
    stats = SimpleNamespace(running=running, queued=queued, kv_usage=kv, num_preemptions=0, gc={}, spec={},
                            features_dropped=0)
    return SimpleNamespace(replica_id=i, alive=alive, stats=stats, pid=1000 + i)


def test_a_live_replica_s_gauges_read_its_stats_and_a_dead_one_s_read_nothing():
    metrics = Metrics("rollout")
    pm = PoolMetrics(metrics)
    pool = SimpleNamespace(redispatches=0, generated_tokens=0, prompt_tokens=0, deaths={})
    pm.scrape(pool, [_replica(0, running=5, queued=3, kv=0.25), _replica(1, running=7, queued=2, kv=0.5)], None)
    text = metrics.render().decode()
    got = {(n, r): _value(text, n, f'replica="{r}"') for n in ("replica_running", "replica_queued", "replica_kv_usage",
                                                                "replica_alive") for r in (0, 1)}
    assert got == {("replica_running", 0): 5, ("replica_running", 1): 7, ("replica_queued", 0): 3,
                   ("replica_queued", 1): 2, ("replica_kv_usage", 0): 0.25, ("replica_kv_usage", 1): 0.5,
                   ("replica_alive", 0): 1, ("replica_alive", 1): 1}, got
    pm.scrape(pool, [_replica(0, running=5, queued=3, kv=0.25), _replica(1, alive=False, running=7, queued=2, kv=0.5)],
              None)
    text = metrics.render().decode()
    dead = [_value(text, n, 'replica="1"') for n in ("replica_running", "replica_queued", "replica_kv_usage",
                                                     "replica_alive")]
    assert dead == [0, 0, 0, 0], ("a dead replica's gauges kept its last stats", dead)
    live = [_value(text, n, 'replica="0"') for n in ("replica_queued", "replica_kv_usage")]
    assert live == [3, 0.25], live


def test_each_replica_s_deaths_and_the_pool_s_totals_count_up_once():
    metrics = Metrics("rollout")
    pm = PoolMetrics(metrics)
    pool = SimpleNamespace(redispatches=1, generated_tokens=40, prompt_tokens=9, deaths={0: 2, 1: 1})
    pm.scrape(pool, [_replica(0), _replica(1)], None)
    pool.deaths = {0: 3, 1: 1}
    pool.redispatches, pool.generated_tokens, pool.prompt_tokens = 2, 100, 12
    pm.scrape(pool, [_replica(0), _replica(1)], None)
    text = metrics.render().decode()
    deaths = [_value(text, "replica_deaths_total", f'replica="{r}"') for r in (0, 1)]
    assert deaths == [3, 1], ("each replica's deaths are its own", deaths)
    totals = [_value(text, n) for n in ("redispatched_requests_total", "generated_tokens_total", "prompt_tokens_total")]
    assert totals == [2, 100, 12], totals


def test_the_front_s_and_each_replica_s_gc_pauses_are_on_show():
    metrics = Metrics("rollout")
    pm = PoolMetrics(metrics)
    pauses = GcPauses()
    pauses.collections = [4, 2, 1]
    rep = _replica(0)
    rep.stats.gc = {"frozen_objects": 10, "collections": [7, 3, 0], "seconds": [0.1, 0.2, 0.0],
                    "max_seconds": [0.01, 0.1, 0.0]}
    pm.scrape(SimpleNamespace(redispatches=0, generated_tokens=0, prompt_tokens=0, deaths={}), [rep], pauses)
    text = metrics.render().decode()
    got = {p: [_value(text, "gc_collections", f'generation="{g}",process="{p}"') for g in (0, 1, 2)]
           for p in ("front", "replica-0")}
    assert got == {"front": [4, 2, 1], "replica-0": [7, 3, 0]}, (got, [x for x in text.splitlines() if "gc_coll" in x])


def test_a_dead_replica_speculates_no_more():
    metrics = Metrics("rollout")
    pm = PoolMetrics(metrics)
    pool = SimpleNamespace(redispatches=0, generated_tokens=0, prompt_tokens=0, deaths={})
    rep = _replica(0)
    rep.stats.spec = {"on": True, "verify_steps": 3}
    pm.scrape(pool, [rep], None)
    assert _value(metrics.render().decode(), "spec_active", 'replica="0"') == 1
    rep.alive = False
    pm.scrape(pool, [rep], None)
    assert _value(metrics.render().decode(), "spec_active", 'replica="0"') == 0, "a dead replica's SD stayed on show"


def test_a_replica_count_that_falls_under_the_same_pid_counts_from_0_again():
    """A restart is told by another pid; a count that falls while the pid reads the same (a snapshot with no pid, or
    an engine that started its counts over) is a new process's too: what it reports is added, never lost."""
    metrics = Metrics("rollout")
    pm = PoolMetrics(metrics)
    pool = SimpleNamespace(redispatches=0, generated_tokens=0, prompt_tokens=0, deaths={})
    rep = _replica(0)
    rep.pid = None
    for preempted in (5, 2):
        rep.stats.num_preemptions = preempted
        pm.scrape(pool, [rep], None)
    got = _value(metrics.render().decode(), "replica_preemptions_total", 'replica="0"')
    assert got == 7, ("5, then 2 counted from 0 again: 7", got)
