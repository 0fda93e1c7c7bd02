"""Two counts the docs send users to were kept by the replicas but exported nowhere: the drafter feature sequences a
replica dropped (ReplicaStats.features_dropped; docs/DRAFTER.md; its /metrics check is
tests/test_drafter_rollout_events.py's, on the server that test starts anyway) and, on the SGLang backend, the
samples that spanned a policy update (its engine's stats().spec["policy_spanning"]; docs/DEPLOY.md). Both are on
GET /metrics now, per replica, as counters that keep counting across a replica's restart.

Real parts: the rollout server on 127.0.0.1 with its replica processes, HTTP and gRPC; the SGLang backend is its
real adapter (services/rollout/sglang_backend/engine.py) over the fake client of tests/sglang_fakes.py, run in the
replica process as a `module:Class` backend.
"""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import httpx
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.v1 import rollout_pb2


def _counter(base: str, name: str, replica: int = 0) -> float | None:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    m = re.search(rf'^{name}\{{replica="{replica}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_samples_spanning_a_policy_update_are_counted_on_metrics(tmp_path) -> None:
    import safetensors.torch

    model = tiny_checkpoint(tmp_path / "model")
    weights = safetensors.torch.load_file(str(model / "model.safetensors"))
    with ServerThread(model, replicas=1, backend="sglang_fakes:FakeSGLangEngine") as s:
        base = s.base_url.removesuffix("/v1")
        assert _counter(base, "rollout_replica_policy_spanning_total") == 0

        async def spanning() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                # the fake never finishes a sample: this one runs until its client goes away
                req = asyncio.create_task(c.post(f"{s.base_url}/completions", json={
                    "model": s.model_name, "prompt": "1+1=", "max_tokens": 8}))
                deadline = time.monotonic() + 30
                while (await asyncio.to_thread(s.call, s.server.pool.snapshot()))[0].stats.running == 0:
                    assert time.monotonic() < deadline, "the sample never ran"
                    await asyncio.sleep(0.05)

                def push() -> None:
                    with RolloutClient(s.grpc_address, timeout_s=60) as client:
                        assert client.update_weights(weights, "policy", 1).ok

                await asyncio.to_thread(push)
                req.cancel()

        asyncio.run(spanning())
        assert s.call(s.server.pool.snapshot())[0].stats.spec["policy_spanning"] == 1
        assert _counter(base, "rollout_replica_policy_spanning_total") == 1


def test_the_counts_go_on_across_a_replica_restart() -> None:
    """A restarted replica (another pid) counts from 0 again: its new counts are added, the total never falls."""
    from tlt.services.common.metrics import Metrics
    from tlt.services.rollout.pool_metrics import PoolMetrics

    metrics = Metrics("rollout")
    pool_metrics = PoolMetrics(metrics)
    pool = SimpleNamespace(redispatches=0, generated_tokens=0, prompt_tokens=0, deaths={})

    def scrape(pid: int, dropped: int, spanning: int) -> tuple[float, float]:
        stats = SimpleNamespace(running=0, queued=0, kv_usage=0.0, num_preemptions=0, gc={},
                                spec={"policy_spanning": spanning, "verify_steps": 0}, features_dropped=dropped)
        pool_metrics.scrape(pool, [SimpleNamespace(replica_id=0, alive=True, stats=stats, pid=pid)], None)
        return (pool_metrics.features_dropped.labels("0")._value.get(),
                pool_metrics.policy_spanning.labels("0")._value.get())

    assert scrape(100, 3, 1) == (3, 1)
    assert scrape(100, 5, 2) == (5, 2)
    assert scrape(200, 1, 1) == (6, 3)  # restarted: its 1 and 1 are new
    assert scrape(200, 4, 1) == (9, 3)
    assert scrape(300, 6, 1) == (15, 4)  # restarted again, past the old process's totals: all of its 6 and 1 are new
