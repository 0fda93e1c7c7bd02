"""A SIGTERM stops a service whose main thread rests in `stop.wait(...)`: `services/common/signals.set_on_signals`.

The drafter service, its workers and the reward server set a `threading.Event` from their SIGINT / SIGTERM
handlers. Done as `signal.signal(sig, lambda *_: stop.set())`, the handler could deadlock: it runs in the main
thread, and when that thread was inside `stop.wait(...)` holding the event's non-reentrant lock (a signal that
lands on another thread is handled at the main thread's next check, often just after its wait re-took the lock),
`set()` waits on its own thread for ever. A drafter worker so outlived its killed service by over 30 s in a
full test run (tests/test_drafter_worker_failures.py). Real processes and real signals below.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tlt.services.common.signals import set_on_signals

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import signal, sys, threading
sys.path.insert(0, {root!r})
stop = threading.Event()
if sys.argv[1] == "lambda":  # what the services did
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
else:
    from tlt.services.common.signals import set_on_signals
    set_on_signals(stop)
print("ready", flush=True)
while not stop.wait(0):  # the main thread holds the event's lock most of the time: the worst case
    pass
"""


def _hangs(handler: str, tries: int, tmp_path: Path, first: bool = False) -> int:
    """How many of `tries` children, SIGTERMed while they poll `stop.wait(0)`, were still running 5 s later
    (first: stop counting at the first)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    hung = 0
    for i in range(tries):
        p = subprocess.Popen([sys.executable, str(script), handler], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            time.sleep(0.01 + 0.01 * (i % 5))
            p.send_signal(signal.SIGTERM)
            p.wait(5)
        except subprocess.TimeoutExpired:
            hung += 1
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        if hung and first:
            break
    return hung


def test_a_sigterm_stops_a_main_thread_polling_its_stop_event(tmp_path: Path) -> None:
    assert _hangs("set_on_signals", 20, tmp_path) == 0


def test_the_handler_it_replaced_deadlocks_so(tmp_path: Path) -> None:
    """The check above can fail: the old handler hung 20 of 40 such children when this was written (session 31)."""
    assert _hangs("lambda", 20, tmp_path, first=True) > 0


@pytest.fixture
def installed():  # noqa: ANN201 - (stop event, SIGTERM handler), the process's handlers restored afterwards
    stop = threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        set_on_signals(stop)
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        yield stop, handler
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@pytest.mark.timeout(30)  # the handler this replaced would block here until killed
def test_the_handler_returns_while_the_main_thread_holds_the_events_lock(installed) -> None:  # noqa: ANN001
    """The mechanism, without a signal: the handler is called where the deadlock happened, with the event's
    lock held by the calling thread; it returns at once, and the event is set once the lock is released."""
    stop, handler = installed
    with stop._cond:  # what Event.wait holds around its wait
        assert not stop._cond._lock.acquire(timeout=0.05)  # not reentrant
        handler(signal.SIGTERM, None)  # the old one (stop.set()) would block here for ever
        assert not stop.is_set()
    assert stop.wait(5)


@pytest.mark.timeout(30)
def test_the_handler_takes_no_lock_and_starts_no_thread(installed) -> None:  # noqa: ANN001
    """`Thread.start` takes threading's own non-reentrant lock (and fails at interpreter shutdown): with that lock
    held, as a main thread interrupted inside `Thread.start` holds it, the handler still returns."""
    stop, handler = installed
    before = threading.active_count()
    with threading._active_limbo_lock:  # type: ignore[attr-defined]
        handler(signal.SIGTERM, None)
    assert stop.wait(5)
    assert threading.active_count() <= before


@pytest.mark.parametrize("module", ["services/drafter/worker_main.py", "services/drafter/serve.py",
                                    "services/reward/serve.py"])
def test_the_services_stop_through_it(module: str) -> None:
    text = (ROOT / module).read_text()
    assert "set_on_signals(stop)" in text
    assert "stop.set())" not in text
