"""Rollout wall-time overhead of the drafter service (`tlt bench drafter-drift --overhead`).

    rollout server (2 replica processes, capacity events + feature push on) on 127.0.0.1
    rounds of a long-tail greedy batch, timed:  A (no drafter service) x N
                                                B (`tlt drafter serve --workers 2` running) x N
                                                A again x N   (ABA, so machine drift cancels)
    overhead = median(B) / median(A1 + A2) - 1

Between rounds the replicas sit idle for `gap` seconds (the trainer's phase), when the workers
train. The engine runs without speculative decoding here and the coordinator never publishes
(publish_margin is huge): this isolates the cost of training in idle windows, the feature
stream and the capacity events on the rollout.
"""

from __future__ import annotations

import argparse

LONG_TAIL = [48] * 8 + [96, 192, 320, 480]


def _round(client, tag: int) -> float:  # noqa: ANN001
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tlt.v1 import rollout_pb2

    def one(i_m):  # noqa: ANN001, ANN202
        i, m = i_m
        params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        return client.generate([5 + (7 * i + tag) % 90, 17, 33 + i], n=1, params=params)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(LONG_TAIL)) as ex:
        out = [c for cs in ex.map(one, enumerate(LONG_TAIL)) for c in cs]
    assert len(out) == len(LONG_TAIL) and all(not c.error for c in out)
    return time.perf_counter() - t0


def measure_overhead(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import socket
    import statistics
    import subprocess
    import sys
    import tempfile
    import threading
    import time
    from pathlib import Path

    from tlt.services.rollout.client import RolloutClient
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.server import RolloutServer

    tmp = Path(tempfile.mkdtemp(prefix="tlt-overhead-"))
    model_dir = args.model
    if not model_dir:
        from tlt.model.testing import random_checkpoint

        model_dir = str(random_checkpoint(tmp / "m", seed=args.seed))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        feat_port = s.getsockname()[1]
    engine = EngineConfig(max_model_len=512, max_num_seqs=64, num_kv_blocks=512, block_size=16)
    cfg = RolloutConfig(http_port=0, grpc_port=0, replicas=2, threads_per_replica=1, engine=engine,
                        capacity_pub="tcp://127.0.0.1:*", features_push=f"tcp://127.0.0.1:{feat_port}")
    server = RolloutServer(model_dir, cfg)
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(300)
    client = RolloutClient(f"127.0.0.1:{server.grpc_port}", timeout_s=300)
    gap = 3.0
    times: dict[str, list[float]] = {"A1": [], "B": [], "A2": []}
    proc = None
    try:
        _round(client, 0)  # warm-up
        for r in range(args.rounds):
            times["A1"].append(_round(client, r))
            time.sleep(gap)
        ready = tmp / "drafter.json"
        sets = {"capacity_pub": server.capacity.pub_endpoint, "capacity_snapshot": server.capacity.snapshot_endpoint,
                "features_bind": f"tcp://127.0.0.1:{feat_port}", "coordinator_bind": "tcp://127.0.0.1:*",
                "rollout_grpc": f"127.0.0.1:{server.grpc_port}", "status_port": 0, "publish_margin": 1000.0,
                "checkpoint_dir": str(tmp / "ckpt"), "window_tokens": 128, "batch_tokens": 128}
        proc = subprocess.Popen([sys.executable, "-m", "tlt.cli", "drafter", "serve", "--model", model_dir,
                                 "--workers", "2", "--ready-file", str(ready),
                                 *[f"--set={k}={v}" for k, v in sets.items()]],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not ready.exists():
            assert proc.poll() is None, "drafter serve exited"
            time.sleep(0.2)
        time.sleep(15)  # workers up and joined
        for r in range(args.rounds):
            times["B"].append(_round(client, 100 + r))
            time.sleep(gap)
        proc.terminate()
        proc.wait(60)
        proc = None
        time.sleep(2)
        for r in range(args.rounds):
            times["A2"].append(_round(client, 200 + r))
            time.sleep(gap)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    base = statistics.median(times["A1"] + times["A2"])
    with_drafter = statistics.median(times["B"])
    res = {"rounds_per_arm": args.rounds, "median_s_without": round(base, 3), "median_s_with": round(with_drafter, 3),
           "overhead_pct": round(100 * (with_drafter / base - 1), 2),
           "times": {k: [round(x, 3) for x in v] for k, v in times.items()}, "batch_max_tokens": LONG_TAIL}
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
