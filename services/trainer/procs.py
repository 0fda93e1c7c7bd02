"""Child processes of `tlt run`: start a real `tlt ...` command, wait until it is ready, stop it.

    ServiceProcess(name, argv, logs/<name>.log, ready file)
      .start()        Popen in its own process group, stdout+stderr to the log file
      .wait_ready()   the command's --ready-file appears (it writes it once serving), or it died
      .stop()         SIGTERM to the whole group (replicas, workers), SIGKILL after a grace period

Each service gets its own process group, so one signal reaches the processes it
started itself (rollout replicas, drafter workers) and nothing else; the
launcher stops them in order (trainer, drafter, rollout, reward) on exit,
error or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tlt.services.common.logging import get_logger

log = get_logger("run.procs")


class ServiceError(RuntimeError):
    """A service exited or never became ready; the message names it and its log."""


class ServiceProcess:
    def __init__(self, name: str, argv: list[str], log_path: Path, ready_file: Path | None = None,
                 env: dict[str, str] | None = None, unset_env: tuple[str, ...] = ()) -> None:
        """`env`: set in the child's environment over this process's; `unset_env`: taken out of it."""
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.ready_file = ready_file
        self.env = env
        self.unset_env = unset_env
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.ready_file is not None and self.ready_file.exists():
            self.ready_file.unlink()
        self._log = self.log_path.open("ab")
        self._log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
        self._log.flush()
        # Passive OpenMP waits: torch threads that spin while waiting burn the cores the other
        # services need (on a 2-core machine a 2-thread forward went from 0.6 s to 7 s under load).
        # TLT_DIE_WITH_PARENT: the child's `tlt` main() asks the kernel to SIGTERM it when this
        # launcher dies, even by kill -9 (its own process group keeps it out of reach otherwise).
        # Done in the child after exec, not in a preexec_fn: running Python (ctypes) between fork
        # and exec in this multithreaded launcher (gRPC threads) can crash the child (seen: -11).
        inherited = {k: v for k, v in os.environ.items() if k not in self.unset_env}
        env = {"OMP_WAIT_POLICY": "PASSIVE", **inherited, "PYTHONUNBUFFERED": "1",
               "TLT_DIE_WITH_PARENT": str(os.getpid()), **(self.env or {})}
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        log.debug("service_started", service=self.name, pid=self.proc.pid, log=str(self.log_path))
        return self

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(text[-lines:])

    def died(self) -> ServiceError:
        return ServiceError(f"{self.name} exited with code {self.poll()} (log {self.log_path}):\n{self.tail()}")

    def ready_info(self) -> dict[str, Any] | None:
        if self.ready_file is None or not self.ready_file.exists():
            return None
        return json.loads(self.ready_file.read_text())

    def wait_ready(self, deadline: float, stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """The ready file's contents; None if `stop()` (polled with it) says the wait is no longer needed."""
        while True:
            info = self.ready_info()
            if info is not None:
                return info
            if not self.alive():
                raise self.died()
            if stop is not None and stop():
                return None
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.name} not ready in time (log {self.log_path}):\n{self.tail()}")
            time.sleep(0.1)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the group, wait, SIGKILL what is left; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("service_kill", service=self.name, after_s=timeout_s)
        self._signal(signal.SIGKILL)  # leftovers of the group (a replica or worker that ignored SIGTERM)
        if self.proc.poll() is None:
            self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # type: ignore[union-attr]
        except (ProcessLookupError, PermissionError):
            pass
