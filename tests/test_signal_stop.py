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


@pytest.mark.timeout(30)
def test_restore_puts_the_handlers_back_and_does_not_stop() -> None:
    """`restore()` (a command that stopped, in a process that goes on) gives back the handlers it replaced and
    ends its thread without setting the event: a restore that set it told whatever still waited on the event to
    stop, though no signal came."""
    stop = threading.Event()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads = set(threading.enumerate())
    restore = set_on_signals(stop)
    assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    (setter,) = [t for t in threading.enumerate() if t not in threads and t.name == "stop-on-signal"]
    restore()
    setter.join(5)
    assert not setter.is_alive()  # its thread has ended: it will not set the event later
    assert not stop.is_set()
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("module", ["services/drafter/worker_main.py", "services/drafter/serve.py",
                                    "services/reward/serve.py"])
def test_the_services_stop_through_it(module: str) -> None:
    text = (ROOT / module).read_text()
    assert "set_on_signals(stop)" in text
    assert "stop.set())" not in text


# `tlt.cli.main` run in this process (as tests run it, or a script): a serve command must leave the process's
# handlers and threads as it found them, whether it served or could not start. `tlt reward serve` on a port in use
# left its SIGINT / SIGTERM handlers (the rest of a pytest session then ignored Ctrl-C and a cancelled CI job's
# SIGTERM) and its scoring threads.
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _new_threads(before: set[threading.Thread], wait_s: float = 3.0) -> list[str]:
    """The threads started since `before` still alive after up to `wait_s` (a stopped pool's workers end soon)."""
    deadline = time.monotonic() + wait_s
    for t in threading.enumerate():
        if t not in before:
            t.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


@pytest.mark.parametrize("case", ["port in use", "no such function"])
def test_a_reward_serve_that_cannot_start_leaves_the_process_as_it_was(case: str, capfd) -> None:  # noqa: ANN001
    import socket

    from tlt.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # a port the kernel picked: taken by this test
        held.listen()
        port = str(held.getsockname()[1])
        argv = ["reward", "serve", "--port", port] if case == "port in use" else \
            ["reward", "serve", "--port", "0", "--function", "tlt_no_such_module:f"]
        handlers = {s: signal.getsignal(s) for s in HANDLED}
        before = set(threading.enumerate())
        assert main(argv) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    assert {s: signal.getsignal(s) for s in HANDLED} == handlers
    assert _new_threads(before) == []


@pytest.mark.timeout(60)
def test_a_reward_serve_stopped_by_ctrl_c_puts_the_handlers_back() -> None:
    """Served, then stopped by SIGINT: it returns 0, and a later Ctrl-C is the process's KeyboardInterrupt again."""
    from tlt.cli import main

    handlers = {s: signal.getsignal(s) for s in HANDLED}
    before = set(threading.enumerate())
    interrupter = _interrupt_once_handled(handlers)
    assert main(["reward", "serve", "--port", "0"]) == 0
    interrupter.join(5)
    assert {s: signal.getsignal(s) for s in HANDLED} == handlers
    assert _new_threads(before) == []


@pytest.mark.timeout(120)
def test_a_drafter_serve_whose_status_port_is_taken_leaves_no_coordinator_behind(random_model_dir: Path, tmp_path: Path,
                                                                                 capfd) -> None:  # noqa: ANN001
    """The coordinator (its threads and its ZeroMQ binds) was up when the status port turned out taken: one line and
    exit 2, but in-process its threads ran on and its endpoints stayed bound."""
    import socket

    import zmq

    from tlt.cli import main

    handlers = {s: signal.getsignal(s) for s in HANDLED}
    from tlt.services.common.ports import free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        features_port = free_port()  # for the features PULL: bound again after the command
        before = set(threading.enumerate())
        assert main(["drafter", "serve", "--model", str(random_model_dir), "--workers", "0",
                     "--set", f"status_port={held.getsockname()[1]}", "--set", "gate_when_idle=false",
                     "--set", f"features_bind=tcp://127.0.0.1:{features_port}",
                     "--set", "coordinator_bind=tcp://127.0.0.1:*", "--set", f"checkpoint_dir={tmp_path / 'ckpt'}",
                     "--set", "coordinator_nice=0"]) == 2
    err = capfd.readouterr().err
    assert "port_in_use" in err and "Traceback" not in err, err[-2000:]
    assert {s: signal.getsignal(s) for s in HANDLED} == handlers
    assert _new_threads(before, wait_s=12) == []
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"tcp://127.0.0.1:{features_port}")  # ZMQError "Address already in use" while the puller lives
        sock.close()
    finally:
        ctx.term()


def _interrupt_once_handled(handlers: dict) -> threading.Thread:
    """A thread that sends this process SIGINT once the command installed its own handler (before, it would be the
    test's KeyboardInterrupt)."""
    import os

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while signal.getsignal(signal.SIGINT) is handlers[signal.SIGINT] and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(120)
def test_a_drafter_worker_stopped_by_ctrl_c_puts_the_handlers_back(random_model_dir: Path, tmp_path: Path) -> None:
    """A worker whose rollout never answered, stopped by SIGINT while it waits: it returns 0 and the process's Ctrl-C
    is its KeyboardInterrupt again (the worker's handlers stayed, as the reward server's did)."""
    import socket

    from tlt.cli import main

    handlers = {s: signal.getsignal(s) for s in HANDLED}
    refused = [socket.socket() for _ in range(3)]  # bound, not listening: a connect there is refused
    try:
        for sock in refused:
            sock.bind(("127.0.0.1", 0))
        coordinator, pub, snapshot = (f"tcp://127.0.0.1:{sock.getsockname()[1]}" for sock in refused)
        interrupter = _interrupt_once_handled(handlers)
        assert main(["drafter", "worker", "--model", str(random_model_dir), "--coordinator", coordinator, "--replica",
                     "0", "--set", f"checkpoint_dir={tmp_path}", "--set", f"capacity_pub={pub}",
                     "--set", f"capacity_snapshot={snapshot}", "--set", "worker_nice=0"]) == 0  # not this process
        interrupter.join(5)
    finally:
        for sock in refused:
            sock.close()
    assert {s: signal.getsignal(s) for s in HANDLED} == handlers


def test_a_command_that_leaves_its_handlers_or_log_context_does_not_change_later_tests() -> None:
    """tests/conftest.py's autouse fixture, driven by hand: what a command run in-process left (a handler that only
    queues the signal, a worker's service name bound to every log line) is undone after the test."""
    import conftest
    import structlog

    handlers = {s: signal.getsignal(s) for s in HANDLED}
    restoring = conftest._signals_and_log_context_restored.__wrapped__()
    next(restoring)
    for s in HANDLED:
        signal.signal(s, lambda signum, frame: None)
    structlog.contextvars.bind_contextvars(service="drafter-worker-0")
    with pytest.raises(StopIteration):
        next(restoring)
    assert {s: signal.getsignal(s) for s in HANDLED} == handlers
    assert "service" not in structlog.contextvars.get_contextvars()
