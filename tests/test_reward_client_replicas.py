"""The reward client judges each reward replica's liveness on its own, and follows the name's addresses as they change.

A headless Service's name resolves to every reward pod and the client spreads its calls over them. Its progress
clock (a call times out only once the server answered none of the client's calls for `timeout_s`) was one for the
whole client: a stuck replica beside a healthy one was not timed out while the healthy one answered the client's
other calls, so a step waited until every other item was scored, then `timeout_s` more. And a pod added to the
Service was used only once gRPC resolved the name again (after a connection ended). Now each address has its own
clock (calls stuck on a silent one are retried on a live one after `timeout_s`; a busy one that answers is never
timed out) and the client resolves the name itself every `resolve_every_s`.

Real parts: RewardServers on 127.0.0.1 (as `tlt reward serve` runs them) with verifiers of the test's own, the real
RewardClient and gRPC. A multi-address name is an `ipv4:` target (what a headless Service's DNS answers) or the
client's injectable resolver over a list the test changes (DNS cannot be changed here).
"""

from __future__ import annotations

import socket
import threading
import time

from tlt.services.reward.client import RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest
PORTS = range(44100, 44200)  # this file's ports


def _port() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 44100-44199")


def _server(verifier, workers: int = 2) -> RewardServer:  # noqa: ANN001 - (prompt, completion, reference) -> bool
    return RewardServer(RewardConfig(host="127.0.0.1", port=_port(), workers=workers, grace_s=0.5, item_timeout_s=0),
                        verifier=verifier)


class Counting:
    """A verifier taking `seconds` an item that counts what it scored; `hold` (when set) blocks items meanwhile."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.scored = 0
        self.hold: threading.Event | None = None
        self._lock = threading.Lock()

    def __call__(self, prompt: str, completion: str, reference: str) -> bool:
        if self.hold is not None:
            self.hold.wait(20)
        time.sleep(self.seconds)
        with self._lock:
            self.scored += 1
        return True


def test_a_stuck_replica_beside_a_healthy_one_is_timed_out_while_the_healthy_one_answers() -> None:
    """40 items submitted one every 0.1 s (4 s of answers from the healthy replica) with timeout_s = 0.6. Before, an
    item that went to the stuck replica waited until the healthy one had been quiet for 0.6 s: the first one ~4.6 s.
    Now it is retried on the healthy replica 0.6 s after it was sent, and few items go to the silent one after."""
    release = threading.Event()
    healthy = Counting(0.02)
    with _server(healthy) as a, _server(lambda p, c, r: release.wait(20)) as b:
        try:
            with RewardClient(f"ipv4:{a.address},{b.address}", concurrency=16, timeout_s=0.6, retries=2,
                              backoff_s=0.01) as client:
                futures, latencies = [], []
                for i in range(40):
                    t0 = time.monotonic()
                    fut = client.submit(Req(id=f"i{i}", completion="x", reference="x"))
                    fut.add_done_callback(lambda _, t0=t0: latencies.append(time.monotonic() - t0))
                    futures.append(fut)
                    time.sleep(0.1)
                assert all(f.result(timeout=30).ok for f in futures)
        finally:
            release.set()
    slow = [round(x, 2) for x in latencies if x > 0.5]
    assert max(latencies) < 2.5, slow  # 0.6 s on the silent replica, then the healthy one (before: 4.6 s)
    assert healthy.scored == 40
    assert len(slow) <= 10, slow  # after a timeout a silent replica gets one call per timeout_s, not half of them


def test_two_busy_healthy_replicas_are_never_timed_out() -> None:
    """16 items of 0.2 s on two one-worker replicas at timeout_s = 0.5 and no retries: each item waits up to ~1.6 s in
    its replica's queue, past timeout_s, yet each replica answers every 0.2 s, so none times out or is scored twice."""
    a_fn, b_fn = Counting(0.2), Counting(0.2)
    with _server(a_fn, workers=1) as a, _server(b_fn, workers=1) as b:
        with RewardClient(f"ipv4:{a.address},{b.address}", concurrency=16, timeout_s=0.5, retries=0) as client:
            futures = [client.submit(Req(id=f"b{i}", completion="x", reference="x")) for i in range(16)]
            assert all(f.result(timeout=20).ok for f in futures)
    assert a_fn.scored + b_fn.scored == 16 and min(a_fn.scored, b_fn.scored) >= 5, (a_fn.scored, b_fn.scored)


