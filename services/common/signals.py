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


def set_on_signals(stop: threading.Event, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Install handlers (main thread only, as `signal.signal` requires) that set `stop` when one of `signals` comes."""
    arrived: queue.SimpleQueue[int] = queue.SimpleQueue()

    def setter() -> None:
        arrived.get()
        stop.set()

    threading.Thread(target=setter, name="stop-on-signal", daemon=True).start()

    def handler(signum: int, frame: object) -> None:
        arrived.put_nowait(signum)

    for sig in signals:
        signal.signal(sig, handler)
