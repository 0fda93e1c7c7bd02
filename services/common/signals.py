"""Signals that ask a service to stop: `set_on_signals(stop)` sets a `threading.Event` on SIGINT / SIGTERM;
`unwind_on_termination` raises `Terminated` in a one-shot command's main thread instead, so its cleanup runs.

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

import contextlib
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator


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


class Terminated(BaseException):
    """SIGTERM / SIGHUP raised in the main thread (not an Exception: no `except Exception` may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def unwind_on_termination(event: str, logger: str) -> Iterator[None]:
    """Let SIGTERM / SIGHUP unwind a command's main thread (its `finally` blocks run), log `event` on `logger`, then
    die of the signal as before (the exit status a launcher expects of a terminated process).

    `tlt run`'s stop, a container's stop, `timeout` and the parent-death signal all send SIGTERM, which Python
    answers by exiting at once: `finally` blocks never ran. A trainer's weight push in flight left the whole
    model's weights in /dev/shm until some later trainer swept them; `tlt model build` left its half-built
    `.DIR.tmp-PID` folder beside --out, which no later build (another pid) removes. Ctrl-C (SIGINT) already
    unwinds, as KeyboardInterrupt. A signal already ignored stays ignored (under nohup a closed terminal must not
    end the command); off the main thread (a test, a library call) nothing is installed."""
    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated(signum)

    if threading.current_thread() is not threading.main_thread():  # signal handlers: main thread only
        yield
        return
    wanted = (signal.SIGTERM, signal.SIGHUP)
    before = {sig: signal.signal(sig, raise_terminated) for sig in wanted if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield
    except Terminated as t:
        from tlt.services.common.logging import get_logger

        get_logger(logger).warning(event, signal=signal.Signals(t.signum).name)
        signal.signal(t.signum, signal.SIG_DFL)
        os.kill(os.getpid(), t.signum)
        raise
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
