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

import gc
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent import futures as cf
from contextlib import ExitStack, contextmanager

import grpc
from structlog.testing import capture_logs

from tlt.services.common.ports import free_port, free_ports
from tlt.services.reward import replicas as replicas_mod
from tlt.services.reward.client import RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest


def _server(verifier, workers: int = 2) -> RewardServer:  # noqa: ANN001 - (p, c, r) -> bool
    config = RewardConfig(host="127.0.0.1", port=0, workers=workers, grace_s=0.5, item_timeout_s=0)
    return RewardServer(config, verifier=verifier)


@contextmanager
def _refusing(n: int = 1) -> Iterator[list[int]]:
    """`n` distinct ports on 127.0.0.1 bound but not listening while the block runs: each refuses connections, and
    no server of the test can take one."""
    ports = free_ports(n)
    with ExitStack() as stack:
        for port in ports:
            stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
        yield ports


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
            _both_ready(client._replicas)  # else, on a loaded host, the burst all lands on whichever connected first
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
        dead = free_port()  # nothing listens on it
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


# ---- follow-ups of a review: resolver errors, unclosed clients, other schemes, :authority, duplicates, ::1 -----


def _resolve_threads() -> int:
    return sum(t.name == "reward-client-resolve" and t.is_alive() for t in threading.enumerate())


def test_a_resolver_error_of_any_kind_keeps_the_addresses_known_and_the_name_resolved_again() -> None:
    """A resolver raising RuntimeError once (or a Replica that cannot be built) killed the resolve thread: the
    address list froze for good. Now the error is kept (a call with no address names it), logged once per distinct
    error, and resolution goes on: B, added after the error, is called within a few resolve periods."""
    a_fn, b_fn = Counting(), Counting()
    with _server(a_fn) as a, _server(b_fn) as b:
        calls, addresses = [0], [a.address]

        def resolver(_: str) -> list[str]:
            calls[0] += 1
            if 2 <= calls[0] <= 4:
                raise RuntimeError("resolver bug")
            return list(addresses)

        with capture_logs() as logs, RewardClient("reward.test:1", timeout_s=5, retries=0, resolver=resolver,
                                                  resolve_every_s=0.05) as client:
            deadline = time.monotonic() + 5
            while calls[0] < 5:
                assert time.monotonic() < deadline, f"resolution stopped after {calls[0]} calls"
                time.sleep(0.02)
            addresses.append(b.address)
            while client.addresses() != [a.address, b.address]:
                assert time.monotonic() < deadline, client.addresses()
                time.sleep(0.02)
            assert client.score([Req(id="x", completion="x", reference="x")])[0].ok
        failed = [e for e in logs if e["event"] == "reward_resolve_failed"]
        assert len(failed) == 1 and "RuntimeError: resolver bug" in failed[0]["error"], failed
    # a resolver failing from the start: the client is made, and a call says why it has no address
    with RewardClient("reward.test:1", timeout_s=1, retries=0, retry_window_s=0,
                      resolver=lambda _: 1 / 0) as client:
        err = client.submit(Req(id="x", reference="1")).exception(timeout=10)
        assert isinstance(err, RewardUnavailableError) and "ZeroDivisionError" in str(err), err


def test_a_replica_that_cannot_be_built_does_not_stop_resolution(monkeypatch) -> None:  # noqa: ANN001
    """Replica(...) raising for one address (say a channel option gRPC rejects): the other addresses still come."""
    real = replicas_mod.Replica

    def replica(address: str, options: list, watch: bool):  # noqa: ANN202
        if address == "10.0.0.9:1":
            raise ValueError("cannot build")
        return real(address, options, watch)

    monkeypatch.setattr(replicas_mod, "Replica", replica)
    found = [["10.0.0.9:1"]]
    with RewardClient("reward.test:1", timeout_s=1, retries=0, resolver=lambda _: list(found[0]),
                      resolve_every_s=0.05) as client:
        found[0] = ["127.0.0.1:1"]
        deadline = time.monotonic() + 5
        while client.addresses() != ["127.0.0.1:1"]:
            assert time.monotonic() < deadline, client.addresses()
            time.sleep(0.02)


