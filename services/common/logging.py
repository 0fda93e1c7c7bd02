"""structlog set-up shared by every service: readable console by default, JSON with a flag.

    from tlt.services.common.logging import configure_logging, get_logger
    configure_logging(json=False, level="info")
    log = get_logger("rollout"); log.info("replica_started", replica=0)

`TLT_LOG_JSON=1` and `TLT_LOG_LEVEL=debug` set the same from the environment,
so child processes started by `tlt run` inherit the choice.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _StderrLogger:
    """Writes each line to whatever `sys.stderr` is *now*.

    structlog's PrintLogger keeps the stream it was created with; when that
    stream is later replaced and closed (pytest's per-test capture, a daemon
    redirecting its output), every log call would raise. Looking the stream
    up per line costs nothing and never writes to a closed file.
    """

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg

    @staticmethod
    def factory(*_args: object) -> "_StderrLogger":
        return _StderrLogger()


class _ReadableRenderer:
    """structlog's ConsoleRenderer, except for a string value of several lines (a refusal naming each bad field on
    its own line): the log line keeps its first line and the others follow it as they are, indented, where the
    console renderer printed the whole value as one repr with a literal '\\n' between the lines."""

    def __init__(self, colors: bool) -> None:
        self._console = structlog.dev.ConsoleRenderer(colors=colors)

    def __call__(self, logger: object, name: str, event_dict: structlog.typing.EventDict) -> str:
        below: list[str] = []
        for key, value in list(event_dict.items()):
            if key not in ("event", "exception", "stack") and isinstance(value, str) and "\n" in value.strip():
                first, *rest = value.strip().splitlines()
                event_dict[key] = first
                below += [line if line.startswith((" ", "\t")) else f"  {line}" for line in rest]
        return "\n".join([self._console(logger, name, event_dict), *below])


def configure_logging(json: bool | None = None, level: str | None = None, service: str | None = None) -> None:
    if json is None:
        json = os.environ.get("TLT_LOG_JSON", "0") not in ("", "0", "false")
    level = (level or os.environ.get("TLT_LOG_LEVEL", "info")).lower()
    if level not in _LEVELS:
        raise ValueError(f"log level {level!r} unknown; use one of {sorted(_LEVELS)}")
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso" if json else "%H:%M:%S"),
    ]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [_ReadableRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=_StderrLogger.factory,
        cache_logger_on_first_use=False,
    )
    if service:
        structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    """A logger; in a process that never configured logging (a script using a client as a library), the
    defaults `tlt` sets first: info level (TLT_LOG_LEVEL), on stderr. structlog's own default printed every
    debug line, on stdout."""
    if not structlog.is_configured():
        try:
            configure_logging()
        except ValueError:  # a bad TLT_LOG_LEVEL: `tlt` reports it as a usage error when it configures
            configure_logging(level="info")
    return structlog.get_logger(name) if name else structlog.get_logger()
