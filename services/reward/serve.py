"""`tlt reward serve`: run the gRPC reward server (tlt.v1.Reward) until SIGINT / SIGTERM.

    tlt reward serve --kind math --port 50061 [--host 127.0.0.1] [--workers N]
    tlt reward serve --function my_rewards:accuracy --port 50061     # kind python: your TRL-style function

Config: the [reward] section of the preset (default cpu-tiny), then
TLT_REWARD__* environment variables, then `--set field=value`, then the
explicit flags. `--port 0` picks a free port; `--ready-file PATH` writes JSON
{port, pid} once serving. On SIGTERM the server refuses new calls, lets
in-flight ones finish for `grace_s`, and exits 0.

`--function module:function` (or `[reward] kind = "python"` with `function`)
serves a TRL-style `f(prompts, completions, **kw) -> list[float]`, called per
item with one-element lists (services/reward/function.py). It is loaded before
the port is bound: a module that cannot be found or a name that is not
callable exits 2 with one line. It is called from `workers` threads at once:
it must be thread-safe, or pass `--workers 1`.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import out_file

    parser.add_argument("--kind", default=None, help="reward kind: math (the built-in verifier) or python")
    parser.add_argument("--function", default=None, metavar="MODULE:FUNCTION",
                        help="serve a TRL-style reward function f(prompts, completions, **kw) -> list[float], "
                        "called per item (implies --kind python; the module on PYTHONPATH or in the current "
                        "directory; it must be thread-safe, or pass --workers 1)")
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="gRPC port (default 50061; 0: a free one)")
    parser.add_argument("--workers", type=int, default=None, help="threads scoring items concurrently")
    parser.add_argument("--preset", default="cpu-tiny", help="config preset name or .toml path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a [reward] field; repeatable")
    parser.add_argument("--ready-file", type=out_file, default=None,
                        help="write the bound port and pid here as JSON when ready")


def build_config(args: argparse.Namespace) -> object:
    from tlt.services.common.config import cli_overrides, load_config
    from tlt.services.reward.config import RewardConfig

    overrides = cli_overrides(args.overrides)
    if args.function is not None and args.kind is None:
        overrides["kind"] = "python"
    for field in ("kind", "function", "host", "port", "workers"):
        if getattr(args, field) is not None:
            overrides[field] = getattr(args, field)
    return load_config(RewardConfig, "reward", args.preset, overrides, require_section=True)


def _serve_metrics(server: object, config: object) -> object:
    """The /metrics exporter on `metrics_port`, or None (0); a port it cannot bind is PortInUseError: one
    port_in_use line and exit 2 (tlt.cli), as for the gRPC port (an OSError traceback, exit 1, before)."""
    from tlt.services.common.ports import PortInUseError, in_use_message

    if not config.metrics_port:
        return None
    try:
        return server.metrics.serve(config.metrics_port, host=config.host)
    except OSError as e:
        what = in_use_message("the reward metrics exporter (metrics_port)", config.host, config.metrics_port)
        raise PortInUseError(f"{what} ({e.strerror})") from None


def run(args: argparse.Namespace) -> int:
    import os
    import threading

    from tlt.services.common.logging import get_logger
    from tlt.services.common.signals import set_on_signals
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer

    from tlt.services.common.config import ConfigError

    log = get_logger("reward.serve")
    try:
        config = build_config(args)
    except ConfigError as e:
        log.error("bad_config", error=str(e))
        return 2
    assert isinstance(config, RewardConfig)
    from tlt.services.trainer.rewards import RewardFunctionError

    try:
        server = RewardServer(config)  # kind python: the function is loaded here, before the port is bound
    except RewardFunctionError as e:
        log.error("bad_reward_function", error=str(e))
        return 2
    exporter = None
    try:
        exporter = _serve_metrics(server, config)  # before the gRPC port: a taken one is one line, nothing served yet
        server.start()
    except BaseException:
        server.servicer.pool.shutdown()  # never served: its scoring threads end (in-process, they were left running)
        if exporter is not None:
            exporter.close()
        raise
    stop = threading.Event()
    # only once serving: a server that could not start left its handlers (in-process, Ctrl-C then did nothing)
    restore = set_on_signals(stop)  # not stop.set() in a handler: it could deadlock the main thread (signals.py)
    try:
        if exporter is not None:
            log.info("reward_metrics", port=exporter.port)
        if args.ready_file:
            from tlt.services.common.ready import write_ready_file

            write_ready_file(args.ready_file, {"port": server.port, "pid": os.getpid()})
        while not stop.wait(1.0):
            pass
        log.info("reward_stopping", grace_s=config.grace_s)
    finally:
        server.stop()
        if exporter is not None:
            exporter.close()
        restore()
    stuck = server.stuck_calls()
    if stuck:  # interpreter exit would join their threads for ever: the process stayed alive after its stop
        log.warning("reward_calls_abandoned", calls=stuck, reason="still running after the grace period")
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
