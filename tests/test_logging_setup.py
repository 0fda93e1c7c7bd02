"""What every service's log set-up (services/common/logging.py) promises, read from what it writes on stderr.

JSON records carry the level, an ISO date-time, the service and an exception's traceback; the readable form sends
no colour codes down a pipe and indents each further line of a multi-line value; TLT_LOG_JSON / TLT_LOG_LEVEL are
read as documented (`false` is off, a level in capitals is a level, a bad level leaves a library at info); a logger
follows a later set-up and writes to whatever stderr is now. Everything is real (structlog, this process's stderr
through capsys); the set-up is put back after each test.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import sys
from datetime import datetime

import pytest
import structlog

from tlt.services.common.logging import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _structlog_restored():
    """configure_logging sets structlog's global configuration and binds `service` process-wide: put both back."""
    was_configured, config = structlog.is_configured(), structlog.get_config()
    bound = structlog.contextvars.get_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**bound)
    if was_configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


def test_a_json_record_carries_its_level_an_iso_date_time_the_service_and_the_traceback(capsys) -> None:
    configure_logging(json=True, level="info", service="rollout")
    log = get_logger("rollout")
    log.warning("replica_slow", replica=1)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("step_failed")
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["event"] == "replica_slow" and first["level"] == "warning" and first["service"] == "rollout", first
    assert datetime.fromisoformat(first["timestamp"]).year >= 2024, first  # a date, not only a clock time
    assert second["level"] == "error" and "Traceback" in second["exception"], second
    assert "ValueError: boom" in second["exception"], second


def test_the_readable_form_down_a_pipe_has_no_colour_codes_and_indents_further_lines(capsys) -> None:
    """capsys's stderr is not a terminal, as a pipe or a log file is not."""
    configure_logging(json=False, level="info")
    get_logger().error("refused", error="first line\nsecond, not indented\n    third, indented already")
    err = capsys.readouterr().err
    assert "\x1b[" not in err, repr(err)
    lines = err.splitlines()
    assert "refused" in lines[0] and "first line" in lines[0] and "second" not in lines[0], lines
    assert lines[1:] == ["  second, not indented", "    third, indented already"], lines


def test_the_environment_switches_read_as_documented(capsys, monkeypatch) -> None:
    monkeypatch.setenv("TLT_LOG_JSON", "false")
    monkeypatch.setenv("TLT_LOG_LEVEL", "DEBUG")  # --log-level / TLT_LOG_LEVEL in capitals is the same level
    configure_logging()
    get_logger().debug("shown_in_debug")
    err = capsys.readouterr().err
    assert "shown_in_debug" in err and not err.lstrip().startswith("{"), err  # readable, not JSON
    monkeypatch.setenv("TLT_LOG_LEVEL", "Warning")
    configure_logging()
    get_logger().info("hidden_at_warning")
    assert "hidden_at_warning" not in capsys.readouterr().err


def test_a_library_under_a_bad_level_in_the_environment_logs_at_info(capsys, monkeypatch) -> None:
    """A script using a client as a library never configures: the first get_logger does, and a TLT_LOG_LEVEL it
    cannot read (`tlt` itself refuses it as a usage error) leaves it at info, not debug and not a ValueError."""
    structlog.reset_defaults()
    monkeypatch.setenv("TLT_LOG_LEVEL", "nope")
    log = get_logger("lib")
    log.debug("quiet_please")
    log.info("shown")
    err = capsys.readouterr().err
    assert "shown" in err and "quiet_please" not in err, err


def test_every_level_method_writes_one_line(capsys) -> None:
    configure_logging(json=True, level="debug")
    log = get_logger()
    for method in ("debug", "info", "warning", "warn", "error", "critical", "fatal", "exception", "msg"):
        getattr(log, method)(f"by_{method}")
    events = [json.loads(line)["event"] for line in capsys.readouterr().err.splitlines()]
    assert events == ["by_debug", "by_info", "by_warning", "by_warn", "by_error", "by_critical", "by_fatal",
                      "by_exception", "by_msg"]


def test_a_logger_follows_a_later_set_up_and_the_stderr_of_the_moment(monkeypatch) -> None:
    """A module's logger used before `tlt` configures (the first get_logger set the defaults) takes the later set-up;
    and a stderr replaced and closed (pytest's capture, a daemon redirecting its output) is not written again."""
    before = io.StringIO()
    monkeypatch.setattr(sys, "stderr", before)
    log = get_logger("early")
    configure_logging(json=False, level="info")
    log.info("readable_line")
    configure_logging(json=True, level="info")
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    before.close()
    log.info("json_line")
    assert json.loads(now.getvalue())["event"] == "json_line", now.getvalue()