def test_a_name_s_new_address_is_used_within_the_resolve_period_and_a_removed_one_dropped_after_its_calls() -> None:
    """The resolver answers [A], then [A, B] (a pod added): B is called within resolve_every_s. Then [B] (A removed)
    while a call of A's is being scored: that call is answered (not cut off), later calls go to B alone, and A's
    connection is closed once its call ended."""
    a_fn, b_fn = Counting(), Counting()
    with _server(a_fn) as a, _server(b_fn) as b:
        addresses = [a.address]
        with RewardClient("reward.test:50061", concurrency=4, timeout_s=5, retries=0,
                          resolver=lambda _: list(addresses), resolve_every_s=0.2) as client:
            for i in range(4):
                assert client.score([Req(id=f"a{i}", completion="x", reference="x")])[0].ok
            assert (a_fn.scored, b_fn.scored) == (4, 0) and client.addresses() == [a.address]
            addresses.append(b.address)
            deadline = time.monotonic() + 3
            while b_fn.scored == 0:
                assert time.monotonic() < deadline, "the added address was not used"
                client.score([Req(id="n", completion="x", reference="x")])
            added_after = time.monotonic() - (deadline - 3)
            # A holds its next item; the name drops A meanwhile
            a_fn.hold = threading.Event()
            on_a = [client.submit(Req(id=f"h{i}", completion="x", reference="x")) for i in range(4)]
            time.sleep(0.1)
            scored_by_a = a_fn.scored
            addresses.remove(a.address)
            time.sleep(0.5)
            assert client.addresses() == [b.address]
            before = b_fn.scored
            for i in range(6):
                assert client.score([Req(id=f"b{i}", completion="x", reference="x")])[0].ok
            assert b_fn.scored == before + 6
            a_fn.hold.set()
            assert all(f.result(timeout=5).ok for f in on_a)
            assert a_fn.scored - scored_by_a >= 1  # A's call in flight was answered, not cancelled by the removal
            time.sleep(0.1)
            assert client.addresses(including_draining=True) == [b.address]  # A's channel is closed
    assert added_after < 2


def test_a_name_is_resolved_by_the_client_and_an_unreachable_address_of_it_is_skipped() -> None:
    """`localhost` may resolve to ::1 and 127.0.0.1; a server on 127.0.0.1 alone is still reached, call after call,
    without a retry; a name that resolves to nothing is 'unavailable', naming it."""
    fn = Counting()
    with _server(fn) as s:
        with RewardClient(f"localhost:{s.port}", timeout_s=5, retries=0) as client:
            client.wait_ready(5)
            for i in range(10):
                assert client.score([Req(id=f"l{i}", completion="x", reference="x")])[0].ok
    assert fn.scored == 10
    with RewardClient("no-such-reward.invalid:44100", timeout_s=1, retries=0, retry_window_s=0,
                      resolver=lambda _: []) as client:
        fut = client.submit(Req(id="x", reference="1"))
        err = fut.exception(timeout=10)
        assert isinstance(err, RewardUnavailableError) and "no address" in str(err), err


def test_an_address_refusing_connections_costs_no_retry_and_a_stuck_stream_moves_to_another_replica() -> None:
    """`ipv4:` of a closed port and a live server, no retries: every call is answered (the refusing address is passed
    over, as gRPC's round_robin did). A ScoreStream opened on a stuck replica stalls after timeout_s and is reopened
    on the healthy one, which answers every item."""
    fn = Counting()
    release = threading.Event()
    with _server(fn) as s:
        dead = _port()  # nothing listens on it
        with RewardClient(f"ipv4:127.0.0.1:{dead},{s.address}", timeout_s=5, retries=0) as client:
            for i in range(8):
                assert client.score([Req(id=f"d{i}", completion="x", reference="x")])[0].ok
    assert fn.scored == 8
    with _server(lambda p, c, r: release.wait(20)) as stuck, _server(Counting()) as ok:
        try:
            with RewardClient(f"ipv4:{ok.address},{stuck.address}", timeout_s=0.5, retries=1) as client:
                time.sleep(0.5)  # both connected (a client connects each address at once), so neither is preferred:
                t0 = time.monotonic()  # the first pick is the second address, the stuck one
                got = {r.id for r in client.score_stream(Req(id=f"s{i}", completion="x", reference="x")
                                                           for i in range(5))}
                elapsed = time.monotonic() - t0
        finally:
            release.set()
    assert got == {f"s{i}" for i in range(5)} and 0.5 <= elapsed < 3, elapsed  # a stall of timeout_s, then the rest
