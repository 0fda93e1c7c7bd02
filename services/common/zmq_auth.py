"""ZeroMQ under the control token: CURVE with keys derived from the token, a ZAP check on every binding side.

The drafter's ZeroMQ sockets (capacity PUB/REP, features PUSH/PULL, the coordinator's ROUTER; events.py,
services/drafter/coordinator*.py) follow the control plane's rule (auth.py):

    token configured (the config's token, else TLT_AUTH_TOKEN, else the file in TLT_AUTH_TOKEN_FILE)
        -> CURVE: the binding side is the CURVE server, every connecting side a CURVE client; both keypairs are
           derived from the token (scrypt -> 32-byte master -> HMAC-SHA256 per role -> zmq.curve_public), and a
           ZAP authenticator in the binding side's context accepts the derived client key only. A peer without
           the token, or with another one, never completes the handshake: nothing it sends is delivered and it
           reads nothing (traffic is encrypted as well).
    no token configured
        -> plain ZeroMQ as before, where the bind is local (loopback tcp, ipc://, inproc://); a bind on any other
           address is refused (ZmqAuthError, a ConfigError: one line) — set a token, or bind loopback.

So both ends need only the token, which reaches every process the way the gRPC control token does: `tlt run`
sets TLT_AUTH_TOKEN for its children, Compose and Kubernetes hand every service the same token file or Secret,
a rollout passes its own to its replicas (their features PUSH), the drafter service to its workers (their config).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85

from tlt.services.common.auth import TOKEN_ENV, TOKEN_FILE_ENV, AuthConfigError, is_loopback, resolve_token
from tlt.services.common.logging import get_logger

log = get_logger("zmq_auth")

ZAP_DOMAIN = "tlt"
_SALT = b"tlt zmq curve v1"


class ZmqAuthError(AuthConfigError):
    """A ZeroMQ bind that would be open to anyone: no control token and a non-local address."""


@dataclass(frozen=True)
class CurveKeys:
    """z85-encoded CURVE keypairs of the binding (server) and connecting (client) sides."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


@functools.lru_cache(maxsize=8)
def curve_keys(token: str) -> CurveKeys:
    """The keypairs every holder of `token` derives alike. scrypt makes guessing a weak token from a public key
    slow; the secret keys are HMAC-SHA256 of the master per role (any 32 bytes are a Curve25519 secret)."""
    master = hashlib.scrypt(token.encode(), salt=_SALT, n=1 << 14, r=8, p=1, dklen=32)
    server_secret = z85.encode(hmac.digest(master, b"server", "sha256"))
    client_secret = z85.encode(hmac.digest(master, b"client", "sha256"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc:// and inproc:// and for a tcp endpoint on a loopback address ('tcp://*:p' is every address)."""
    scheme = urlsplit(endpoint).scheme
    if scheme in ("ipc", "inproc"):
        return True
    return is_loopback(endpoint)


class _OnlyKey:
    """The ZAP credentials provider (pyzmq's `configure_curve_callback`): the one derived client key passes."""

    # a refused peer tries again each reconnect interval (a refused PUSH on 127.0.0.1: 21 handshakes in 3 s, sending
    # or not; once the binding side has its token it is let in within the interval): one warning a minute, counted
    LOG_EVERY_S = 60.0

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.refused = 0
        self._logged_at = -self.LOG_EVERY_S

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.key)
        if not ok:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged_at >= self.LOG_EVERY_S:
                self._logged_at = now
                log.warning("zmq_peer_refused", reason="a CURVE client key not derived from the control token",
                            total=self.refused)
        return ok


class ZmqAuth:
    """The security of the sockets of one ZeroMQ context: `bind` and `connect` set each socket up before it binds
    or connects; `close()` (before the context's `term`) stops the ZAP authenticator a bind started.

    `token`: the config's token; empty reads TLT_AUTH_TOKEN, then TLT_AUTH_TOKEN_FILE (auth.resolve_token)."""

    def __init__(self, ctx: zmq.Context, token: str = "") -> None:
        self.ctx = ctx
        self.token = resolve_token(token)
        self.keys = curve_keys(self.token) if self.token else None
        self._authenticator = None  # zmq.auth.thread.ThreadAuthenticator, started by the first bind
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:
        return "curve" if self.keys is not None else "plain"

    def bind(self, sock: zmq.Socket, endpoint: str) -> None:
        """Bind `sock` as a CURVE server that admits the token's clients only; with no token, plain where
        `endpoint` is local, else ZmqAuthError."""
        if self.keys is None:
            if not is_local_endpoint(endpoint):
                raise ZmqAuthError(f"ZeroMQ bind {endpoint} refused: no control token is configured ({TOKEN_ENV} or "
                                   f"{TOKEN_FILE_ENV}) and the address is not loopback; set a token (every peer "
                                   "needs the same one) or bind 127.0.0.1")
            sock.bind(endpoint)
            return
        self._start_authenticator()
        if sock.rcvhwm == 1:  # libzmq 4.3.5 with a ZAP handler delivers nothing through a receive queue of one
            sock.rcvhwm = 2   # (measured: the first message never arrives); two holds the same one message
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True
        sock.curve_secretkey = self.keys.server_secret
        sock.bind(endpoint)

    def bind_or_release(self, *binds: tuple[zmq.Socket, str]) -> None:
        """`bind` each (socket, endpoint); when one fails (ZMQError, or ZmqAuthError: a ValueError), close every one
        of them, stop the authenticator and end the context, then raise: a constructor that fails leaves nothing."""
        try:
            for sock, endpoint in binds:
                self.bind(sock, endpoint)
        except (zmq.ZMQError, ValueError):
            for sock, _ in binds:
                sock.close()
            self.close()
            self.ctx.term()
            raise

    def connect(self, sock: zmq.Socket, endpoint: str, watch: bool = False) -> HandshakeWatch | None:
        """Connect `sock` as a CURVE client of the token's server; with no token, plain. `watch`: also return a
        HandshakeWatch of its handshakes (made before the connect, so the first one is seen)."""
        watcher = HandshakeWatch(sock, endpoint, self.mode) if watch else None
        if self.keys is not None:
            sock.curve_serverkey = self.keys.server_public
            sock.curve_publickey = self.keys.client_public
            sock.curve_secretkey = self.keys.client_secret
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            if watcher is not None:
                watcher.close()
            raise
        return watcher

    def _start_authenticator(self) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        with self._lock:
            if self._authenticator is not None:
                return
            assert self.keys is not None
            auth = ThreadAuthenticator(self.ctx, log=log_adapter())
            auth.start()
            auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_OnlyKey(self.keys.client_public))
            self._authenticator = auth

    def close(self) -> None:
        with self._lock:
            if self._authenticator is not None:
                self._authenticator.stop()
                self._authenticator = None

    def __enter__(self) -> ZmqAuth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


