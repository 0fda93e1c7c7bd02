"""Rollout wall-time overhead of the drafter service (`tlt bench drafter-drift --overhead`).

    rollout server (2 replica processes, capacity events + feature push on) on 127.0.0.1
    `tlt drafter serve --workers 2` started once, in its own process group
    --rounds R pairs of timed rounds of a long-tail greedy batch, each pair A then B or B then A
    (alternating, so a steady drift of the machine's speed cancels within the pairs):
        A: the drafter service is stopped (SIGSTOP to its process group: it takes no CPU at all,
           as if it were not running) during the idle gap before the round and during the round
        B: it runs (SIGCONT): its workers train in the idle gap before the round (the replicas are
           IDLE, as in the trainer's phase of an RL step), are preempted when the round makes the
           replicas BUSY, and the coordinator ingests the round's features
    overhead = median over pairs of (B / A) - 1, with the order-statistic 95% interval of that median

Pairs of adjacent rounds measure the difference B - A where it is: rounds a few seconds apart on
the same server, the same processes and the same memory. The earlier design (A x N, then B x N,
then A x N, with the service started and stopped between the phases) could not resolve 2%: its two
A phases differed by 10% from each other.

Each round: `gap` seconds idle, then the batch (max_tokens 8 x 48 and 96, 192, 320, 480, eos
ignored, greedy; sent 5 ms apart in that order, so the replicas get the same shares every round) on
3-token prompts. Both rounds of a pair decode the same prompts (the pair's index picks them), so B / A
compares the same work: the engine runs the rollout config's default SD, the adaptive n-gram drafter,
whose steps per round depend on the text (108 to 205 engine steps over six prompt sets of this batch
on artifacts/tiny); pairs differ among themselves. A prompt fits inside one KV block, so a pair's
second round never hits its first round's prefix cache (only full prompt blocks are shared). The
coordinator never publishes (publish_margin is huge), which isolates the cost of training in idle
windows, the feature stream and the capacity events on the rollout. The report also gives how many
windows and micro-steps the workers trained (read from the drafter's GetStatus), so a B arm that
trained nothing shows, and the mean CPU seconds per round of the replicas, the coordinator and the
workers in each arm (Linux /proc): where an overhead comes from (a drafter process taking a
replica's CPU, or replicas needing more CPU for the same work because something beside them
thrashes the shared caches).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

LONG_TAIL = [48] * 8 + [96, 192, 320, 480]
BLOCK_SIZE = 16  # the replicas' KV block: a prompt of at most this many tokens has no block to share


def prompts(pair: int) -> list[list[int]]:
    """The batch's prompts in pair `pair` of rounds (-1: the warm-up round), one per LONG_TAIL entry.

    Both rounds of a pair decode these (with SD the steps a round takes depend on the text), and the
    pairs differ among themselves (90 distinct sets), so no one prompt set decides the overhead."""
    return [[5 + (7 * i + pair + 1) % 90, 17, 33 + i] for i in range(len(LONG_TAIL))]


def paired_rounds(pairs: int, run_round: Callable[[str, list[list[int]]], float]) -> dict[str, list[float]]:
    """Seconds of each arm's round in `pairs` pairs: `run_round(arm, prompts)` times one round of `arm`.

    Pair r runs A then B for even r, B then A for odd r (a steady drift of the machine's speed cancels
    within the pairs), both on `prompts(r)`."""
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(pairs):
        batch = prompts(r)
        for arm in ("A", "B") if r % 2 == 0 else ("B", "A"):
            times[arm].append(run_round(arm, batch))
    return times


def _round(client, batch: list[list[int]]) -> float:  # noqa: ANN001
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tlt.v1 import rollout_pb2

    def one(i_m):  # noqa: ANN001, ANN202
        i, m = i_m
        # arrive in a fixed order, so least-loaded routing splits the batch the same way every round (at
        # random arrival the two longest could share a replica, which alone moved rounds by +-50%)
        time.sleep(0.005 * i)
        params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        return client.generate(batch[i], n=1, params=params)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(LONG_TAIL)) as ex:
        out = [c for cs in ex.map(one, enumerate(LONG_TAIL)) for c in cs]
    assert len(out) == len(LONG_TAIL) and all(not c.error for c in out)
    return time.perf_counter() - t0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc; 0 when it is gone)."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pool_overhead(paths: list[str]) -> int:
    """`--pool`: the overhead over the pairs of several `--overhead --out` files together (runs of the same command:
    one run's 40 pairs give an interval of +-2-3% on a 2-core machine, too wide for a 2% target)."""
    import json
    import sys
    from pathlib import Path

    without: list[float] = []
    with_: list[float] = []
    for path in paths:
        try:
            times = json.loads(Path(path).read_text())["times"]
            a, b = list(times["A"]), list(times["B"])
            if len(a) != len(b):
                raise ValueError(f"{len(a)} rounds without, {len(b)} with")
            if not a:
                raise ValueError("no rounds")
            bad = next((t for t in a + b if isinstance(t, bool) or not isinstance(t, (int, float))
                        or not math.isfinite(t) or t <= 0), None)
            if bad is not None:  # a ratio needs positive seconds on both sides (0 divided, text raised in it)
                raise ValueError(f"a round time of {bad!r}; every round takes a positive number of seconds")
            without += a
            with_ += b
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: {path} is not the JSON of `tlt bench drafter-drift --overhead --out`: {e!r}", file=sys.stderr)
            return 2
    print(json.dumps({"files": paths, "pairs": len(without), **overhead_summary(without, with_)}, indent=2))
    return 0


def overhead_summary(without: list[float], with_: list[float]) -> dict[str, float | list[float]]:
    """Paired round times -> the overhead in percent: the median over pairs of with / without - 1, and its
    order-statistic 95% interval."""
    import statistics

    ratios = [b / a for a, b in zip(without, with_, strict=True)]
    lo, hi = median_interval(ratios) or (float("nan"), float("nan"))
    return {"overhead_pct": round(100 * (statistics.median(ratios) - 1), 2),
            "overhead_pct_95": [round(100 * (lo - 1), 2), round(100 * (hi - 1), 2)]}


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Distribution-free interval for the median of `values`: the order statistics x_(k) and x_(n+1-k)
    with the largest k such that P(Binomial(n, 1/2) < k) <= (1 - level) / 2. None when n is too small
    for any such interval (n < 6 at 95%)."""
    xs, n = sorted(values), len(values)
    tail, k, cdf = (1 - level) / 2, 0, 0.0
    while k < n:
        nxt = cdf + math.comb(n, k) / 2**n  # P(Bin <= k) = P(Bin < k + 1)
        if nxt > tail:
            break
        cdf, k = nxt, k + 1
    return None if k == 0 else (xs[k - 1], xs[n - k])


def measure_overhead(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os
    import signal
    import statistics
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    import grpc

    from tlt.bench import scratch_dir
    from tlt.cli import tlt_command
    from tlt.services.common.ports import free_port
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.server import RolloutServer
    from tlt.v1 import drafter_pb2, drafter_pb2_grpc

    if args.rounds < 6:
        print(f"error: --overhead needs --rounds >= 6 pairs for a 95% interval, got {args.rounds}", file=sys.stderr)
        return 2
    tmp = scratch_dir("tlt-overhead-")
    model_dir = args.model
    if not model_dir:
        from tlt.model.testing import random_checkpoint

        model_dir = str(random_checkpoint(tmp / "m", seed=args.seed))
    feat_port = free_port()  # below the ephemeral range: no client connection takes it before the replicas bind
    from tlt.model.folder import read_model_config
    from tlt.services.rollout.engine.config import context_limit

    engine = EngineConfig(max_model_len=min(512, context_limit(0, read_model_config(model_dir))), max_num_seqs=64,
                          num_kv_blocks=512, block_size=BLOCK_SIZE)
    cfg = RolloutConfig(http_port=0, grpc_port=0, replicas=2, threads_per_replica=1, engine=engine,
                        capacity_pub="tcp://127.0.0.1:*", features_push=f"tcp://127.0.0.1:{feat_port}")
    server = RolloutServer(model_dir, cfg)
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(300)
    client = RolloutClient(f"127.0.0.1:{server.grpc_port}", timeout_s=300)
    gap = 3.0
    cpu: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    proc, status = None, None
    try:
        ready = tmp / "drafter.json"
        sets = {"capacity_pub": server.capacity.pub_endpoint, "capacity_snapshot": server.capacity.snapshot_endpoint,
                "features_bind": f"tcp://127.0.0.1:{feat_port}", "coordinator_bind": "tcp://127.0.0.1:*",
                "rollout_grpc": f"127.0.0.1:{server.grpc_port}", "status_port": 0, "publish_margin": 1000.0,
                "checkpoint_dir": str(tmp / "ckpt"), "window_tokens": 128, "batch_tokens": 128}
        proc = subprocess.Popen(tlt_command("drafter", "serve", "--model", model_dir,
                                             "--workers", "2", "--ready-file", str(ready),
                                             *[f"--set={k}={v}" for k, v in sets.items()],
                                             *[f"--set={kv}" for kv in getattr(args, "drafter_sets", [])]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        while not ready.exists():
            assert proc.poll() is None, "drafter serve exited"
            time.sleep(0.2)
        ready_info = json.loads(ready.read_text())
        status_port = ready_info["status_port"]
        who = {"replicas": [r.process.pid for r in server.pool.replicas], "coordinator": [ready_info["pid"]],
               "workers": ready_info["worker_pids"]}
        _round(client, prompts(-1))  # warm-up: the engine, and features for the workers' buffer
        time.sleep(15)  # workers up, joined, and trained once
        group = proc.pid  # the drafter service's process group

        def timed(arm: str, batch: list[list[int]]) -> float:
            os.killpg(group, signal.SIGSTOP if arm == "A" else signal.SIGCONT)
            time.sleep(gap)  # the idle gap before the round: B's workers train in it
            before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in who.items()}
            seconds = _round(client, batch)
            for k, pids in who.items():  # CPU seconds each part used during the round
                cpu[arm].setdefault(k, []).append(sum(cpu_seconds(p) for p in pids) - before[k])
            return seconds

        times = paired_rounds(args.rounds, timed)
        os.killpg(proc.pid, signal.SIGCONT)
        with grpc.insecure_channel(f"127.0.0.1:{status_port}") as ch:
            status = drafter_pb2_grpc.DrafterStub(ch).GetStatus(drafter_pb2.DrafterStatusRequest(), timeout=30)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a serve that did not stop them
            except ProcessLookupError:
                pass
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    res = {"pairs": args.rounds, "gap_s": gap, "model": model_dir, "drafter_sets": getattr(args, "drafter_sets", []),
           "median_s_without": round(statistics.median(times["A"]), 3),
           "median_s_with": round(statistics.median(times["B"]), 3),
           **overhead_summary(times["A"], times["B"]),
           "training_windows": len(status.windows) if status else None,
           "micro_steps": sum(w.micro_steps for w in status.workers) if status else None,
           "preemptions": status.preemptions if status else None,
           # mean CPU seconds per round of the replicas, the coordinator and the workers, without (A) and with (B)
           "cpu_s_per_round": {arm: {k: round(statistics.mean(v), 3) for k, v in parts.items()} for arm, parts in cpu.items()},
           "times": {k: [round(x, 3) for x in v] for k, v in times.items()}, "batch_max_tokens": LONG_TAIL}
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
