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
- the environment the forkserver started with (libgomp, Triton's TRITON_INTERPRET, logging all read it at
  import): a front whose environment changed since then spawns, except for variables nothing reads at import
  (`VOLATILE`: pytest's name of the running test, which changes with every test; the cache folder torch's
  inductor writes into the environment the first time it is asked for it, its default; the rendezvous
  variables DeepSpeed writes when a trainer in the same process starts, which a replica never reads). A forked replica then takes
  the front's environment as it is now (`serve_replica(environ=...)`), so what it reads later is the front's,
  as a spawned one's.
Anything else spawns, as before.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing.context import BaseContext

PRELOAD = ["torch", "transformers", "transformers.models.auto.tokenization_auto",
           "tlt.services.rollout.replica", "tlt.services.rollout.engine.engine"]

VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR",
                      "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})

_lock = threading.Lock()
_forkserver_env: dict[str, str] | None = None  # current_env() when this process's forkserver was first used
_reported: set[frozenset[str]] = set()  # the changed variables already logged


def current_env() -> dict[str, str]:
    """os.environ without the variables nothing reads at import (VOLATILE)."""
    return {k: v for k, v in os.environ.items() if k not in VOLATILE}


def replica_context(backend: str, device: str, threads: int, spin_wait: bool) -> tuple[BaseContext, bool]:
    """The multiprocessing context to start a replica with, and whether it is the preloaded forkserver."""
    global _forkserver_env
    if backend != "native" or not device.startswith("cpu") or (spin_wait and threads != 1):
        return mp.get_context("spawn"), False
    env = current_env()
    with _lock:
        if _forkserver_env is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _forkserver_env = env
        if env != _forkserver_env:
            changed = frozenset(k for k in env.keys() | _forkserver_env.keys() if env.get(k) != _forkserver_env.get(k))
            if changed not in _reported:  # once per set: a server restarts its replicas many times
                _reported.add(changed)
                from tlt.services.common.logging import get_logger

                get_logger("rollout.replica").info("replica_spawned", reason="the environment changed since the "
                                                   "forkserver started", variables=sorted(changed))
            return mp.get_context("spawn"), False
    return mp.get_context("forkserver"), True
