"""`tlt reward serve` with `[reward] metrics_port` taken: one port_in_use line and exit 2, as for a taken gRPC port;
equal to its gRPC port: a config error, exit 2 (before: an OSError traceback, exit 1, for both). Real `tlt reward serve` processes on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys

from tlt.services.common.ports import free_port


def _serve(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tlt.cli", "reward", "serve", *argv, "--ready-file",
                           str(tmp_path / "ready.json")], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_a_taken_metrics_port_is_one_port_in_use_line_and_exit_2(tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        proc = _serve(tmp_path, "--port", "0", "--set", f"metrics_port={taken}")
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert "port_in_use" in lines[0] and f"127.0.0.1:{taken}" in lines[0] and "metrics" in lines[0], lines[0]
    assert not (tmp_path / "ready.json").exists()


def test_a_metrics_port_equal_to_the_grpc_port_is_refused_in_one_line(tmp_path) -> None:
    port = free_port()
    proc = _serve(tmp_path, "--port", str(port), "--set", f"metrics_port={port}")
    out = proc.stdout + proc.stderr  # a config error, in the house's form for them (the section named)
    assert proc.returncode == 2 and "bad_config" in out and "Traceback" not in out, out
    assert "metrics_port" in out and "is the gRPC port" in out, out
