"""A service started by `tlt run`'s launcher dies when the launcher is killed with -9.

Real processes: a stand-in launcher (a Python process using the launcher's own
`ServiceProcess`) starts a real `tlt reward serve`, waits until it is ready,
and is then killed with SIGKILL by this test (by its pid). The reward server,
in its own process group, must still exit: `tlt`'s main() asked the kernel for
SIGTERM on parent death (TLT_DIE_WITH_PARENT).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rollout_helpers import pid_gone

LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tlt.cli import tlt_command
    from tlt.services.trainer.procs import ServiceProcess
    out = Path(sys.argv[1])
    p = ServiceProcess("reward", tlt_command("reward", "serve", "--port", "0", "--ready-file", str(out / "ready.json")),
                       out / "reward.log", out / "ready.json").start()
    p.wait_ready(time.monotonic() + 60)
    (out / "child.pid").write_text(str(p.pid))
    time.sleep(600)
    """
)


def test_service_exits_when_the_launcher_is_killed(tmp_path: Path) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.DEVNULL)
    child = 0
    try:
        pid_file = tmp_path / "child.pid"
        deadline = time.monotonic() + 90
        while not pid_file.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), (tmp_path / "reward.log").read_text(errors="replace")[-2000:]
        child = int(pid_file.read_text())
        assert json.loads((tmp_path / "ready.json").read_text())  # the service really started
        assert not pid_gone(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 20
        while not pid_gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_gone(child), "the service outlived its launcher's kill -9"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if child and not pid_gone(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_launcher_is_already_gone_does_not_start() -> None:
    """PR_SET_PDEATHSIG only covers a parent that dies after the call: a child whose launcher died before it got
    there (its parent is now another process) exits at once naming the launcher, instead of running orphaned."""
    gone = subprocess.run([sys.executable, "-m", "tlt.cli", "--version"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TLT_DIE_WITH_PARENT": "1"})
    assert gone.returncode == 1 and "the launcher (pid 1) is gone; not starting" in gone.stderr, gone
    assert gone.stdout == ""
    mine = subprocess.run([sys.executable, "-m", "tlt.cli", "--version"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TLT_DIE_WITH_PARENT": str(os.getpid())})
    assert mine.returncode == 0 and mine.stdout.startswith("tlt "), mine
