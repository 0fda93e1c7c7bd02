"""`tlt drafter serve`: the elastic drafter trainer (coordinator + N workers + status gRPC).

    tlt drafter serve --model artifacts/tiny --workers 2 [--preset cpu-tiny] [--set field=value ...]

Runs the coordinator (feature PULL, worker ROUTER, gated publishing to the rollout over
UpdateWeights(kind=drafter), the target's embedding / lm_head refreshed over GetWeights), the
`tlt.v1.Drafter/GetStatus` gRPC server, and starts `--workers` worker processes (`tlt drafter
worker --replica i`, one per rollout replica i). More workers can join later on their own with `tlt drafter worker --coordinator ADDR --replica K`; a worker that
exits or is killed leaves the coordinator and the other workers running, while the workers this command started
exit with it (even after a kill -9: a restarted service starts them again, and they resume their checkpoints). `--ready-file PATH`
writes JSON {pid, status_port, coordinator, features, worker_pids} once serving. SIGINT/SIGTERM
stops the workers (they end their window cleanly) and then the coordinator.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import at_least, out_file

    parser.add_argument("--model", required=True, help="the target (policy) checkpoint folder")
    parser.add_argument("--workers", type=at_least(0), default=1, help="worker processes to start, one per replica 0..N-1")
    parser.add_argument("--preset", default="cpu-tiny", help="config preset name or .toml path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a [drafter] field; repeatable")
    parser.add_argument("--ready-file", type=out_file, default=None,
                        help="write endpoints and pids here as JSON when ready")


WORKER_CONFIG_ENV = "TLT_DRAFTER_WORKER_CONFIG"
WORKER_WATCH_S = 1.0  # how often the service looks for a worker that exited
MAX_WORKER_RESTARTS = 5  # per worker; one that keeps failing (its checkpoint unreadable, a bad device) is left down


def _restart_dead_workers(procs: list, cmds: list, env: dict, restarts: list[int], stop: object) -> None:
    """Start again each worker that exited (a kill -9, the OOM killer, a crash): it resumes from its checkpoint
    (DRAFTER.md). Nothing did: the rollout's idle time went unused for the rest of the run, in silence."""
    import signal
    import subprocess

    from tlt.services.common.logging import get_logger

    log = get_logger("drafter.serve")
    for i, p in enumerate(procs):
        rc = p.poll()
        # stopped on purpose: SIGTERM / SIGINT end its window cleanly (0), or end it while it starts; or the service
        # is stopping. A kill -9 (the OOM killer's) or a crash is restarted.
        on_purpose = rc in (0, -signal.SIGTERM, -signal.SIGINT)
        if rc is None or on_purpose or restarts[i] > MAX_WORKER_RESTARTS or stop.is_set():  # type: ignore[attr-defined]
            continue
        if restarts[i] == MAX_WORKER_RESTARTS:
            restarts[i] += 1
            log.error("worker_left_down", worker=i, rc=rc, restarts=MAX_WORKER_RESTARTS,
                      hint="see its log lines above; the other workers and the coordinator go on")
            continue
        restarts[i] += 1
        try:
            procs[i] = subprocess.Popen(cmds[i], env=env)
        except OSError as e:  # no memory to fork (the OOM that killed it): tried again at the next look
            log.error("worker_restart_failed", worker=i, error=str(e)[:200], restarts=restarts[i])
            continue
        log.warning("worker_restarted", worker=i, rc=rc, pid=procs[i].pid, restarts=restarts[i])


def stop_workers(procs: list) -> None:
    """SIGTERM each worker still running (it ends its window cleanly), then wait; kill one that takes over 30 s."""
    import subprocess

    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def worker_launch(cfg: object, model: str, coordinator: str, replicas: Iterable[int]) -> tuple[list[list[str]], dict]:
    """The argv of one `tlt drafter worker` per replica (worker id = replica) and the environment they all start
    with: `cfg` in WORKER_CONFIG_ENV (not on the command line, which any user of the host reads with `ps`: it holds
    control_token), and TLT_DIE_WITH_PARENT (tlt.cli), so they exit with this process even after a kill -9. What
    `tlt drafter serve` and `tlt bench drafter-preemption` start their workers with."""
    import os

    from tlt.cli import tlt_command

    env = {**os.environ, "TLT_DIE_WITH_PARENT": str(os.getpid()),
           WORKER_CONFIG_ENV: cfg.model_dump_json()}  # type: ignore[attr-defined]
    cmds = [tlt_command("drafter", "worker", "--model", model, "--coordinator", coordinator,
                        "--replica", str(i), "--worker-id", str(i)) for i in replicas]
    return cmds, env


def build_config(preset: str, overrides: list[str], config_json: str = "") -> object:
    from tlt.services.common.config import cli_overrides, load_config
    from tlt.services.drafter.config import DrafterServiceConfig

    if config_json:
        return DrafterServiceConfig.model_validate_json(config_json)
    return load_config(DrafterServiceConfig, "drafter", preset, cli_overrides(overrides), require_section=True)


