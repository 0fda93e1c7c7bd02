"""`RolloutServer`: the front process — replicas, the HTTP API and the gRPC API on one event loop.

    start():  the soft open-file limit raised to the hard one -> both ports bound (0 = a free port; one in use
              fails here, not after minutes of model loading)
              -> ReplicaPool (N processes, model loaded), and meanwhile the front's tokenizer (for prompts and
                 streamed text) and API modules on a thread -> gRPC server (tlt.v1.Rollout) -> uvicorn (OpenAI
                 HTTP) serving on the bound ports; HTTP connections with no complete request for
                 [rollout] http_idle_timeout_s are closed (IdleHttpConnections)
    stop():   requests in flight fail (503 / UNAVAILABLE) -> gRPC stops (grace) -> uvicorn exits -> replicas shut down

Everything runs on one asyncio loop; `tlt rollout serve` runs it on the main
thread until SIGINT/SIGTERM, tests run it on a thread of their own.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from tlt.services.common.auth import is_loopback, resolve_api_key, resolve_token
from tlt.services.common.channels import SERVER_KEEPALIVE
from tlt.services.common.cpus import replica_threads, usable_cores
from tlt.services.common.gc_heap import GcPauses, freeze_heap
from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.common.ports import bind_grpc, bind_tcp
from tlt.services.rollout.config import RolloutConfig
from tlt.services.rollout.front_prompts import RequestThreads

log = get_logger("rollout.server")

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.max_send_message_length", 256 << 20),
    # grpc sets SO_REUSEPORT by default: a second server on a port another one already serves would start
    # without error and the kernel would split connections (weight pushes too) between the two processes.
    ("grpc.so_reuseport", 0),
    *SERVER_KEEPALIVE,  # the clients ping while their calls wait (RolloutClient keepalive_s)
]


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to the hard one (as vLLM does) and return it. Every HTTP and gRPC
    connection holds a descriptor, and the common soft default of 1024 is what a few hundred clients, or one peer
    holding idle sockets, use up: then both ports fail with `OSError: [Errno 24] Too many open files`."""
    try:
        import resource
    except ImportError:  # no such limit to raise (Windows)
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, 1 << 16):  # macOS reports an unlimited hard limit it refuses as a soft one
        if soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
            break
        except (ValueError, OSError):
            continue
    log.info("open_file_limit", soft=soft, hard="unlimited" if hard == resource.RLIM_INFINITY else hard)
    return soft


MIN_BODY_BYTES_S = 1024  # a request body that keeps coming slower than this (after the idle timeout) is cut


class IdleHttpConnections:
    """Closes HTTP connections that have had no complete request for `timeout_s`.

    uvicorn arms its keep-alive timer only once a response is complete, so a connection that never sends a request,
    or sends part of one, is otherwise kept forever. A sweep looks at each of uvicorn's connections:
      no request yet, or part of its header          -> waiting since the sweep that first saw it so
      a request whose body has not all come, no answer -> waiting since its last byte came (as nginx's
                                                          client_body_timeout: a slow upload that keeps coming is read),
                                                          and closed too once its bytes since the sweep that first saw
                                                          it fall below MIN_BODY_BYTES_S a second past the timeout (as
                                                          Apache's MinRate: a byte every 59 s held a socket for ever)
      a complete answer, then part of the next request -> waiting (uvicorn's timer stops at the first byte)
      a complete answer, uvicorn's keep-alive armed    -> uvicorn's to close
      a request being answered (streamed or not)       -> never closed
    Read from the attributes h11's and httptools' protocols both have (`cycle`, `timeout_keep_alive_task`,
    `transport`); a connection without them (a WebSocket) is left alone.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # connection -> (its cycle, state, since, when first seen so, bytes received by then)
        self._waiting: dict[Any, tuple[Any, str, float, float, int]] = {}

    @staticmethod
    def _waiting_state(conn: Any) -> str | None:
        cycle = getattr(conn, "cycle", conn)
        if cycle is conn:
            return None
        if cycle is None:
            return "no request"
        if cycle.response_complete:
            return None if getattr(conn, "timeout_keep_alive_task", None) is not None else "part of the next request"
        if cycle.more_body and not cycle.response_started:
            return "part of a body"
        return None

    def sweep(self, connections: Any) -> int:
        """Close the connections waiting past the timeout; return how many."""
        now = time.monotonic()
        waiting: dict[Any, tuple[Any, str, float, float, int]] = {}
        closed = 0
        for conn in list(connections):
            state = self._waiting_state(conn)
            transport = getattr(conn, "transport", None)
            if state is None or transport is None or transport.is_closing():
                continue
            cycle = conn.cycle
            prev = self._waiting.get(conn)
            same = prev is not None and prev[0] is cycle and prev[1] == state
            received = getattr(conn, "bytes_in", 0)
            since = prev[2] if same else now
            first, got = (prev[3], prev[4]) if same else (now, received)
            too_slow = False
            if state == "part of a body":
                since = max(since, getattr(conn, "last_data_s", since))
                too_slow = now - first > self.timeout_s + (received - got) / MIN_BODY_BYTES_S
            if now - since >= self.timeout_s or too_slow:
                transport.close()
                closed += 1
            else:
                waiting[conn] = (cycle, state, since, first, got)
        self._waiting = waiting
        return closed


def _http_protocol() -> type:
    """uvicorn's HTTP protocol (h11 or httptools, as it picks), noting when each connection last received bytes."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class _Protocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        last_data_s = 0.0
        bytes_in = 0

        def data_received(self, data: bytes) -> None:
            self.last_data_s = time.monotonic()
            self.bytes_in += len(data)
            super().data_received(data)

    return _Protocol


