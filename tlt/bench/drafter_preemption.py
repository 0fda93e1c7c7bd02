"""`tlt bench drafter-preemption`: BUSY event -> device released, over many preemptions.

    tlt bench drafter-preemption [--model DIR] [--preemptions 50] [--out BENCH.json]

A real CapacityPublisher (what the rollout server runs) flips replica 0 IDLE -> BUSY; a real
`tlt drafter worker` process trains on replica 0 in the idle windows (real coordinator, real
features of the model's own greedy samples) and reports for each window the publisher's BUSY
timestamp and the moment it had freed the device. Latency = released - busy (same host clock).
Idle windows last a random 0.1-0.6 s so the BUSY lands at random points of a micro-step. Each window
reported is measured once, the worker's first included (it was left out while the first optimizer's import of
torch._dynamo fell in it; a worker builds one when it starts since, `warm_up_optimizer`); a BUSY whose
window has not come 30 s later adds none, and a run where no window was preempted is an error (exit 1). The
worker starts as `tlt drafter serve` starts its own (services/drafter/serve.py's worker_launch: the config in its
environment); one that exits, or has not joined the coordinator WORKER_JOIN_S after its start, is an error (exit 1).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TypeVar

from tlt.cli_args import at_least, out_file

T = TypeVar("T")
WORKER_JOIN_S = 120.0  # the worker imports torch and loads the model: seconds, more on a loaded host


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="target checkpoint; default: a random tiny Qwen2 built in a temp dir")
    parser.add_argument("--preemptions", type=at_least(1), default=50, help="how many BUSY events to measure")
    parser.add_argument("--batch-rows", type=at_least(1), default=4, help="packed rows per micro-step")
    parser.add_argument("--batch-tokens", type=at_least(8), default=256, help="tokens per packed row")
    parser.add_argument("--out", type=out_file, default=None, help="write the figures as JSON here")


def _new_windows(windows: Iterable[T], last: T | None) -> list[T]:
    """The windows reported after `last` (the newest one already taken; None: none yet), oldest first.

    The coordinator keeps only its last `history` windows, so their count stops growing there: the newest
    one taken, not a count, tells which windows are new."""
    new: list[T] = []
    for w in reversed(list(windows)):  # a copy: the coordinator's threads append to the deque meanwhile
        if w is last:
            break
        new.append(w)
    return new[::-1]


def _worker_gone(proc: object) -> str:
    """'' while the worker runs, else the error line for its exit."""
    rc = proc.poll()  # type: ignore[attr-defined]
    if rc is None:
        return ""
    return f"error: the drafter worker exited with status {rc} (its output is above); nothing to measure"


def _wait_for_worker(proc: object, coord: object) -> str:
    """Wait until the worker joined the coordinator: '' then, else the error line (it exited, or took too long)."""
    import time

    deadline = time.monotonic() + WORKER_JOIN_S
    while not coord.workers:  # type: ignore[attr-defined]
        if gone := _worker_gone(proc):
            return gone
        if time.monotonic() > deadline:
            return (f"error: the drafter worker had not joined the coordinator {WORKER_JOIN_S:.0f} s after its start "
                    "(its output is above); nothing to measure")
        time.sleep(0.1)
    return ""


def run(args: argparse.Namespace) -> int:
    import json
    import random
    import subprocess
    import sys
    import time
    from pathlib import Path

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tlt.bench import scratch_dir
    from tlt.services.common.events import CapacityPublisher
    from tlt.services.drafter.collect import sample_features
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.serve import stop_workers, worker_launch
    from tlt.v1 import common_pb2, events_pb2

    if args.model:
        from tlt.model.folder import check_checkpoint

        check_checkpoint(args.model)  # not a checkpoint: one line, exit 2, before any work
    torch.set_num_threads(1)
    tmp = scratch_dir("tlt-preempt-")
    model_dir = args.model
    if not model_dir:
        from tlt.model.testing import random_checkpoint

        model_dir = str(random_checkpoint(tmp / "model"))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [[int(x) for x in torch.randint(5, 200, (8,), generator=g)] for _ in range(16)]
    samples = sample_features(model, prompts, max_new_tokens=64, window_tokens=args.batch_tokens)
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=1.0)
    cfg = DrafterServiceConfig(capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
                               coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp / "ckpt"),
                               window_tokens=args.batch_tokens, batch_tokens=args.batch_tokens,
                               batch_rows=args.batch_rows, eval_interval_s=3600)
    coord = Coordinator(cfg, model_dir, None, None).start()
    coord.buffer.add_samples(samples)
    busy, idle = common_pb2.REPLICA_STATE_BUSY, common_pb2.REPLICA_STATE_IDLE
    pub.publish(events_pb2.CapacityEvent(replica_id=0, state=busy))
    (cmd,), env = worker_launch(cfg, model_dir, coord.endpoint, [0])
    proc = subprocess.Popen(cmd, env=env)
    rng = random.Random(0)
    lat: list[float] = []
    steps: list[int] = []
    reported = 0  # windows the worker reported
    failed = ""
    try:
        failed = _wait_for_worker(proc, coord)
        last = coord.windows[-1] if coord.windows else None
        for _ in range(0 if failed else args.preemptions):
            pub.publish(events_pb2.CapacityEvent(replica_id=0, state=idle))
            time.sleep(rng.uniform(0.1, 0.6))
            pub.publish(events_pb2.CapacityEvent(replica_id=0, state=busy))
            deadline = time.monotonic() + 30
            new = _new_windows(coord.windows, last)
            while not new and time.monotonic() < deadline and not (failed := _worker_gone(proc)):
                time.sleep(0.005)
                new = _new_windows(coord.windows, last)
            if failed:
                break
            for w in new:  # none when no window came within the deadline: the last one is measured already
                if w.preempted:  # the worker's first window too: it starts warmed up (`warm_up_optimizer`)
                    lat.append(w.released - w.busy_timestamp)
                    steps.append(w.micro_steps)
                reported += 1
            last = new[-1] if new else last
    finally:
        stop_workers([proc])
        coord.close()
        pub.close()
    if failed:
        print(failed, file=sys.stderr)
        return 1
    if not lat:
        print(f"error: no training window was preempted by a BUSY event ({reported} windows reported for "
              f"{args.preemptions} BUSY events); nothing to measure, see the worker's "
              "output above", file=sys.stderr)
        return 1
    ms = np.array(lat) * 1000
    res = {"preemptions": len(lat), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
           "max_ms": float(ms.max()), "mean_steps_per_window": float(np.mean(steps)),
           "batch": f"{args.batch_rows}x{args.batch_tokens}", "model": model_dir,
           "measured": "every preempted window, the worker's first included"}
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
