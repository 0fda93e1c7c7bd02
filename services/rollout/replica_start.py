"""How a replica process is started: a `multiprocessing` spawn, or a fork of a forkserver that already imported
torch, transformers and the engine.

A spawned replica imports torch and transformers' AutoTokenizer before it can load a model: about 8 s of one
core on the 2-core CI machine, against 0.2 s for the model itself (a tiny one) once they are imported. Every
server start paid it per replica, and so did every restart after a crash. A forkserver (one per front process,
started at the first replica) imports them once; each replica is then a fork of it, a fresh process that shares
none of the front's state (threads, sockets, the event loop), as a spawned one.

It is used only where a fork of that server is the same process a spawn would give:
- the native engine on a CPU device (a GPU replica's start is its model load; SGLang starts its own processes);
- no OpenMP spin count to set (`spin_wait` with more than one thread per replica): libgomp reads
  GOMP_SPINCOUNT when torch is loaded, which the forkserver did before any replica could set it;
- the environment, CPU affinity and standard output and error the forkserver started with (libgomp,
  Triton's TRITON_INTERPRET, logging read the environment at import; a fork keeps the server's affinity and
  descriptors): a front whose state changed since then spawns, except for variables nothing reads at import
  (`VOLATILE`: pytest's name of the running test, which changes with every test; the cache folder torch's
  inductor writes into the environment the first time it is asked for it, its default; the rendezvous
  variables DeepSpeed writes when a trainer in the same process starts, and the one `import deepspeed` sets,
  which torch reads only when asked whether CUDA is there, not at import). A forked replica then takes
  the front's environment as it is now (`serve_replica(environ=...)`), so what it reads later is the front's,
  as a spawned one's.
Anything else spawns, as before, and so does a start the forkserver failed (replica_lifecycle._spawn).

The forkserver ignores SIGINT and SIGTERM (forkserver_preload.py) and ends with the front. Its first start
imports torch: `warm` runs it off the front's event loop. A forked replica's parent is the forkserver, which
reaps it: the front learns its exit status through multiprocessing (poll before a kill).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing.context import BaseContext

# Imported, never run: no module here may run a torch parallel kernel at import. libgomp is not fork-safe; a pool
# started in the forkserver hangs a forked replica's first parallel kernel (tests/test_replica_start.py shows it).
PRELOAD = ["tlt.services.rollout.forkserver_preload", "torch", "transformers",
           "transformers.models.auto.tokenization_auto", "tlt.services.rollout.replica",
           "tlt.services.rollout.engine.engine"]

VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR",
                      "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "PYTORCH_NVML_BASED_CUDA_CHECK"})  # `import deepspeed` sets it; torch reads it when asked for CUDA

_lock = threading.Lock()
_forkserver_env: dict[str, str] | None = None  # current_env() when this process's forkserver was first used
_forkserver_state: tuple | None = None  # process_state() then
_reported: set[frozenset[str]] = set()  # the changes already logged


def environ() -> dict[str, str]:
    """A copy of os.environ. Iterating it is not atomic: another thread setting a variable meanwhile (a test,
    a library) raises RuntimeError, so it is tried again."""
    for _ in range(10):
        try:
            return dict(os.environ)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return dict(os.environ)


def current_env() -> dict[str, str]:
    """os.environ without the variables nothing reads at import (VOLATILE)."""
    return {k: v for k, v in environ().items() if k not in VOLATILE}


def process_state() -> tuple:
    """What else a fork takes from the forkserver rather than from the front: CPU affinity, and the files
    standard output and error point to (a front that redirected them later logs elsewhere)."""
    def target(fd: int) -> tuple[int, int] | None:
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    affinity = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return affinity, target(1), target(2)


def replica_context(backend: str, device: str, threads: int, spin_wait: bool) -> tuple[BaseContext, bool]:
    """The multiprocessing context to start a replica with, and whether it is the preloaded forkserver."""
    global _forkserver_env, _forkserver_state
    if backend != "native" or not device.startswith("cpu") or (spin_wait and threads != 1):
        return mp.get_context("spawn"), False
    env, state = current_env(), process_state()
    with _lock:
        if _forkserver_env is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _forkserver_env, _forkserver_state = env, state
        if env != _forkserver_env or state != _forkserver_state:
            changed = frozenset(k for k in env.keys() | _forkserver_env.keys() if env.get(k) != _forkserver_env.get(k))
            changed |= {name for name, now, then in zip(("cpu affinity", "stdout", "stderr"), state,
                                                          _forkserver_state) if now != then}
            _report(changed)
            return mp.get_context("spawn"), False
    return mp.get_context("forkserver"), True


def _report(changed: frozenset[str]) -> None:
    if changed in _reported:  # once per change: a server restarts its replicas many times
        return
    _reported.add(changed)
    from tlt.services.common.logging import get_logger

    get_logger("rollout.replica").info("replica_spawned", reason="changed since the forkserver started",
                                       changed=sorted(changed))


def warm(ctx: BaseContext) -> None:
    """Start the forkserver if `ctx` is it and it is not running (its preload imports torch: seconds, off the
    front's event loop). A failure is left to the replica's start, which spawns then."""
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    try:
        forkserver.ensure_running()
    except (OSError, EOFError):
        pass