def test_a_client_of_a_name_dropped_without_close_leaves_no_resolve_thread() -> None:
    """The resolve thread held the client's Replicas: five clients dropped unclosed left five threads (and their
    channels) for good. Now the thread holds it weakly and ends once it is collected."""
    fn = Counting()
    with _server(fn) as s:
        gc.collect()
        before = _resolve_threads()
        for i in range(5):
            client = RewardClient(f"reward.test:{s.port}", timeout_s=5, retries=0,
                                  resolver=lambda _, a=s.address: [a], resolve_every_s=0.05)
            assert client.score([Req(id=f"u{i}", completion="x", reference="x")])[0].ok
            assert _resolve_threads() == before + 1
            del client
            gc.collect()
            deadline = time.monotonic() + 5
            while _resolve_threads() > before:
                assert time.monotonic() < deadline, "the resolve thread of a dropped client lives on"
                time.sleep(0.02)
    assert fn.scored == 5


def test_a_target_of_another_grpc_scheme_is_left_to_grpc(monkeypatch) -> None:  # noqa: ANN001
    """`xds:///reward:P` (and any `scheme:` not listed, gRPC's or a plugin's) was taken for the DNS name
    `xds:///reward`, which never resolves: the client had no address for good. Now any scheme but dns: is one
    channel on the target as given, gRPC's to resolve (here its xds resolver, which wants a bootstrap file); host:port
    stays a name. (`passthrough:` is gRPC Go's: gRPC Python takes it for a DNS name, with or without this client.)"""
    monkeypatch.delenv("GRPC_XDS_BOOTSTRAP", raising=False)
    monkeypatch.delenv("GRPC_XDS_BOOTSTRAP_CONFIG", raising=False)
    before = _resolve_threads()
    target = f"xds:///reward.test:{free_port()}"
    with RewardClient(target, timeout_s=2, retries=0, retry_window_s=0) as client:
        assert client.addresses() == [target] and _resolve_threads() == before
        err = client.submit(Req(id="x", reference="1")).exception(timeout=10)
        assert isinstance(err, RewardUnavailableError) and "XdsClient" in str(err), err  # gRPC's xds resolver
    names = ["localhost:50061", "reward.ns.svc:50061", "dns:///reward:1", "dns://8.8.8.8/reward:1", "Reward-0:7"]
    others = ["127.0.0.1:1", "[::1]:1", "passthrough:///reward:1", "xds:///reward", "unix:/tmp/s", "unix-abstract:x",
              "vsock:3:1", "ipv4:127.0.0.1:1", "myscheme:reward:1", "localhost"]
    assert [t for t in names if not replicas_mod._is_name(t)] == []
    assert [t for t in others if replicas_mod._is_name(t)] == []


