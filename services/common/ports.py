"""Free TCP ports for services started on this machine (`tlt run`, the trainer's process group).

A port from bind(("127.0.0.1", 0)) comes from the kernel's ephemeral range, the same range outgoing
connections take their local ports from. Between picking it and the service binding it (seconds,
while other services start and connect), a client connection can take it: seen in `tlt bench e2e`,
where the rollout's capacity snapshot socket failed with "Address already in use" on port 33919.
So ports are drawn below the ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range), where
only another listener could take one, and each is checked by binding it; where the range starts at or
below LOWEST (set low by hand), above its end instead. Without that file (not Linux), or when no port
outside the range is free, it falls back to an ephemeral port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any


class PortInUseError(OSError):
    """A server could not bind its port: another process listens on it, or the host is not this machine's."""


def bind_grpc(server: Any, host: str, port: int, what: str) -> int:
    """`server.add_insecure_port(host:port)` (grpc or grpc.aio) -> the bound port; PortInUseError when it cannot bind
    (grpc raises RuntimeError on some versions and returns 0 on others)."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise PortInUseError(in_use_message(what, host, port))
    return bound


def bind_tcp(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR, not listening yet); PortInUseError when it cannot bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PortInUseError(f"{in_use_message(what, host, port)} ({e.strerror})") from None
    return sock


def in_use_message(what: str, host: str, port: int) -> str:
    return (f"{what} could not bind {host}:{port}: another process listens on that port, or {host} is not an address "
            "of this machine; choose another port (0 picks a free one)")


RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # the lowest port drawn: clear of the low ports other services commonly listen on
HIGHEST = 65535


def ephemeral_range(path: Path = RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's (first, last) ephemeral port, or None where it cannot be read."""
    try:
        first, last = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return first, last


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None, tries: int = 200,
              range_file: Path = RANGE_FILE) -> int:
    """A port that is free now and outside the ephemeral range (see the module docstring)."""
    rng = rng or random.SystemRandom()
    eph = ephemeral_range(range_file)
    if eph is not None:
        # below the range; or, where the range starts at or under LOWEST (set low by hand), above its end
        span = (LOWEST, eph[0] - 1) if eph[0] - 1 > LOWEST else (eph[1] + 1, HIGHEST)
        for _ in range(tries if span[0] <= span[1] else 0):
            port = rng.randint(*span)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports (each drawn as `free_port` draws; none is bound until the caller binds it)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(host)
        if p not in ports:
            ports.append(p)
    return ports
