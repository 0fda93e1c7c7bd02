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
    # True: one process that has the machine's cores to itself (the model build, the drafter warm-up).
    # Its OpenMP threads keep libgomp's default wait (spin briefly at a barrier, then sleep): the tiny
    # build ran 1.66x faster that way on 2 idle cores (BENCHMARKS.md, "Tiny model build"). Every other
    # command shares the cores with other processes and waits passively (see `omp_wait_policy`).
    owns_cores: bool = False


def tlt_command(*args: str) -> list[str]:
    """The argv that runs `tlt ARGS` in a child: this interpreter (works without the venv's bin on PATH), with -P
    when this process keeps the current folder off sys.path (`python -P`, or the `tlt` console script, whose
    sys.path starts with its bin folder). `python -m` would put that folder first in the child, and beside a
    checkout the child would import its ./tlt instead of the installed copy, which lacks the services/ and kernels/
    that setup.py maps under `tlt` (session 31: `tlt bench e2e` on the GPU found no `run`). Every process the package
    starts from `tlt` goes through here (tests/test_child_commands.py)."""
    here = {"", ".", os.getcwd()}
    safe = sys.flags.safe_path or not any(p in here for p in sys.path)
    return [sys.executable, *(["-P"] if safe else []), "-m", "tlt.cli", *args]


COMMANDS: tuple[Command, ...] = (
    Command(("model", "build"), "tlt.model.build", "train the tokenizer and pre-train the tiny model", owns_cores=True),
    Command(("model", "eval"), "tlt.model.evaluate", "accuracy and response-length tail of a model on the task",
            owns_cores=True),
    Command(("task", "export"), "tlt.task.export", "write (prompt, answer) JSONL of the synthetic task"),
    Command(("rollout", "serve"), "tlt.services.rollout.serve", "run the rollout server (HTTP + gRPC)"),
    Command(("reward", "serve"), "tlt.services.reward.serve", "run the gRPC reward server"),
    Command(("drafter", "warmup"), "tlt.services.drafter.warmup", "offline warm-up training of the drafter",
            owns_cores=True),
    Command(("drafter", "serve"), "tlt.services.drafter.serve", "run the elastic drafter trainer"),
    Command(("drafter", "worker"), "tlt.services.drafter.worker_main", "run one drafter worker"),
    Command(("drafter", "export"), "tlt.services.drafter.export",
            "export a drafter (or a run's online one) for SGLang or as a drafter folder"),
    Command(("train",), "tlt.services.trainer.train", "run the GRPO trainer against running services"),
    Command(("run",), "tlt.services.trainer.launch", "launch every service locally and train end to end"),
    Command(("config", "show"), "tlt.services.common.config_show",
            "every field of a preset's sections as TOML, with its description and where its value comes from"),
    Command(("config", "check"), "tlt.services.common.config_check", "validate every section of a preset file"),
    Command(("data", "check"), "tlt.services.trainer.data_check",
            "read a prompt file as the trainer will and measure it against the rollout's context"),
    Command(("report",), "tlt.services.trainer.report", "(re)write a run folder's report.html and plots"),
    Command(("bench", "engine"), "tlt.bench.engine", "native engine vs transformers generate"),
    Command(("bench", "rollout"), "tlt.bench.rollout", "long-tail rollout: SD off / static / adaptive / model-free"),
    Command(("bench", "drafter-drift"), "tlt.bench.drafter_drift", "frozen vs online drafter under policy updates"),
    Command(("bench", "drafter-preemption"), "tlt.bench.drafter_preemption", "drafter worker: BUSY event -> device released latency"),
    Command(("bench", "e2e"), "tlt.bench.e2e", "end-to-end TLT vs baseline RL steps"),
    Command(("bench", "ngram"), "tlt.bench.ngram_host", "model-free drafter: host time per speculative step"),
    Command(("bench", "kernels"), "tlt.kernels.bench", "Triton kernels vs PyTorch references (CUDA); --compile-only: ptxas report"),
)


def _available(cmd: Command) -> bool:
    try:
        return importlib.util.find_spec(cmd.module) is not None
    except ModuleNotFoundError:  # a parent package (e.g. tlt.bench) does not exist yet
        return False


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default after its help, unless the help already speaks of one or there is none to show
    (None, off, empty): `--n N  held-out problems` left the user to guess how many."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or text == argparse.SUPPRESS
                or default is None or default is False or default is argparse.SUPPRESS or default in ("", [])):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tlt")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser(commands: tuple[Command, ...] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt", description="TLT: fast, lossless RL rollouts for reasoning LLMs")
    parser.add_argument("--version", action="version", version=f"tlt {_version()}")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of readable text")
    parser.add_argument("--log-level", default=None, help="debug, info (default), warning, error")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    top.required = True
    groups: dict[str, argparse._SubParsersAction] = {}
    for cmd in commands:
        if not _available(cmd):
            continue
        if len(cmd.path) == 1:
            sub = top.add_parser(cmd.path[0], help=cmd.help, description=cmd.help, formatter_class=_HelpFormatter)
        else:
            group, name = cmd.path
            if group not in groups:
                gp = top.add_parser(group, help=f"{group} commands")
                groups[group] = gp.add_subparsers(dest=f"{group}_command", metavar="SUBCOMMAND")
                groups[group].required = True
            sub = groups[group].add_parser(name, help=cmd.help, description=cmd.help,
                                           formatter_class=_HelpFormatter)
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