# The `error` level, an explicit `json=False` under TLT_LOG_JSON=1, colour on a terminal, the clock time of the
# readable form, and how the readable form shows values that are not strings, a lone newline and the event or a
# traceback text of several lines. Each was a surviving mutant of session 57's audit: `"error": WARNING` or no
# `error` level, `if not json` for `if json is None`, colours always off, an ISO stamp in the readable form, the
# `isinstance(value, str)` check dropped (every log line with a number raised AttributeError), `"\n" in value` for
# `"\n" in value.strip()`, `value.splitlines()` for `value.strip().splitlines()`, and `event` / `exception` split
# like any other value. The colours are read through a pseudo-terminal.


def test_the_error_level_shows_errors_only(capsys) -> None:
    """`--log-level error` (TLT_LOG_LEVEL=error) is a level: warnings are hidden, errors and criticals shown."""
    configure_logging(json=True, level="error")
    log = get_logger()
    log.warning("a_warning")
    log.error("an_error")
    log.critical("a_critical")
    events = [json.loads(line)["event"] for line in capsys.readouterr().err.splitlines()]
    assert events == ["an_error", "a_critical"], events


def test_an_explicit_json_false_beats_the_environment(capsys, monkeypatch) -> None:
    """Only `json=None` reads TLT_LOG_JSON; a caller that asks for the readable form gets it under TLT_LOG_JSON=1."""
    monkeypatch.setenv("TLT_LOG_JSON", "1")
    configure_logging(json=False, level="info")
    get_logger().info("readable_please")
    err = capsys.readouterr().err
    assert "readable_please" in err and not err.lstrip().startswith("{"), err
    configure_logging(level="info")  # None: the environment's JSON
    get_logger().info("json_now")
    assert json.loads(capsys.readouterr().err)["event"] == "json_now"


def test_the_readable_form_on_a_terminal_is_coloured(monkeypatch) -> None:
    """On a terminal (stderr a tty at set-up) the readable form has ANSI colours; down a pipe it has none
    (tests/test_logging_setup.py). The terminal is a pseudo-terminal; its reply is read with a bounded wait."""
    master, slave = os.openpty()
    tty = open(slave, "w", buffering=1, closefd=True)  # noqa: SIM115 - closed below
    try:
        monkeypatch.setattr(sys, "stderr", tty)
        configure_logging(json=False, level="info")
        get_logger().info("in_colour", replica=1)
        got = b""
        while b"in_colour" not in got or not got.endswith(b"\n"):
            ready, _, _ = select.select([master], [], [], 5.0)
            assert ready, f"nothing more on the terminal within 5 s: {got!r}"
            got += os.read(master, 4096)
    finally:
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        tty.close()
        os.close(master)
    assert b"\x1b[" in got, got


def test_the_readable_form_shows_the_clock_time(capsys) -> None:
    """The readable line starts with the time of day (HH:MM:SS); JSON carries the ISO date-time."""
    configure_logging(json=False, level="info")
    get_logger().info("what_time")
    line = capsys.readouterr().err
    assert re.match(r"\d\d:\d\d:\d\d \[info\s*\] what_time", line), line


def test_the_readable_form_shows_values_that_are_not_strings(capsys) -> None:
    """Numbers, lists and None are rendered as the console renderer renders them; the multi-line handling looks at
    strings only (without the check, any log line carrying a number raised AttributeError)."""
    configure_logging(json=False, level="info")
    get_logger().info("counted", n=5, sizes=[1, 2], none=None, ratio=0.5)
    line = capsys.readouterr().err
    assert line.count("\n") == 1, line
    for shown in ("n=5", "sizes=[1, 2]", "none=None", "ratio=0.5"):
        assert shown in line, line


def test_a_value_of_newlines_at_its_ends_only_stays_on_its_line_as_written(capsys) -> None:
    """A value whose newlines are only at its ends (a generated '\\n' token, a line read with its end) is not a value
    of several lines: it stays on the log line as the console renderer shows it, quoted with its newline, not
    emptied ('' for a lone '\\n') or cut. A value that starts with a newline keeps its first line on the log line."""
    configure_logging(json=False, level="info")
    get_logger().info("token", text="\n", line="abc\n")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "text='\\n'" in err and "line='abc\\n'" in err, err
    get_logger().info("answer", text="\nfirst\nsecond")
    lines = capsys.readouterr().err.splitlines()
    assert "text=first" in lines[0] and lines[1:] == ["  second"], lines


def test_the_event_and_a_traceback_text_are_printed_as_written(capsys) -> None:
    """The event, and an `exception` (or `stack`) text a caller hands over, are the console renderer's to print:
    their lines as written (not cut at the first line, not indented), the other values on the event's last line."""
    configure_logging(json=False, level="info")
    get_logger().info("first line\nsecond line", k=3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("first line") and lines[1].startswith("second line") and "k=3" in lines[1], lines
    trace = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: boom"
    get_logger().error("step_failed", exception=trace)
    lines = capsys.readouterr().err.splitlines()
    assert lines[1:] == trace.splitlines(), lines

