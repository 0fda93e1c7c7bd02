"""deploy/healthcheck.py, the container health check: unhealthy is exit 1 with the reason.

The healthy path is exercised against real servers by the compose-equivalence
tests (tests/test_compose.py); here: nothing listening, a server that answers
HTTP errors, and malformed arguments.
"""

from __future__ import annotations

import http.server
import importlib.util
import socket
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def healthcheck():
    spec = importlib.util.spec_from_file_location("healthcheck", ROOT / "deploy" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_nothing_listening_is_unhealthy(healthcheck, capsys):
    port = closed_port()
    for kind, target in (("http", f"http://127.0.0.1:{port}/health"), ("grpc-rollout", f"127.0.0.1:{port}"),
                         ("grpc-reward", f"127.0.0.1:{port}"), ("grpc-drafter", f"127.0.0.1:{port}")):
        assert healthcheck.main(["--timeout", "1", kind, target]) == 1
        assert "unhealthy" in capsys.readouterr().err


def test_http_error_status_is_unhealthy_and_200_is_healthy(healthcheck):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert healthcheck.main(["http", f"http://127.0.0.1:{port}/health"]) == 0
        assert healthcheck.main(["http", f"http://127.0.0.1:{port}/metrics"]) == 1
        # every check must pass: one failing pair makes the whole check fail
        assert healthcheck.main(["http", f"http://127.0.0.1:{port}/health", "http", f"http://127.0.0.1:{port}/x"]) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_malformed_arguments_exit_2(healthcheck):
    with pytest.raises(SystemExit) as e:
        healthcheck.main(["http"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        healthcheck.main(["tcp", "127.0.0.1:1"])
    assert e.value.code == 2
