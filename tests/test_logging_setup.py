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
