"""Service ports come from below the kernel's ephemeral range (services/common/ports.py).

Why: an ephemeral port picked for a listener can be taken by an outgoing connection before the
service binds it ("Address already in use" seen in `tlt bench e2e`). Real sockets on 127.0.0.1.
"""

from __future__ import annotations

import random
import socket

from tlt.services.common.ports import LOWEST, ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_and_bindable():
    eph = ephemeral_range()
    ports = {free_port() for _ in range(20)}
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out
        if eph is not None:
            assert LOWEST <= p < eph[0]
    assert len(ports) > 1  # drawn at random, not one fixed port


def test_a_taken_port_is_skipped(tmp_path):
    rng_file = tmp_path / "range"
    rng_file.write_text("30000\t60999\n")
    busy = free_port(range_file=rng_file)  # some port in [LOWEST, 30000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()

        class BusyFirst(random.Random):
            draws: list[int] = []

            def randint(self, a, b):  # the taken port first, then any other
                port = busy if not self.draws else random.randint(a, b)
                self.draws.append(port)
                return port

        rng = BusyFirst()
        got = free_port(rng=rng, range_file=rng_file)
        assert rng.draws[0] == busy and got != busy and LOWEST <= got < 30000


def test_without_a_range_file_it_falls_back_to_an_ephemeral_port(tmp_path):
    p = free_port(range_file=tmp_path / "missing")
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


def test_a_run_gets_distinct_ports():
    from tlt.services.common.ports import free_ports

    ports = free_ports(8)
    assert len(set(ports)) == 8


def test_rollout_server_refuses_a_grpc_port_another_server_serves(tmp_path):
    """grpc binds with SO_REUSEPORT by default: a second server on a taken port started silently and the kernel
    split connections (weight pushes included) between the two. The rollout server must refuse the port."""
    import asyncio
    from concurrent import futures

    import grpc
    import pytest
    from rollout_helpers import rollout_config, tiny_checkpoint

    from tlt.services.rollout.server import RolloutServer

    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # any grpc server, default options
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    server = RolloutServer(tiny_checkpoint(tmp_path / "model"), rollout_config(grpc_port=port, replicas=1))

    async def start_then_stop() -> None:
        try:
            await server.start()
        finally:
            await server.stop()

    try:
        with pytest.raises(OSError, match=f"rollout gRPC server could not bind 127.0.0.1:{port}"):
            asyncio.run(start_then_stop())
        assert server.pool is None  # refused before any replica loaded the model
    finally:
        other.stop(0)


def test_a_rollout_start_that_fails_after_binding_its_ports_frees_them_on_stop(tmp_path):
    """Both ports are bound first; a start that fails after that (here the capacity publisher, whose port another
    socket holds) is stopped as `tlt rollout serve` stops it, and the stop frees the HTTP port too, which uvicorn,
    never started, had not: a retry in the same process on that port found it in use."""
    import asyncio
    import socket

    import pytest
    import zmq
    from rollout_helpers import rollout_config, tiny_checkpoint

    from tlt.services.rollout.server import RolloutServer

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        server = RolloutServer(tiny_checkpoint(tmp_path / "model"),
                               rollout_config(replicas=1, capacity_pub=f"tcp://127.0.0.1:{taken}"))

        async def start_then_stop() -> None:
            try:
                await server.start()
            finally:
                await server.stop()

        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            asyncio.run(start_then_stop())
    assert server.http_port and server.pool is None  # the HTTP port was bound, no replica started
    with socket.socket() as again:
        again.bind(("127.0.0.1", server.http_port))  # EADDRINUSE had the failed start kept it


def test_a_port_in_use_or_a_bad_setting_fails_at_once_with_one_line_not_a_traceback(tmp_path, capfd):
    """`tlt rollout serve` used to load the model into every replica (minutes for a large model) and only then find
    its HTTP port taken, and end in a traceback; `tlt reward serve` too, and a bad `--set` of the rollout likewise.
    Now the ports are bound first, and these (the user's to fix) end with one log line and exit code 2.
    The rollout's HTTP port case is a real CLI process (its exit status and output); the others run `tlt.cli.main`
    in this process (the same code, without seconds of imports each). The port is held by a plain listening socket
    of this test."""
    import subprocess
    import sys

    from rollout_helpers import tiny_checkpoint

    from tlt.cli import main

    def tlt(argv: list[str], real: bool = False) -> tuple[int | str, str]:
        if real:
            r = subprocess.run([sys.executable, "-m", "tlt.cli", *argv], capture_output=True, text=True, timeout=120)
            return r.returncode, r.stdout + r.stderr
        capfd.readouterr()
        try:
            rc: int | str = main(argv)
        except Exception as e:  # noqa: BLE001 - what the user would have seen as a traceback
            rc = f"Traceback: {type(e).__name__}: {e}"
        return rc, "".join(capfd.readouterr())

    model = tiny_checkpoint(tmp_path / "model", max_position_embeddings=1024)  # cpu-tiny's max_model_len
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cases = {
            "rollout http": ["rollout", "serve", "--model", str(model), "--http-port", str(port),
                             "--grpc-port", "0", "--insecure-local"],
            "rollout grpc": ["rollout", "serve", "--model", str(model), "--grpc-port", str(port),
                             "--http-port", "0", "--insecure-local"],
            "reward": ["reward", "serve", "--port", str(port)],
        }
        for name, cmd in cases.items():
            rc, out = tlt(cmd, real=name == "rollout http")
            assert rc == 2 and "port_in_use" in out and f"127.0.0.1:{port}" in out, (name, rc, out[-2000:])
            assert "Traceback" not in out and "replicas_starting" not in out, (name, out[-2000:])
    rc, out = tlt(["rollout", "serve", "--model", str(model), "--set", "rollout.http_port=1"])
    assert rc == 2 and "bad_config" in out and "Traceback" not in out, (rc, out[-2000:])


class _Top(random.Random):
    """Draws the top of every range it is asked for."""

    def randint(self, a, b):
        return b


def test_the_first_ephemeral_port_is_never_drawn(tmp_path):
    """Ports are drawn from [LOWEST, first ephemeral port): the first ephemeral one is the kernel's to hand out."""
    rng_file = tmp_path / "range"
    rng_file.write_text("44760\t60999\n")  # this test's ports: 44700-44799
    assert free_port(rng=_Top(), range_file=rng_file) == 44759


def test_an_ephemeral_range_that_starts_at_the_lowest_port_draws_above_its_end(tmp_path):
    """ip_local_port_range set low: ports come from above the range's end, still outside it (they used to be
    ephemeral ones, which an outgoing connection can take); a range that ends at 65535 leaves only an ephemeral one,
    free when handed out, not an error."""
    rng_file = tmp_path / "range"
    for first in (LOWEST, LOWEST + 1):
        rng_file.write_text(f"{first}\t60999\n")
        ports = {free_port(range_file=rng_file) for _ in range(5)}
        assert all(61000 <= p <= 65535 for p in ports), ports
    rng_file.write_text("1024\t65535\n")
    p = free_port(range_file=rng_file)
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


def test_a_port_drawn_twice_is_drawn_again(monkeypatch):
    """free_ports(n) gives n distinct ports even when a draw repeats one: two services of a run on one port, the
    second failed to bind."""
    from tlt.services.common import ports

    draws = iter([44761, 44761, 44762, 44761, 44763])
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": next(draws))
    assert ports.free_ports(3) == [44761, 44762, 44763]