class StatusService:
    """tlt.v1.Drafter: GetStatus answers the coordinator's status."""

    def __init__(self, coordinator: object) -> None:
        self.coordinator = coordinator

    def GetStatus(self, request: object, context: object) -> object:  # noqa: N802 - gRPC method name
        return self.coordinator.status()  # type: ignore[attr-defined]


def start_status_server(coordinator: object, host: str, port: int) -> tuple[object, int]:
    from concurrent import futures

    import grpc

    from tlt.services.common.ports import bind_grpc
    from tlt.v1 import drafter_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    servicer = type("DrafterServicer", (StatusService, drafter_pb2_grpc.DrafterServicer), {})(coordinator)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = bind_grpc(server, host, port, "the drafter status gRPC server")
    server.start()
    return server, bound


def rollout_publisher(address: str, token: str):  # noqa: ANN201
    """A function that pushes the drafter's own tensors to every replica of the rollout at `address`."""
    from tlt.services.rollout.client import RolloutClient

    def publish(tensors: dict, version: int) -> None:
        leaked = [k for k in tensors if "embed" in k or "lm_head" in k]
        assert not leaked, f"a drafter push must never carry the target's embedding/lm_head: {leaked}"
        with RolloutClient(address, control_token=token, timeout_s=120) as client:
            client.update_weights(tensors, "drafter", version)

    return publish


def run(args: argparse.Namespace) -> int:
    import contextlib
    import os
    import subprocess
    import threading

    from tlt.model.folder import check_checkpoint
    from tlt.services.common.logging import get_logger
    from tlt.services.common.signals import set_on_signals

    log = get_logger("drafter.serve")
    cfg = build_config(args.preset, args.overrides)
    check_checkpoint(args.model, tokenizer=False)  # not a checkpoint: one line, exit 2, before torch loads
    from tlt.services.common.events import FeaturePuller
    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.shared import rollout_fetch

    restore = None  # puts the signal handlers back, last: a second Ctrl-C does not cut the workers' stop short
    try:
        with contextlib.ExitStack() as up:  # what is up goes down again, in reverse, when a later step fails too
            puller = FeaturePuller(cfg.features_bind, token=cfg.control_token)  # type: ignore[attr-defined]
            up.callback(puller.close)
            fetch = rollout_fetch(args.model, cfg.rollout_grpc, cfg.control_token)  # type: ignore[attr-defined]
            publish = rollout_publisher(cfg.rollout_grpc, cfg.control_token)  # type: ignore[attr-defined]
            coordinator = Coordinator(cfg, args.model, puller, publish, fetch)  # type: ignore[arg-type]
            up.callback(coordinator.close)  # (its threads, its binds: left running by a failed start in-process)
            coordinator.start()
            server, port = start_status_server(coordinator, cfg.host, cfg.status_port)  # type: ignore[attr-defined]
            up.callback(lambda: server.stop(grace=1).wait())  # type: ignore[attr-defined]
            if cfg.metrics_port:  # type: ignore[attr-defined]
                up.callback(coordinator.metrics.serve(cfg.metrics_port, cfg.host).close)  # type: ignore[attr-defined]
            # The workers exit with this process, even when it is killed with -9 (tlt.cli's TLT_DIE_WITH_PARENT):
            # left running, they met the restarted service's new workers, two per replica under one id and checkpoint
            # file. The resolved config goes in the environment, not on the command line (worker_launch).
            cmds, env = worker_launch(cfg, args.model, coordinator.endpoint, range(args.workers))
            procs: list[subprocess.Popen] = []
            up.callback(stop_workers, procs)  # the list: a restarted worker takes its place in it
            procs.extend(subprocess.Popen(cmd, env=env) for cmd in cmds)
            if cfg.threads:  # type: ignore[attr-defined]
                import torch

                torch.set_num_threads(cfg.threads)  # type: ignore[attr-defined]  # the gate's evaluations: one core
            if cfg.coordinator_nice:  # type: ignore[attr-defined]
                os.nice(cfg.coordinator_nice)  # type: ignore[attr-defined]  # after the workers: they keep normal
            stop = threading.Event()
            restore = set_on_signals(stop)  # not stop.set() in a handler: it could deadlock (common/signals.py)
            if args.ready_file:
                from tlt.services.common.ready import write_ready_file

                write_ready_file(args.ready_file, {"pid": os.getpid(), "status_port": port,
                                                   "coordinator": coordinator.endpoint, "features": puller.endpoint,
                                                   "worker_pids": [p.pid for p in procs]})
            log.info("drafter_serving", status=f"{cfg.host}:{port}",  # type: ignore[attr-defined]
                     coordinator=coordinator.endpoint, features=puller.endpoint, workers=len(procs))
            restarts = [0] * len(procs)
            while not stop.wait(WORKER_WATCH_S):
                _restart_dead_workers(procs, cmds, env, restarts, stop)
            log.info("drafter_stopping")
    finally:
        if restore is not None:
            restore()
    return 0
