"""`tlt run`'s stop on a full disk: the launcher's samplers (timeline.jsonl, drafter.jsonl) raised OSError from their
thread and again from close(), which ended Launcher.shutdown before it stopped the services (the drafter service and
its worker outlived the launcher) and before the report. A sampler keeps sampling past a write that fails, and one
that cannot close never keeps the services running. A real service process (`sleep`, a process group of its own,
stopped by SIGTERM); the failing writes are the samplers' own code meeting an OSError."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from types import SimpleNamespace

from tlt.services.trainer.launcher import Launcher
from tlt.services.trainer.procs import ServiceProcess
from tlt.services.trainer.run_monitor import _Poller


class _FullDisk(_Poller):
    def poll(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        super().close()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_sampler_on_a_full_disk_keeps_sampling_and_never_keeps_the_services_running(tmp_path: Path) -> None:
    sampler = _FullDisk(0.01)
    sampler.start()
    time.sleep(0.3)
    assert sampler.is_alive() and sampler.failures > 3  # the thread went on past each failed write
    service = ServiceProcess("sleeper", ["sleep", "60"], tmp_path / "sleeper.log").start()
    me = SimpleNamespace(samplers=[sampler], services=[service], plan=SimpleNamespace(run=SimpleNamespace(
        stop_timeout_s=5.0)))
    Launcher.shutdown(me)  # type: ignore[arg-type]
    assert service.proc.poll() is not None and me.services == [] and me.samplers == []
