"""Bounded load test on 127.0.0.1: many concurrent streaming clients against `tlt rollout serve`.

Every client loops for the duration: a streaming /v1/completions request with
a random length, read to `data: [DONE]`; one request in five is dropped by the
client after its first chunk (the server must abort it and free its KV).
Checked: zero errors, every finished stream well formed, no sequence left
running or queued afterwards, RSS of the server + replica processes flat
(bounded growth after warm-up). p50/p99 request latency is printed.

Default run: 16 clients for 8 s. `slow`: 64 clients for 30 s. The garbage collector's pauses in the front and
each replica, from /metrics, are printed too; every process must have frozen its startup heap (`[rollout]
gc_freeze`, on by default). `TLT_LOAD_GC_FREEZE=false` runs the server without the freeze, for the comparison in
BENCHMARKS.md (the check is then that nothing was frozen).

Real parts: `tlt rollout serve` as a subprocess with two replica processes
running the native engine on a tiny random checkpoint, httpx clients. Nothing
is faked.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time

import httpx
import psutil
import pytest

from rollout_helpers import ServeProcess, tiny_checkpoint
from tlt.services.rollout.client import RolloutClient


async def _client(base: str, model: str, seed: int, deadline: float, lat: list, errors: list, counts: dict) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60) as http:
        while time.monotonic() < deadline:
            body = {"model": model, "prompt": f"{rng.randint(1, 99)}+{rng.randint(1, 99)}=", "stream": True,
                    "max_tokens": rng.randint(4, 32), "temperature": 1.0, "ignore_eos": rng.random() < 0.5}
            drop = rng.random() < 0.2
            t0 = time.monotonic()
            try:
                async with http.stream("POST", f"{base}/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"status {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    finished, done = False, False
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        if drop:
                            counts["dropped"] += 1
                            break
                        assert line.startswith("data: "), line
                        data = line[len("data: "):]
                        if data == "[DONE]":
                            done = True
                            continue
                        chunk = json.loads(data)
                        if "error" in chunk:
                            errors.append(chunk["error"]["message"])
                            continue
                        for ch in chunk["choices"]:
                            finished |= ch.get("finish_reason") is not None
                    if not drop:
                        if not (finished and done):
                            errors.append(f"stream ended early (finished={finished}, done={done})")
                        else:
                            lat.append(time.monotonic() - t0)
                            counts["ok"] += 1
            except (httpx.HTTPError, AssertionError, json.JSONDecodeError) as e:
                errors.append(repr(e))


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids)


async def _load(base: str, model: str, pids: list[int], clients: int, seconds: float) -> dict:
    lat: list[float] = []
    errors: list[str] = []
    counts = {"ok": 0, "dropped": 0}
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def sample_rss() -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - t0, _rss(pids)))
            await asyncio.sleep(0.25)

    await asyncio.gather(sample_rss(), *(_client(base, model, i, deadline, lat, errors, counts) for i in range(clients)))
    return {"lat": lat, "errors": errors, "counts": counts, "samples": samples, "wall": time.monotonic() - t0}


def _gc(root: str) -> dict[str, dict]:
    """/metrics' rollout_gc_* lines -> {process: {"frozen": n, "collections": {gen: n}, "seconds": {gen: s},
    "max": {gen: s}}}."""
    out: dict[str, dict] = {}
    names = {"rollout_gc_collections": "collections", "rollout_gc_pause_seconds": "seconds",
             "rollout_gc_max_pause_seconds": "max"}
    for line in httpx.get(f"{root}/metrics").text.splitlines():
        if not line.startswith("rollout_gc_"):
            continue
        head, value = line.rsplit(" ", 1)
        name, labels = head.split("{", 1)
        fields = dict(kv.split("=", 1) for kv in labels.rstrip("}").split(","))
        proc = out.setdefault(fields["process"].strip('"'), {"collections": {}, "seconds": {}, "max": {}})
        if name == "rollout_gc_frozen_objects":
            proc["frozen"] = float(value)
        elif name in names:
            proc[names[name]][int(fields["generation"].strip('"'))] = float(value)
    return out


def _run(tmp_path, clients: int, seconds: float) -> None:
    model = tiny_checkpoint(tmp_path / "model")
    freeze = os.environ.get("TLT_LOAD_GC_FREEZE", "true").strip().lower() not in ("false", "0", "no", "off")
    with ServeProcess(model, tmp_path, replicas=2, extra=("--set", f"gc_freeze={str(freeze).lower()}")) as server:
        name = httpx.get(f"{server.base_url}/models").json()["data"][0]["id"]
        warm = asyncio.run(_load(server.base_url, name, server.pids, 4, 1.0))  # warm-up (allocator, first steps)
        assert not warm["errors"], warm["errors"][:5]
        res = asyncio.run(_load(server.base_url, name, server.pids, clients, seconds))
        with RolloutClient(f"127.0.0.1:{server.info['grpc_port']}", timeout_s=30) as rc:
            deadline = time.monotonic() + 15
            while True:  # aborted streams are freed; nothing may stay behind
                st = rc.status()
                if all(r.running == 0 and r.queued == 0 for r in st.replicas) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert all(r.alive for r in st.replicas)
        assert all(r.running == 0 and r.queued == 0 for r in st.replicas), st
        assert sum(r.kv_usage for r in st.replicas) == 0.0, "KV blocks leaked by finished or aborted requests"
        gc_seen = _gc(server.base_url.removesuffix("/v1"))

    assert sorted(gc_seen) == ["front", "replica-0", "replica-1"], sorted(gc_seen)
    for proc, g in gc_seen.items():  # a serving process holds ~400,000 objects after startup
        assert (g["frozen"] > 100_000) if freeze else (g["frozen"] == 0), (proc, g["frozen"])
        assert g["collections"][0] > 0, (proc, g)  # the probe counts (every process allocates)
    print("\ngc (gen 2 collections, their seconds, the longest; gen 0+1 seconds): " + "; ".join(
        f"{p} frozen {g['frozen']:.0f}: {g['collections'][2]:.0f}, {g['seconds'][2]:.3f} s, {g['max'][2]:.3f} s; "
        f"{g['seconds'][0] + g['seconds'][1]:.3f} s" for p, g in sorted(gc_seen.items())))

    lat = sorted(res["lat"])
    samples = res["samples"]
    assert not res["errors"], f"{len(res['errors'])} errors, e.g. {res['errors'][:5]}"
    assert res["counts"]["ok"] >= clients, res["counts"]
    p50 = statistics.median(lat)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    rss = [r for _, r in samples]
    quarter = max(1, len(rss) // 4)
    early, late = max(rss[:quarter]), max(rss[-quarter:])
    growth = late - early
    print(f"\nload: {clients} clients x {seconds:.0f}s: {res['counts']['ok']} streams ok, "
          f"{res['counts']['dropped']} dropped by the client, 0 errors; latency p50 {p50 * 1000:.0f} ms, "
          f"p99 {p99 * 1000:.0f} ms; RSS {early / 2**20:.0f} -> {late / 2**20:.0f} MiB "
          f"(server + {len(server.pids) - 1} replicas)")
    assert growth < max(64 * 2**20, 0.10 * early), f"RSS grew by {growth / 2**20:.0f} MiB under steady load"


def test_load_16_clients_8s(tmp_path):
    _run(tmp_path, clients=16, seconds=8)


@pytest.mark.slow
def test_load_64_clients_30s(tmp_path):
    _run(tmp_path, clients=64, seconds=30)
