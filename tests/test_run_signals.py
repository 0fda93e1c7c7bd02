"""`tlt run`'s entry (services/trainer/launch.py run) turns SIGTERM / SIGHUP into an orderly stop while it runs,
and gives the process its own handlers back when it returns: called in-process (a test, a script), a later
SIGTERM raised KeyboardInterrupt wherever the caller was. The launcher's services are replaced by a stand-in
(Launcher.run returns at once): only the signal handling is under test here; tests/test_run_resume.py runs the
real services."""

from __future__ import annotations

import argparse
import signal
from types import SimpleNamespace


def test_run_gives_back_the_signal_handlers_it_took(tmp_path, monkeypatch):
    from tlt.services.trainer import launch, launcher

    seen = {}

    class Standin:
        def __init__(self, plan, quiet=False):  # noqa: ANN001
            pass

        def run(self) -> int:
            seen["during"] = signal.getsignal(signal.SIGTERM)
            return 0

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(launcher, "Launcher", Standin)
    monkeypatch.setattr(launcher, "prepare_run", lambda args: SimpleNamespace(run_dir=tmp_path, tail_threshold=32,
                                                                          resumed=False, services={}, switches={}))

    def mine(signum, frame):  # noqa: ANN001, ANN202
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        assert launch.run(argparse.Namespace(no_report=True, quiet=True)) == 0
        assert seen["during"] is not mine  # while running, SIGTERM stops the run
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