# Top-level options that take a value (`tlt --log-level debug model build`): skipped with it.
_VALUE_OPTIONS = ("--log-level",)


def command_for(argv: list[str], commands: tuple[Command, ...] = COMMANDS) -> Command | None:
    """The command `argv` names (its first positional words), or None."""
    words: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _VALUE_OPTIONS:
            skip = True
        elif not a.startswith("-"):
            words.append(a)
        if len(words) == 2:
            break
    for cmd in commands:
        if list(cmd.path) == words[: len(cmd.path)]:
            return cmd
    return None


def omp_wait_policy(cmd: Command | None, environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The OMP_WAIT_POLICY to set for `cmd`, or None to leave the environment as it is.

    The caller's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins. Otherwise commands that share the
    cores with other processes (servers, `tlt run`, benches) wait passively: threads that spin at
    OpenMP barriers starve the other processes' threads (measured in `tlt run`: the policy update took
    2.6-43 s with spinning trainer threads, 1.4-3.3 s passive). `owns_cores` commands keep libgomp's
    default. On a machine shared with other jobs, set OMP_WAIT_POLICY=PASSIVE for those too.
    """
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    return None if cmd is not None and cmd.owns_cores else "PASSIVE"


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    # libgomp reads OMP_WAIT_POLICY when torch is first imported, which may happen while the parser
    # imports command modules, so it is decided from the raw arguments first.
    policy = omp_wait_policy(command_for(sys.argv[1:] if argv is None else argv), os.environ)
    if policy is not None:
        os.environ["OMP_WAIT_POLICY"] = policy
    parser = build_parser()
    args = parser.parse_args(argv)
    from tlt.services.common.logging import configure_logging

    try:
        configure_logging(json=True if args.log_json else None, level=args.log_level)
    except ValueError as e:  # an unknown level from --log-level or TLT_LOG_LEVEL: a usage error, exit 2
        parser.error(f"{e} (--log-level or TLT_LOG_LEVEL)")
    from tlt.services.common.config import unknown_environment
    from tlt.services.common.logging import get_logger

    for problem in unknown_environment(os.environ):  # a misspelt TLT_* variable configured nothing, silently
        get_logger("tlt").warning("unknown_environment", problem=problem)
    if getattr(args, "ready_file", None):  # a server's: one left by an earlier run names its dead ports and pids
        from pathlib import Path

        Path(args.ready_file).unlink(missing_ok=True)
    module = importlib.import_module(args._command.module)
    from tlt.services.common.config import ConfigError
    from tlt.services.common.ports import PortInUseError

    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C in a command that does not handle it (model build, model eval): the
        # command's own cleanup ran as the exception unwound it; a traceback would only hide this line
        get_logger("tlt").warning("interrupted", command=" ".join(args._command.path))
        return 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended
    except Exception as e:  # the user's to fix, and the message says how: one line, no traceback
        event = _user_error(e, {ConfigError: "bad_config", PortInUseError: "port_in_use"})
        if event is None:
            raise
        from tlt.services.common.logging import get_logger

        error = str(e)
        if type(e).__name__ == "SafetensorError":  # its message names no file
            error = f"a .safetensors weight file this command read is not readable ({e}); copy or write it again"
        get_logger("tlt").error(event, error=error, command=" ".join(args._command.path))
        return 2


# Errors about a folder the user named (not a checkpoint, not a drafter, tensors that do not fit), by the module
# that defines them: looked up only when the command imported it, so `tlt` itself does not import torch.
_FOLDER_ERRORS = (("tlt.model.folder", "CheckpointError"), ("tlt.model.drafter", "DrafterError"),
                  ("safetensors", "SafetensorError"))  # a weight file cut short, read through transformers


def _user_error(e: Exception, known: dict[type, str]) -> str | None:
    """The log event for an error the user is to fix, or None for a bug (which keeps its traceback)."""
    for cls, event in known.items():
        if isinstance(e, cls):
            return event
    for module, name in _FOLDER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return "bad_checkpoint"
    return None


if __name__ == "__main__":
    sys.exit(main())
