"""A KV cache too small for the running batch preempts sequences (their blocks freed, their tokens recomputed
later): the engine counted them, but /metrics showed none, so an operator could not see the cache thrash.

Real parts: the rollout server on 127.0.0.1 (native engine, one replica process, a 128-token KV cache), HTTP.
"""

from __future__ import annotations

import asyncio
import re

import httpx
from rollout_helpers import ServerThread, tiny_checkpoint


def _preemptions(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    m = re.search(r'^rollout_replica_preemptions_total\{replica="0"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_preemptions_are_counted_on_metrics(tmp_path):
    model = tiny_checkpoint(tmp_path / "model")
    with ServerThread(model, replicas=1, engine={"num_kv_blocks": 8, "block_size": 16}) as s:
        base = s.base_url.removesuffix("/v1")
        assert _preemptions(base) == 0

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as c:
                rs = await asyncio.gather(*[c.post(f"{s.base_url}/completions", json={
                    "model": s.model_name, "prompt": f"{i}+{i}=", "max_tokens": 40, "ignore_eos": True,
                    "temperature": 0}) for i in range(8)])  # 8 x ~45 tokens, 128 in the cache
            return [r.status_code for r in rs]

        assert asyncio.run(burst()) == [200] * 8
        engine_count = s.call(s.server.pool.snapshot())[0].stats.num_preemptions
        assert engine_count > 0
        assert _preemptions(base) == engine_count
