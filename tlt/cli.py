"""The `tlt` command line.

Every subcommand lives in the module that owns the work; this file only maps
`tlt <group> <name>` to `module:add_arguments` / `module:run` and imports the
module when the command is used (so `tlt --help` stays fast and a command's
heavy imports never slow another). A command module provides:

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...

Command modules keep their top-level imports light (argparse, typing): the
parser imports all of them to collect arguments. Heavy imports (torch,
transformers, grpc) go inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("rollout", "serve")
    module: str
    help: str


COMMANDS: tuple[Command, ...] = (
    Command(("model", "build"), "tlt.model.build", "train the tokenizer and pre-train the tiny model"),
    Command(("model", "eval"), "tlt.model.evaluate", "accuracy and response-length tail of a model on the task"),
    Command(("task", "export"), "tlt.task.export", "write (prompt, answer) JSONL of the synthetic task"),
    Command(("rollout", "serve"), "tlt.services.rollout.serve", "run the rollout server (HTTP + gRPC)"),
    Command(("reward", "serve"), "tlt.services.reward.serve", "run the gRPC reward server"),
    Command(("drafter", "warmup"), "tlt.services.drafter.warmup", "offline warm-up training of the drafter"),
    Command(("drafter", "serve"), "tlt.services.drafter.serve", "run the elastic drafter trainer"),
    Command(("drafter", "worker"), "tlt.services.drafter.worker_main", "run one drafter worker"),
    Command(("drafter", "export"), "tlt.services.drafter.export", "export the drafter for SGLang"),
    Command(("train",), "tlt.services.trainer.train", "run the GRPO trainer against running services"),
    Command(("run",), "tlt.services.trainer.launch", "launch every service locally and train end to end"),
    Command(("bench", "engine"), "tlt.bench.engine", "native engine vs transformers generate"),
    Command(("bench", "rollout"), "tlt.bench.rollout", "long-tail rollout: SD off / static / adaptive / model-free"),
    Command(("bench", "drafter-drift"), "tlt.bench.drafter_drift", "frozen vs online drafter under policy updates"),
    Command(("bench", "drafter-preemption"), "tlt.bench.drafter_preemption", "drafter worker: BUSY event -> device released latency"),
    Command(("bench", "e2e"), "tlt.bench.e2e", "end-to-end TLT vs baseline RL steps"),
    Command(("bench", "kernels"), "tlt.kernels.bench", "Triton kernels vs PyTorch references (CUDA); --compile-only: ptxas report"),
)


def _available(cmd: Command) -> bool:
    try:
        return importlib.util.find_spec(cmd.module) is not None
    except ModuleNotFoundError:  # a parent package (e.g. tlt.bench) does not exist yet
        return False


def build_parser(commands: tuple[Command, ...] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt", description="TLT: fast, lossless RL rollouts for reasoning LLMs")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of readable text")
    parser.add_argument("--log-level", default=None, help="debug, info (default), warning, error")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    top.required = True
    groups: dict[str, argparse._SubParsersAction] = {}
    for cmd in commands:
        if not _available(cmd):
            continue
        if len(cmd.path) == 1:
            sub = top.add_parser(cmd.path[0], help=cmd.help, description=cmd.help)
        else:
            group, name = cmd.path
            if group not in groups:
                gp = top.add_parser(group, help=f"{group} commands")
                groups[group] = gp.add_subparsers(dest=f"{group}_command", metavar="SUBCOMMAND")
                groups[group].required = True
            sub = groups[group].add_parser(name, help=cmd.help, description=cmd.help)
        sub.set_defaults(_command=cmd)
        sub.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        importlib.import_module(cmd.module).add_arguments(sub)
    return parser


def _die_with_parent() -> None:
    """When started by `tlt run` (TLT_DIE_WITH_PARENT=<launcher pid>), exit with the launcher.

    Linux's PR_SET_PDEATHSIG sends SIGTERM when the parent dies, even by kill -9;
    if the launcher already died before we got here, exit at once.
    """
    parent = os.environ.pop("TLT_DIE_WITH_PARENT", "")
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1  # noqa: N806 - the prctl constant's name
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit(f"tlt: the launcher (pid {parent}) is gone; not starting")


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    # OpenMP threads sleep instead of spinning at barriers: on a shared CPU machine spinning threads starve
    # each other (tiny-model training measured 5-10x slower). libgomp reads this when torch is first
    # imported, which may happen while the parser imports command modules, so it is set first.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    from tlt.services.common.logging import configure_logging

    configure_logging(json=True if args.log_json else None, level=args.log_level)
    module = importlib.import_module(args._command.module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