def _uvicorn_server(app: Any, log_level: str, idle_timeout_s: float = 0.0) -> Any:
    import uvicorn

    idle = IdleHttpConnections(idle_timeout_s) if idle_timeout_s > 0 else None
    every = max(1, min(10, int(idle_timeout_s / 0.4)))  # uvicorn ticks every 0.1 s: sweep about 4 times a timeout

    class _Server(uvicorn.Server):
        def capture_signals(self) -> Any:  # the owner of the loop handles signals, not uvicorn
            return nullcontext()

        async def on_tick(self, counter: int) -> bool:
            if idle is not None and counter % every == 0:
                closed = idle.sweep(self.server_state.connections)
                if closed:
                    log.info("http_idle_closed", connections=closed, idle_timeout_s=idle.timeout_s)
            return await super().on_tick(counter)

    return _Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                  timeout_graceful_shutdown=5, http=_http_protocol()))


def _front_tokenizer(model_dir: str) -> Any:
    """The front's tokenizer, with the API modules imported: run on a thread while the replicas load."""
    import tlt.services.rollout.grpc_api  # noqa: F401
    import tlt.services.rollout.http_api  # noqa: F401
    from tlt.model.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


class RolloutServer:
    """The rollout front: replicas, the OpenAI HTTP API and the gRPC API. `freeze_gc`: freeze this process's heap
    once everything is built, before it serves (`tlt rollout serve` sets it from [rollout] gc_freeze; never in a
    process whose heap is not its own, such as a test's: services/common/gc_heap.py)."""

    def __init__(self, model_dir: str | os.PathLike[str], config: RolloutConfig, freeze_gc: bool = False) -> None:
        self.model_dir = str(Path(model_dir).resolve())
        self.config = config
        self.model_name = config.served_model_name or Path(self.model_dir).name
        self.http_port = 0
        self.grpc_port = 0
        self.pool: Any = None
        self._http: Any = None
        self._http_task: asyncio.Task | None = None
        self._grpc: Any = None
        self._http_sock: socket.socket | None = None  # bound before the replicas load, served once they have
        self.capacity: Any = None  # CapacityPublisher when [rollout] capacity_pub is set
        self.freeze_gc = freeze_gc
        self.gc_pauses = GcPauses()  # the front's collections since it began serving, on /metrics
        self.request_threads: RequestThreads | None = None

    async def start(self) -> None:
        import grpc

        from tlt.services.rollout.replicas import ReplicaPool

        cfg = self.config
        api_key = resolve_api_key(cfg.api_key)  # an unusable key fails in one line, before anything is bound or loaded
        raise_open_file_limit()
        self.gc_pauses.install()
        self._grpc = grpc.aio.server(options=GRPC_OPTIONS)
        self.grpc_port = bind_grpc(self._grpc, cfg.host, cfg.grpc_port, "the rollout gRPC server")
        self._http_sock = bind_tcp(cfg.host, cfg.http_port, "the rollout HTTP server")
        self.http_port = self._http_sock.getsockname()[1]
        cores = usable_cores()  # the affinity mask capped by a container's CPU quota, not the host's core count
        threads, spin_ok = replica_threads(cfg.replicas, cfg.threads_per_replica, cores)
        if cfg.spin_wait and not spin_ok:
            log.warning("spin_wait_off", replicas=cfg.replicas, threads_per_replica=threads, cores=cores,
                        reason="replicas x threads exceeds the cores: replicas sharing cores must wait passively")
        if cfg.capacity_pub:
            from tlt.services.common.events import CapacityPublisher

            self.capacity = CapacityPublisher(cfg.capacity_pub, cfg.capacity_snapshot or "tcp://127.0.0.1:*",
                                              server_id=f"rollout-{os.getpid()}", heartbeat_s=cfg.capacity_heartbeat_s,
                                              token=cfg.control_token)
            log.info("capacity_events", pub=self.capacity.pub_endpoint, snapshot=self.capacity.snapshot_endpoint)
        self.pool = ReplicaPool(self.model_dir, cfg.backend, cfg.engine, cfg.replicas, threads, self.capacity,
                                cfg.features_push, cfg.features_max_tokens,
                                cfg.spec if cfg.backend == "native" else None, max_restarts=cfg.max_restarts,
                                pin_cpus=cfg.pin_cpus, spin_wait=cfg.spin_wait and spin_ok,
                                stall_timeout_s=cfg.stall_timeout_s, redispatch_limit=cfg.redispatch_limit,
                                max_pending_sequences=cfg.max_pending_sequences, gc_freeze=cfg.gc_freeze,
                                features_token=resolve_token(cfg.control_token))
        log.info("replicas_starting", replicas=cfg.replicas, threads_per_replica=threads, model=self.model_dir)
        # The front's own imports and tokenizer (3 s in a fresh `tlt rollout serve`) while the replicas load.
        replicas_up = asyncio.ensure_future(self.pool.start(cfg.startup_timeout_s))
        try:
            tokenizer = await asyncio.to_thread(_front_tokenizer, self.model_dir)
            await replicas_up
        except BaseException:  # a tokenizer that fails, or start() cancelled: the pool's start goes too
            replicas_up.cancel()
            await asyncio.gather(replicas_up, return_exceptions=True)
            raise
        from tlt.services.rollout.grpc_api import RolloutService
        from tlt.services.rollout.http_api import OpenAIServer
        from tlt.v1 import rollout_pb2_grpc

        metrics = Metrics("rollout")
        # requests' own work (prompts, responses) on threads of their own, not asyncio's default executor, which
        # assembles weight pushes: a burst of slow prompts queued a push behind it (front_prompts.RequestThreads)
        self.request_threads = RequestThreads(min(32, cores + 4) if cores else None)
        openai_server = OpenAIServer(self.pool, tokenizer, self.model_name, cfg, api_key, metrics, self.gc_pauses,
                                     self.request_threads)
        # one registry: gRPC calls count on the same /metrics (the HTTP app serves it) and add to the same counters
        service = RolloutService(self.pool, tokenizer, self.model_name, cfg, rejected=openai_server.m_rejected,
                                 metrics=metrics, work=self.request_threads)
        rollout_pb2_grpc.add_RolloutServicer_to_server(service, self._grpc)
        if self.freeze_gc:  # built, not serving yet: no connection's state is frozen, no client waits on the collection
            log.info("gc_frozen", objects=freeze_heap())
        self.gc_pauses.reset()  # /metrics counts what serving costs, not the startup's collections
        await self._grpc.start()

        self._http = _uvicorn_server(openai_server.app, "warning", cfg.http_idle_timeout_s)
        self._http_task = asyncio.ensure_future(self._http.serve(sockets=[self._http_sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # raises why uvicorn could not start
            await asyncio.sleep(0.02)
        log.info("rollout_serving", http=f"http://{cfg.host}:{self.http_port}/v1",
                 grpc=f"{cfg.host}:{self.grpc_port}", model=self.model_name, replicas=cfg.replicas,
                 control_auth=service.auth.mode, api_key=bool(openai_server.api_key))
        if not is_loopback(cfg.host):
            log.warning("exposed_bind", host=cfg.host, control_auth=service.auth.mode,
                        api_key=bool(openai_server.api_key),
                        hint="reachable from other machines; set TLT_API_KEY to protect /v1/*")

    async def stop(self) -> None:
        self.gc_pauses.uninstall()
        if self.pool is not None:  # requests in flight end now with a clear 503 / UNAVAILABLE, not cut off later
            self.pool.refuse_requests("the server is shutting down")
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:  # a uvicorn that failed to start raised in start(): not again here, where
                await asyncio.gather(self._http_task, return_exceptions=True)  # it would skip the replicas' stop
        if self._http_sock is not None:  # uvicorn closed it if it served; a start that failed before had not
            self._http_sock.close()
        if self.pool is not None:
            await self.pool.stop()
        if self.capacity is not None:
            self.capacity.close()
        if self.request_threads is not None:
            self.request_threads.close()
        log.info("rollout_stopped")

    def replica_pids(self) -> list[int]:
        return [r.process.pid for r in self.pool.replicas if r.process.pid]
