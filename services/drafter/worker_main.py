"""`tlt drafter worker`: one elastic drafter worker, joining a running coordinator.

    tlt drafter worker --model artifacts/tiny --coordinator tcp://127.0.0.1:5704 --replica 1

Trains only while rollout replica `--replica` is IDLE (capacity events from the [drafter]
capacity_pub / capacity_snapshot endpoints), trains with the embedding and lm_head of the policy
the rollout serves (fetched from [drafter] rollout_grpc after a policy update), resumes from `<checkpoint_dir>/worker-<id>.pt`, and
ends its window cleanly on SIGINT/SIGTERM. `tlt drafter serve --workers N` starts these for you.
"""

from __future__ import annotations

import argparse
import os


def _coordinator(text: str) -> str:
    """argparse `type` of --coordinator: a ZeroMQ endpoint to connect to. '' or 'foo' was taken, and the worker
    waited for its rollout forever (or failed with a ZMQError traceback once the rollout was up)."""
    from tlt.services.common.config_values import zmq_endpoint_problem

    problem = zmq_endpoint_problem(text, bind=False)
    if problem is None and text.startswith("inproc://"):  # this command is a process of its own: it waited forever
        problem = (f"{text!r} reaches only sockets inside one process, and a worker is a process of its own; "
                   "give the coordinator's tcp://HOST:PORT or ipc://PATH")
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import at_least

    parser.add_argument("--model", required=True, help="the target (policy) checkpoint folder")
    parser.add_argument("--coordinator", type=_coordinator, required=True,
                        help="coordinator endpoint, e.g. tcp://127.0.0.1:5704 (tcp://HOST:PORT or ipc://PATH)")
    parser.add_argument("--replica", type=at_least(0), required=True, help="the rollout replica whose idle time to use")
    parser.add_argument("--worker-id", type=at_least(0), default=None, help="stable id (checkpoint name); default: --replica")
    parser.add_argument("--preset", default="cpu-tiny", help="config preset name or .toml path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a [drafter] field; repeatable")


def run(args: argparse.Namespace) -> int:
    import threading

    from tlt.services.common.logging import configure_logging
    from tlt.services.common.signals import set_on_signals
    from tlt.services.drafter.serve import WORKER_CONFIG_ENV, build_config
    from tlt.services.drafter.shared import rollout_fetch
    from tlt.services.drafter.worker import DrafterWorker

    worker_id = args.replica if args.worker_id is None else args.worker_id
    configure_logging(service=f"drafter-worker-{worker_id}")
    # a worker `tlt drafter serve` started: the service's resolved config, from the environment (WORKER_CONFIG_ENV)
    config_json = os.environ.pop(WORKER_CONFIG_ENV, "")
    service = os.getppid() if config_json else 0  # until the handlers below, its death's SIGTERM ends this at once
    cfg = build_config(args.preset, args.overrides, config_json)
    fetch = rollout_fetch(args.model, cfg.rollout_grpc, cfg.control_token)  # type: ignore[attr-defined]
    worker = DrafterWorker(cfg, args.model, worker_id, args.replica, args.coordinator, fetch)  # type: ignore[arg-type]
    if service:
        threading.Thread(target=_exit_with_service, args=(service, worker), name="exit-with-service",
                         daemon=True).start()
    # Only now a signal asks for a clean stop: until here the worker has read files and holds nothing to save, and
    # SIGTERM's default (its parent's death, TLT_DIE_WITH_PARENT) ends it at once instead of after the start-up.
    stop = threading.Event()
    restore = set_on_signals(stop)  # not stop.set() in a handler: it could deadlock the main thread (common/signals.py)
    try:
        worker.run(stop)
    finally:
        worker.close()
        restore()  # in a process that goes on (tlt.cli.main in a test), its Ctrl-C and SIGTERM are its own again
    return 0


SERVICE_WATCH_S = 0.2  # how often a worker of `tlt drafter serve` looks whether the service still lives


def _exit_with_service(service: int, worker: object) -> None:
    """Exit at once when `tlt drafter serve` (pid `service`), this worker's parent, has died (a kill -9, the OOM
    killer). Its death's SIGTERM (TLT_DIE_WITH_PARENT) asks for the clean stop, which talks to the service's own
    coordinator: dead, it waited ~10 s for the window's report and ~10 s for the final flush, long enough for a
    restarted service's new worker for the same replica to come up beside this one. What the worker has not sent
    is lost, as in a kill -9 of the worker (it resumes from its checkpoint); a checkpoint being written is finished
    first (the write is atomic anyway: a rename)."""
    import time

    from tlt.services.common.logging import get_logger

    while os.getppid() == service:
        time.sleep(SERVICE_WATCH_S)
    get_logger("drafter.worker").warning("worker_parent_gone", worker=worker.worker_id,  # type: ignore[attr-defined]
                                         service_pid=service, detail="its drafter serve died: exiting, sending nothing")
    worker.checkpoint_lock.acquire(timeout=30)  # type: ignore[attr-defined]
    os._exit(0)
