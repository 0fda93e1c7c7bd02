"""How a replica process ends (`replica.replica_main`): at once with os._exit once its loop is done, skipping the
interpreter's teardown (about a second with torch and a tokenizer loaded), but after the atexit handlers (SGLang
stops its scheduler processes in one) and with exit code 1 when an exception escaped, as a normal exit would.

Each test spawns a process as the pool does (multiprocessing spawn: a normal return would run the full
teardown) whose replica body is a stand-in, so these take a second or two; the real replica's stop is exercised
by every rollout server test."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest


def _start(target, *args: str) -> int:  # noqa: ANN001
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(60)
    assert not proc.is_alive()
    return proc.exitcode


# -- spawn targets (module level: the child imports this file to find them) --------------------------------------


def _registers_an_atexit_handler(mark: str) -> None:
    import atexit

    from tlt.services.rollout import replica

    replica.serve_replica = lambda: atexit.register(Path(mark).write_text, "yes")
    replica.replica_main()


def _raises(_: str) -> None:
    from tlt.services.rollout import replica

    def body() -> None:
        raise RuntimeError("(test) the loop died")

    replica.serve_replica = body
    replica.replica_main()


class _Held:
    """Writes its mark when finalized: a module global is finalized only by the interpreter's teardown."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __del__(self) -> None:
        Path(self.mark).write_text("teardown ran")


def _holds_a_global(mark: str) -> None:
    from tlt.services.rollout import replica

    global HELD
    HELD = _Held(mark)
    replica.serve_replica = lambda: None
    replica.replica_main()


def _returns_normally(mark: str) -> None:  # the control: without replica_main the teardown does run
    global HELD
    HELD = _Held(mark)


# -- tests ----------------------------------------------------------------------------------------------------------


def test_atexit_handlers_run_and_the_exit_code_is_0(tmp_path: Path) -> None:
    mark = tmp_path / "atexit-ran"
    assert _start(_registers_an_atexit_handler, str(mark)) == 0
    assert mark.read_text() == "yes"


def test_an_escaped_exception_exits_1_with_its_traceback(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    assert _start(_raises, "") == 1
    assert "RuntimeError: (test) the loop died" in capfd.readouterr().err


def test_the_interpreter_teardown_is_skipped(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert _start(_returns_normally, str(control)) == 0
    assert control.read_text() == "teardown ran"  # a spawn child that returns does tear down (the test can fail)
    mark = tmp_path / "replica"
    assert _start(_holds_a_global, str(mark)) == 0
    assert not mark.exists()