HANDSHAKE_WARN_EVERY_S = 60.0  # one zmq_handshake_failed warning per endpoint (and token mode) this often, at most
_handshake_warned: dict[tuple[str, str], float] = {}  # (endpoint, mode) -> monotonic time of its last warning
_handshake_lock = threading.Lock()


class HandshakeWatch:
    """Whether a connecting socket's ZeroMQ handshakes fail, which a refused peer otherwise never says: a CURVE
    server drops a plain client (no token here) or one with another token's keys, so pushes are dropped, requests go
    unanswered and nothing is logged. `hint()` drains the socket's monitor and, while the last handshake failed,
    returns one line saying the peer may require the control token. It is logged as `zmq_handshake_failed` once per
    watch and, across the watches of one process, once per endpoint every HANDSHAKE_WARN_EVERY_S (debug between):
    a snapshot asked again every 2 s makes a watch each time, and repeated the warning every 2 s for good.
    `close()` before the socket's context's `term` (the monitor is a socket of that context)."""

    EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def __init__(self, sock: zmq.Socket, endpoint: str, mode: str) -> None:
        self.endpoint, self.mode = endpoint, mode
        self.failures = 0  # handshakes that failed since the last that succeeded
        self._sock = sock
        self._mon: zmq.Socket | None = sock.get_monitor_socket(events=self.EVENTS)
        self._warned = False

    def hint(self) -> str:
        while self._mon is not None and self._mon.poll(0):
            frames = self._mon.recv_multipart()
            event = int.from_bytes(frames[0][:2], "little")  # ZMQ monitor frame: uint16 event, uint32 value
            self.failures = 0 if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else self.failures + 1
        if not self.failures:
            return ""
        have = "no control token is configured here" if self.mode == "plain" else "this process's token"
        line = (f"the ZeroMQ handshake with {self.endpoint} failed {self.failures} time(s): the peer may require the "
                f"control token, or another one ({have}; set the same {TOKEN_ENV} or {TOKEN_FILE_ENV} on both ends)")
        if not self._warned:
            self._warned = True
            now, key = time.monotonic(), (self.endpoint, self.mode)
            with _handshake_lock:
                last = _handshake_warned.get(key)
                due = last is None or now - last >= HANDSHAKE_WARN_EVERY_S
                if due:
                    _handshake_warned[key] = now
            (log.warning if due else log.debug)("zmq_handshake_failed", endpoint=self.endpoint,
                                                 failures=self.failures, hint=line)
        return line

    def close(self) -> None:
        if self._mon is not None:
            self._sock.disable_monitor()
            self._mon.close(linger=0)
            self._mon = None


def log_adapter() -> object:
    """A stdlib logger for pyzmq's authenticator (it logs every decision at debug)."""
    import logging

    return logging.getLogger("tlt.zmq_auth.zap")
