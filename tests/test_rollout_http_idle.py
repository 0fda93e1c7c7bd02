"""The rollout's HTTP port closes connections that never finish a request, and leaves working ones alone.

uvicorn arms its keep-alive timer only after a response, so a socket that never sent a request (or sent half of
one) stayed open forever: with the common 1024 open-file limit, one peer holding ~1,100 of them took the HTTP and
gRPC ports down (`OSError: [Errno 24] Too many open files`). With `[rollout] http_idle_timeout_s` short, raw
sockets that send nothing, half a header, or a header and part of the body are closed by the server; a keep-alive
client idle between requests, a streamed answer and a non-streamed one that take longer than the timeout are not.
The server also raises its soft open-file limit to the hard one at start.

Real server on loopback (real replica, real uvicorn). The one seam: `SlowEngine`, the real engine sleeping before
each step (the replica imports it from this module as its backend), so a request outlasts the timeout.
"""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.rollout.engine.engine import LLMEngine

IDLE_S = 1.0


class SlowEngine(LLMEngine):
    """The native engine, 0.05 s slower per step: 40 tokens take 2 s, twice IDLE_S."""

    def step(self) -> Any:
        time.sleep(0.05)
        return super().step()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # the common default, below the hard one
    model = tiny_checkpoint(tmp_path_factory.mktemp("idle-model"))
    try:
        with ServerThread(model, backend="test_rollout_http_idle:SlowEngine", http_idle_timeout_s=IDLE_S) as s:
            yield s
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _get(sock: socket.socket, port: int) -> bytes:
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the server closed a keep-alive connection between requests"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head.split(b"\r\n")[0]


def test_open_file_limit_raised_to_hard(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard


def test_idle_and_half_sent_connections_are_closed(server):
    port = server.server.http_port
    silent = socket.create_connection(("127.0.0.1", port))
    half_header = socket.create_connection(("127.0.0.1", port))
    half_header.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    half_body = socket.create_connection(("127.0.0.1", port))
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
    # after one answered request, half of the next one (uvicorn's keep-alive timer stops at its first byte)
    after_answer = socket.create_connection(("127.0.0.1", port))
    assert b"200" in _get(after_answer, port)
    after_answer.sendall(b"GET /health HT")
    t0 = time.monotonic()
    try:
        for name, sock in (("silent", silent), ("half header", half_header), ("half body", half_body),
                           ("half of a second request", after_answer)):
            assert _closed_by_server(sock, IDLE_S + 4), f"the {name} connection is still open"
        assert time.monotonic() - t0 < IDLE_S + 4
    finally:
        for sock in (silent, half_header, half_body, after_answer):
            sock.close()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_working_connections_are_not_cut(server):
    """A keep-alive client idle longer than the timeout between requests (uvicorn's own 5 s keep-alive governs
    it), and a streamed and a non-streamed request that each take twice the timeout, one of them silent meanwhile."""
    port = server.server.http_port
    body = {"model": server.model_name, "prompt": "1+1=", "max_tokens": 40, "ignore_eos": True}
    results: dict[str, Any] = {}

    def stream() -> None:
        usage, done = None, False
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.base_url}/completions", json=streamed, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
                done = done or line == "data: [DONE]"
        results["stream"] = (done, usage and usage["completion_tokens"])

    def whole() -> None:
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        results["whole"] = (r.status_code, r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    with socket.create_connection(("127.0.0.1", port)) as keep_alive:
        assert b"200" in _get(keep_alive, port)
        time.sleep(IDLE_S * 2)
        assert b"200" in _get(keep_alive, port)  # the same connection
    for t in threads:
        t.join(60)
    assert time.monotonic() - t0 > IDLE_S * 1.5, "the requests were too quick to show anything"
    assert results["whole"] == (200, 40)
    assert results["stream"] == (True, 40), json.dumps(results)


def test_the_setting_is_validated():
    from tlt.services.rollout.config import RolloutConfig

    assert RolloutConfig().http_idle_timeout_s == 60
    with pytest.raises(ValueError):
        RolloutConfig(http_idle_timeout_s=-1)


def test_a_slow_upload_that_keeps_coming_is_not_cut(server):
    """A body that arrives slowly but steadily (a 1.2 KB piece every half timeout, three timeouts in all: 2.4 KB/s)
    is read to its end and answered: the wait counts from the last byte, as nginx's client_body_timeout (it was cut a
    timeout after its header, so an upload under max_request_bytes / 60 s, 17 KB/s for 1 MB, never got through)."""
    port = server.server.http_port
    body = json.dumps({"model": server.model_name, "prompt": "1+1=", "max_tokens": 2}).encode() + b" " * 7000
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        pieces = 6
        step = -(-len(body) // pieces)
        t0 = time.monotonic()
        for i in range(0, len(body), step):
            time.sleep(IDLE_S / 2)
            sock.sendall(body[i:i + step])
        assert time.monotonic() - t0 >= IDLE_S * 2.5
        sock.settimeout(30)
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_a_body_trickled_a_byte_at_a_time_is_still_cut(server):
    """The other side of counting from the last byte: a peer sending one byte every half timeout (each resets that
    wait) held its socket for ever, and 1,100 such sockets take HTTP and gRPC down. A body slower than
    MIN_BODY_BYTES_S (1 KB/s) past the timeout is cut, as Apache's MinRate; chunk extensions (bytes that never
    grow the body) count no differently."""
    port = server.server.http_port
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        socks[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
        socks[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n1;")
        t0 = time.monotonic()
        alive = [True, True]
        while any(alive) and time.monotonic() - t0 < IDLE_S * 8:
            time.sleep(IDLE_S / 2)
            for i, (sock, byte) in enumerate(zip(socks, (b" ", b"a"))):
                if alive[i]:
                    try:
                        sock.sendall(byte)
                    except OSError:
                        alive[i] = False
        assert not any(alive), f"still open after {time.monotonic() - t0:.1f} s: {alive}"
        assert time.monotonic() - t0 < IDLE_S + 4
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
