"""Signals that ask a service to stop: `set_on_signals(stop)` sets a `threading.Event` on SIGINT / SIGTERM.

A Python signal handler runs in the main thread, between two bytecodes of whatever that thread was doing. A
handler that calls `stop.set()` takes the event's lock, which is not reentrant. When the main thread was inside
`stop.wait(...)` itself (a service's loop rests in it) and had taken that lock but not yet given it up to the wait,
the handler waits for a lock its own thread holds: for ever. A signal that lands on another thread is handled at
the main thread's next check, often just after its wait took the lock back. A drafter worker whose service was
killed got its parent-death SIGTERM so and outlived it (tests/test_drafter_worker_failures.py, once in a full run;
about one kill in 14 in a loop that killed the service while its worker rested, session 31).

Here the handler only puts the signal number on a `queue.SimpleQueue`, whose put is reentrant (documented as safe
where a call may interrupt another in the same thread), and a daemon thread started at install time sets the event.
The handler takes no lock and starts no thread (`Thread.start` takes one too, and fails at interpreter shutdown).
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable


def set_on_signals(stop: threading.Event,
                   signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Callable[[], None]:
    """Install handlers (main thread only, as `signal.signal` requires) that set `stop` when one of `signals` comes.

    Returns `restore`: it puts back the handlers these replaced and ends the thread, without setting `stop`. A
    command run in a process that goes on after it (`tlt.cli.main` in a test or a script) calls it once it stopped:
    left in place, they made the rest of a pytest session ignore Ctrl-C and SIGTERM."""
    arrived: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def setter() -> None:
        if arrived.get() is not None:  # None: restored
            stop.set()

    threading.Thread(target=setter, name="stop-on-signal", daemon=True).start()

    def handler(signum: int, frame: object) -> None:
        arrived.put_nowait(signum)

    replaced = {sig: signal.signal(sig, handler) for sig in signals}

    def restore() -> None:
        for sig, previous in replaced.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # None: not set from Python
        arrived.put_nowait(None)

    return restore