def _authority_server(port: int, seen: list[str]) -> grpc.Server:
    """A Reward service whose Score records each call's `:authority` (invocation_metadata() leaves it out; gRPC Python
    keeps it in the call's details, filled for a generic handler's calls)."""

    def score(request, context):  # noqa: ANN001, ANN202
        seen.append(context._rpc_event.call_details.host.decode())
        return reward_pb2.ScoreBatchResponse(results=[reward_pb2.ScoreResponse(id=r.id, ok=True)
                                                      for r in request.items])

    handler = grpc.method_handlers_generic_handler("tlt.v1.Reward", {"Score": grpc.unary_unary_rpc_method_handler(
        score, request_deserializer=reward_pb2.ScoreBatchRequest.FromString,
        response_serializer=reward_pb2.ScoreBatchResponse.SerializeToString)})
    server = grpc.server(cf.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def test_each_address_of_a_name_is_called_with_the_name_as_its_authority() -> None:
    """A replica's channel was made on its IP, so a proxy or mesh routing by host saw `:authority` 127.0.0.1:P instead
    of the name. Now each channel of a resolved name sends `name:port`."""
    seen: list[str] = []
    port = free_port()
    server = _authority_server(port, seen)
    try:
        with RewardClient(f"reward.example:{port}", timeout_s=5, retries=0,
                          resolver=lambda _: [f"127.0.0.1:{port}"]) as client:
            assert client.score([Req(id="a", completion="x", reference="x")])[0].ok
        with RewardClient(f"127.0.0.1:{port}", timeout_s=5, retries=0) as client:  # an IP target: as given
            assert client.score([Req(id="b", completion="x", reference="x")])[0].ok
    finally:
        server.stop(0)
    assert seen == [f"reward.example:{port}", f"127.0.0.1:{port}"]


def test_an_address_listed_twice_is_one_replica(monkeypatch) -> None:  # noqa: ANN001
    """`ipv4:a,a` built two Replicas for one address (the first one's channel left unclosed): now one."""
    built: list[str] = []
    real = replicas_mod.Replica

    def replica(address: str, options: list, watch: bool):  # noqa: ANN202
        built.append(address)
        return real(address, options, watch)

    monkeypatch.setattr(replicas_mod, "Replica", replica)
    with RewardClient("ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:1", timeout_s=1, retries=0) as client:
        assert client.addresses() == ["ipv4:127.0.0.1:1", "ipv4:127.0.0.1:2"]
    assert built == ["ipv4:127.0.0.1:1", "ipv4:127.0.0.1:2"]


def test_a_name_resolving_to_ipv6_loopback_first_reaches_a_server_on_127_0_0_1_alone() -> None:
    """What `localhost` gives where /etc/hosts maps it to ::1 as well (not so on every machine, hence the resolver):
    [::1]:P first, where nothing listens, then 127.0.0.1:P. A fresh client's first two calls (round robin would
    send one to each address), batches or streams, are each answered with no retry."""
    fn = Counting()
    with _server(fn) as s:
        both = [f"[::1]:{s.port}", f"127.0.0.1:{s.port}"]
        calls = [lambda c, i: c.submit(Req(id=f"s{i}", completion="x", reference="x")).result(10).ok,
                 lambda c, i: c.score([Req(id=f"b{i}", completion="x", reference="x")])[0].ok,
                 lambda c, i: len(list(c.score_stream(Req(id=f"t{i}-{k}", completion="x", reference="x")
                                                      for k in range(3)))) == 3]
        for i in range(6):
            with RewardClient(f"localhost:{s.port}", timeout_s=2, retries=0, retry_window_s=0,
                              resolver=lambda _: list(both)) as client:
                assert client.addresses() == both
                assert calls[i % 3](client, 2 * i) and calls[i % 3](client, 2 * i + 1)  # round robin: one to each
    assert fn.scored == 2 * (2 + 2 + 6)


class _PassThrough(grpc.UnaryUnaryClientInterceptor):
    def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        return continuation(client_call_details, request)


def test_replica_liveness_is_read_through_grpc_s_public_api_alone(monkeypatch) -> None:  # noqa: ANN001
    """Each replica's connectivity was read from a private attribute of gRPC's channel (`_channel`'s
    check_connectivity_state); a channel laid out otherwise (another grpcio, or a channel object wrapping gRPC's, as
    `grpc.intercept_channel` makes here) gave "unknown", so a replica refusing connections was called as often as a
    live one. Now the state comes from `Channel.subscribe`: through a wrapped channel too, the dead address is known
    as such and every call goes to the live one."""
    real = grpc.insecure_channel
    monkeypatch.setattr(grpc, "insecure_channel", lambda *a, **k: grpc.intercept_channel(real(*a, **k), _PassThrough()))
    with _refusing() as (dead,):
        fn = Counting()
        with _server(fn) as s:
            reps = replicas_mod.Replicas(f"ipv4:127.0.0.1:{dead},127.0.0.1:{s.port}", [], timeout_s=5)
            try:
                deadline = time.monotonic() + 10
                live, gone = reps._replicas[f"ipv4:127.0.0.1:{s.port}"], reps._replicas[f"ipv4:127.0.0.1:{dead}"]
                while (live.state(), gone.state()) != (grpc.ChannelConnectivity.READY,
                                                      grpc.ChannelConnectivity.TRANSIENT_FAILURE):
                    assert time.monotonic() < deadline, (live.state(), gone.state())
                    time.sleep(0.02)
                picked = []
                for _ in range(6):
                    with reps.use() as replica:
                        picked.append(replica.address)
                assert set(picked) == {live.address}
            finally:
                reps.close()


def test_a_client_dropped_without_close_leaves_no_connectivity_polling_thread() -> None:
    """Each watched replica's channel was subscribed (`Channel.subscribe`) with the replica's own method, so gRPC's
    polling thread held the replica and its channel: a client dropped unclosed left its channels open and one thread
    per address polling them every 0.2 s, for good. The subscription holds the replica weakly now: collected, its
    subscription ends and its channel is closed, and the polling threads end."""
    fn = Counting()
    with _refusing() as (dead,), _server(fn) as s:
        _drop_clients(s.port, dead)
    assert fn.scored == 4


def _drop_clients(port: int, dead: int) -> None:
    """Three clients of a live and a refusing address, each dropped unclosed after a call: neither its replicas nor
    a thread of theirs outlives it."""
    def threads() -> int:  # but the client's call pool's, which its executor ends in its own time
        return sum(not t.name.startswith("reward-score") for t in threading.enumerate())

    with RewardClient(f"127.0.0.1:{port}", timeout_s=5, retries=0) as warm:  # the server's threads started
        assert warm.score([Req(id="warm", completion="x", reference="x")])[0].ok
    gc.collect()
    before = threads()
    for i in range(3):
        client = RewardClient(f"ipv4:127.0.0.1:{port},127.0.0.1:{dead}", timeout_s=5, retries=0)
        assert client.score([Req(id=f"p{i}", completion="x", reference="x")])[0].ok
        held = [weakref.ref(r) for r in client._replicas._replicas.values()]
        assert len(held) == 2
        del client
        deadline = time.monotonic() + 5
        while any(r() is not None for r in held) or threads() > before:
            assert time.monotonic() < deadline, ([r() for r in held], [t.name for t in threading.enumerate()], before)
            gc.collect()
            time.sleep(0.05)


def _both_ready(reps: replicas_mod.Replicas) -> tuple[replicas_mod.Replica, replicas_mod.Replica]:
    first, second = reps._replicas.values()
    deadline = time.monotonic() + 10
    while (first.state(), second.state()) != (grpc.ChannelConnectivity.READY,) * 2:
        assert time.monotonic() < deadline, (first.state(), second.state())
        time.sleep(0.02)
    return first, second


def _ready_pair(a, b):  # noqa: ANN001, ANN202 - two live RewardServers
    reps = replicas_mod.Replicas(f"ipv4:{a.address},{b.address}", [], timeout_s=0.5)
    return reps, *_both_ready(reps)


def _picks(reps, n: int, failed=None) -> list[str]:  # noqa: ANN001
    out = []
    for _ in range(n):
        with reps.use(failed) as replica:
            out.append(replica.address)
    return out


def test_a_retry_goes_to_another_replica_than_its_failed_attempt_and_a_timed_out_one_gets_one_probe() -> None:
    """Two live replicas. A retry (`use(failed)`) is never sent back to the replica its attempt failed on while the
    other is as good, however the round robin stands (other calls move it meanwhile). A replica that timed out a call
    gets none for timeout_s, then one probe per timeout_s, not every other call: the probe pushes its own next turn
    timeout_s on."""
    with _server(Counting()) as a, _server(Counting()) as b:
        reps, first, second = _ready_pair(a, b)
        try:
            assert _picks(reps, 4, failed=first) == [second.address] * 4
            assert _picks(reps, 4, failed=second) == [first.address] * 4
            first.timed_out(0.5)
            assert _picks(reps, 4) == [second.address] * 4  # avoided for timeout_s
            time.sleep(0.6)
            picked = _picks(reps, 6)  # well within the next timeout_s
            assert picked.count(first.address) == 1 and picked.count(second.address) == 5, picked
        finally:
            reps.close()


def test_a_watched_channel_is_closed_only_after_grpcs_polling_thread_ended() -> None:
    """A channel closed while gRPC's connectivity thread still ran made that thread raise "Channel closed!" (a
    traceback on stderr; seen in CI, where a loaded host kept the thread past the fixed 0.3 s). The close now waits
    for the thread's end (grpc's `_connectivity_state.polling`). Stand-in: the channel's connectivity state, held
    polling for 0.8 s (a real thread cannot be held past its look on cue)."""
    from types import SimpleNamespace

    closed: list[float] = []
    channel = SimpleNamespace(_connectivity_state=SimpleNamespace(polling=True), unsubscribe=lambda _: None,
                              close=lambda: closed.append(time.monotonic()))
    start = time.monotonic()
    replicas_mod._close_soon(channel, lambda _: None)
    time.sleep(0.8)
    assert closed == []  # still polling: not closed, though UNWATCHED_S passed
    channel._connectivity_state.polling = False
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert closed and closed[0] - start >= 0.8
    gone = SimpleNamespace(unsubscribe=lambda _: None, close=lambda: closed.append(time.monotonic()))  # no such flag
    start = time.monotonic()
    replicas_mod._close_soon(gone, None)
    deadline = time.monotonic() + 5
    while len(closed) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(closed) == 2 and replicas_mod.UNWATCHED_S <= closed[1] - start < 4


def test_a_retry_after_a_refused_connection_goes_to_a_connecting_replica_not_back_to_the_refusing_one() -> None:
    """An address whose connectivity was not known yet (None: its first report not in, as on a loaded host) ranked
    as READY, above a live replica still CONNECTING: the retry of a call refused by the unknown one went back to it,
    and with retries=0 the call failed (seen under load: "unavailable for Score(1 items) after 1 attempt ...
    Connection refused", a live server beside it). Unknown now ranks as not ready, so the failed replica ranks last.
    The two replicas' states are set by hand (the channels' own reports would race the picks)."""
    ports = free_ports(2)  # distinct
    reps = replicas_mod.Replicas(f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", [], timeout_s=5)
    try:
        unknown, connecting = reps._replicas.values()
        unknown.state = lambda: None  # type: ignore[method-assign]
        connecting.state = lambda: grpc.ChannelConnectivity.CONNECTING  # type: ignore[method-assign]
        assert set(_picks(reps, 4, failed=unknown)) == {connecting.address}
        assert set(_picks(reps, 4, failed=connecting)) == {unknown.address}
        ready = connecting
        ready.state = lambda: grpc.ChannelConnectivity.READY  # type: ignore[method-assign]
        assert set(_picks(reps, 4)) == {ready.address}  # READY still beats unknown
    finally:
        reps.close()


def test_a_stream_refused_by_one_address_of_a_name_goes_to_the_next_without_counting_a_failed_attempt() -> None:
    """`score_stream` counted a refused connection as a failed attempt, where `score` and `submit` pass a refusing
    address over: with retries=0, a stream whose first pick was an address nothing listens on failed ("unavailable
    for ScoreStream after 1 attempt"; seen under load, where the address's refusal was not reported before the pick)
    though a live server stood beside it. The first pick is steered to the dead address by hand (states unknown,
    the round robin's counter set)."""
    fn = Counting()
    with _refusing() as (dead,), _server(fn) as s:
        order = [f"127.0.0.1:{dead}", s.address]
        with RewardClient(f"reward.test:{s.port}", timeout_s=5, retries=0, retry_window_s=0,
                          resolver=lambda _: list(order)) as client:
            reps = client._replicas
            for r in reps._replicas.values():
                r.state = lambda: None  # type: ignore[method-assign]
            reps._next = len(order) - 1  # the next pick: choices[(_next + 1) % 2], the dead address
            got = list(client.score_stream(Req(id=f"t{k}", completion="x", reference="x") for k in range(3)))
    assert sorted(r.id for r in got) == ["t0", "t1", "t2"] and fn.scored == 3


def test_a_client_close_waits_for_the_polling_threads_a_bounded_time() -> None:
    """`close()` of a client of several addresses closed every channel UNWATCHED_S after unsubscribing, the same
    fixed wait as above; it waits for each channel's polling thread now, UNWATCHED_CLOSE_S at most (a close must
    not hang on a thread that never ends). Stand-ins: the channels' connectivity states (polling for 0.6 s), around
    real channels of a real Replicas."""
    from types import SimpleNamespace

    class Held:
        def __init__(self, real: grpc.Channel, state: SimpleNamespace) -> None:
            self.real, self._connectivity_state, self.closed_at = real, state, 0.0

        def unsubscribe(self, callback) -> None:  # noqa: ANN001
            self.real.unsubscribe(callback)

        def close(self) -> None:
            self.closed_at = time.monotonic()
            self.real.close()

    ports = free_ports(2)  # distinct: one address would be one unwatched replica
    reps = replicas_mod.Replicas(f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", [], timeout_s=5)
    polling = SimpleNamespace(polling=True)
    held = []
    for replica in reps._replicas.values():
        replica.channel = Held(replica.channel, polling)  # type: ignore[assignment]
        held.append(replica.channel)
    threading.Timer(0.6, lambda: setattr(polling, "polling", False)).start()
    start = time.monotonic()
    reps.close()
    assert all(h.closed_at - start >= 0.6 for h in held), [h.closed_at - start for h in held]
    stuck = SimpleNamespace(polling=True)
    start = time.monotonic()
    replicas_mod._wait_unwatched([SimpleNamespace(_connectivity_state=stuck), SimpleNamespace()], 1.0)
    assert 1.0 <= time.monotonic() - start < 4  # bounded (the upper bound only catches a hang)


def test_a_close_during_wait_ready_ends_the_wait_and_does_not_wait_out_its_subscriptions() -> None:
    """`wait_ready` subscribes each channel (its ready futures) until its timeout: a `close()` from another thread
    meanwhile (a trainer stopped while it waits for its reward server) waited the whole UNWATCHED_CLOSE_S for gRPC's
    polling threads, then closed under them ("Channel closed!"), and the wait went on to its own timeout. Now the
    wait ends at the close and its subscriptions with it. Real channels to two addresses refusing connections."""
    with _refusing(2) as dead:
        client = RewardClient(f"ipv4:127.0.0.1:{dead[0]},127.0.0.1:{dead[1]}", timeout_s=5, retries=0)
        outcome: list[BaseException | None] = []

        def wait() -> None:
            try:
                client.wait_ready(30)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                outcome.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)
        start = time.monotonic()
        client.close()
        closed_in = time.monotonic() - start
        waiter.join(5)
        assert not waiter.is_alive() and isinstance(outcome[0], RewardUnavailableError), outcome
        assert closed_in < replicas_mod.UNWATCHED_CLOSE_S, closed_in
