"""`tlt run`'s child processes (services/trainer/procs.py ServiceProcess) with real processes: the environment a
child starts with, a ready file left by an earlier launch, and a stop that leaves nothing of the child's process
group running. Each child is a few lines of Python; no service is started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tlt.services.trainer.procs import ServiceError, ServiceProcess

ENV_DUMP = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie not yet reaped by its new parent counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_child_starts_without_the_variables_it_must_not_see_and_with_the_callers_omp_policy(tmp_path: Path,
                                                                                             monkeypatch) -> None:
    """unset_env: the TLT_<SECTION>__* variables already folded into config.toml (run_env.child_unset_env); read
    again by a child, TLT_TRAINER__STEPS beat --steps. OMP_WAIT_POLICY is PASSIVE unless the caller set its own."""
    monkeypatch.setenv("TLT_TRAINER__STEPS", "9")
    monkeypatch.setenv("TLT_KEPT", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    out = tmp_path / "env.json"
    p = ServiceProcess("dump", [sys.executable, "-c", ENV_DUMP, str(out)], tmp_path / "dump.log",
                       env={"TLT_AUTH_TOKEN": "t"}, unset_env=("TLT_TRAINER__STEPS",)).start()
    assert p.proc.wait(30) == 0
    p.stop(5)
    env = json.loads(out.read_text())
    assert "TLT_TRAINER__STEPS" not in env and env["TLT_KEPT"] == "1" and env["TLT_AUTH_TOKEN"] == "t"
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["TLT_DIE_WITH_PARENT"] == str(os.getpid())
    monkeypatch.delenv("OMP_WAIT_POLICY")
    p = ServiceProcess("dump", [sys.executable, "-c", ENV_DUMP, str(out)], tmp_path / "dump.log").start()
    assert p.proc.wait(30) == 0
    p.stop(5)
    assert json.loads(out.read_text())["OMP_WAIT_POLICY"] == "PASSIVE"


def test_a_ready_file_an_earlier_launch_left_is_not_taken_for_this_ones(tmp_path: Path) -> None:
    """A resumed run's logs/<name>.ready holds the last launch's ports: taken as this launch's, the trainer would
    dial ports nobody serves. Start removes it; a child that never writes one is not ready."""
    ready = tmp_path / "svc.ready"
    ready.write_text(json.dumps({"pid": 1, "port": 1234}))
    p = ServiceProcess("svc", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "svc.log",
                       ready).start()
    try:
        assert not ready.exists()
        with pytest.raises(ServiceError, match="not ready in time"):
            p.wait_ready(time.monotonic() + 0.5)
    finally:
        p.stop(5)


def test_a_stop_kills_what_the_child_started_that_ignores_sigterm(tmp_path: Path) -> None:
    """stop(): SIGTERM to the child's process group, then SIGKILL to what is left of it (a replica or worker that
    ignores SIGTERM outlived the run otherwise)."""
    pid_file = tmp_path / "grandchild.pid"
    grandchild = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)")
    child = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}, sys.argv[1]]); "
             "time.sleep(60)")
    p = ServiceProcess("svc", [sys.executable, "-c", child, str(pid_file)], tmp_path / "svc.log").start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    try:
        p.stop(2)
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
    finally:
        if not _gone(pid):
            os.kill(pid, 9)


def test_a_relaunch_appends_to_the_services_log(tmp_path: Path) -> None:
    """logs/<name>.log of a resumed run keeps the earlier launches' lines (why the last one failed, often), each
    launch under its own header line."""
    log = tmp_path / "svc.log"
    for word in ("first", "second"):
        p = ServiceProcess("svc", [sys.executable, "-c", f"print({word!r})"], log).start()
        assert p.proc.wait(30) == 0
        p.stop(5)
    text = log.read_text()
    assert text.index("first") < text.index("second") and text.count("=== ") == 2


def test_a_stop_lets_the_child_end_on_sigterm_and_a_death_is_said_with_the_logs_last_lines(tmp_path: Path) -> None:
    """stop() sends SIGTERM first and waits: a service ends on it (the trainer saves, a server drains) and exits
    with its own code, not -9. A child that dies before it is ready is said at once (wait_ready does not sit out its
    deadline and then call it 'not ready in time'), with the end of its log, where its error is."""
    marker = tmp_path / "terminated"
    child = ("import signal, sys, time\n"
             "def bye(*_): open(sys.argv[1], 'w').write('ok'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, bye); open(sys.argv[2], 'w').write('{}'); time.sleep(60)")
    p = ServiceProcess("svc", [sys.executable, "-c", child, str(marker), str(tmp_path / "svc.ready")],
                       tmp_path / "svc.log", tmp_path / "svc.ready").start()
    p.wait_ready(time.monotonic() + 30)  # its SIGTERM handler is in place
    assert p.stop(10) == 0 and marker.read_text() == "ok"
    dies = "import sys; [print(f'line {i}') for i in range(40)]; sys.exit(3)"
    p = ServiceProcess("svc", [sys.executable, "-c", dies], tmp_path / "dies.log", tmp_path / "dies.ready").start()
    try:
        started = time.monotonic()
        with pytest.raises(ServiceError, match="svc exited with code 3") as e:
            p.wait_ready(time.monotonic() + 60)
        assert time.monotonic() - started < 30
        assert "line 39" in str(e.value) and "line 0\n" not in str(e.value)
    finally:
        p.stop(5)
