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
