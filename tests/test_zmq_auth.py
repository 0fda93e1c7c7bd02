"""The drafter's ZeroMQ sockets under the control token (services/common/zmq_auth.py), over real sockets on
127.0.0.1 (ports the kernel picks: a fixed port collided once with another socket's in CI).

With a token every socket is CURVE with keys derived from it and each binding side admits only the token's client
key (ZAP): a peer with the token talks; one with another token, none, or the right server key but a key of its own
is never connected (nothing delivered, nothing read; every wait here is bounded). Without a token: plain ZeroMQ on a
loopback bind as before, and a bind on any other address refused in one line.
"""

from __future__ import annotations

import os
import time

import pytest
import zmq

from drafter_helpers import model_dir  # noqa: F401 (fixture)
from tlt.services.common.auth import TOKEN_ENV, TOKEN_FILE_ENV
from tlt.services.common.events import CapacityPublisher, CapacitySubscriber, FeaturePuller, FeaturePusher
from tlt.services.common.ports import free_port, free_ports
from tlt.services.common.zmq_auth import ZmqAuth, ZmqAuthError, curve_keys
from tlt.v1 import common_pb2, drafter_pb2, events_pb2

TOKEN = "zmq-auth-test-token"
IDLE = common_pb2.REPLICA_STATE_IDLE


def _batch(n: int = 1) -> events_pb2.FeatureBatch:
    seqs = [events_pb2.FeatureSequence(seq_id=f"s{i}", token_ids=[1, 2, 3], features=b"\0" * 16) for i in range(n)]
    return events_pb2.FeatureBatch(sequences=seqs, source="rollout")


def _push_until_sent(pusher: FeaturePusher, within_s: float) -> bool:
    """Push until one batch goes out (the connection is up) or `within_s` passes; a refused peer never connects."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pusher.push(_batch()):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


def test_keys_are_derived_from_the_token_alone() -> None:
    a, again, other = curve_keys(TOKEN), curve_keys.__wrapped__(TOKEN), curve_keys(TOKEN + "x")  # again: uncached
    assert a == again and a != other
    assert len({a.server_public, a.client_public, other.server_public, other.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public and len(a.client_secret) == 40


def test_features_reach_the_drafter_with_the_token_only(no_env_token: None) -> None:
    with FeaturePuller("tcp://127.0.0.1:*", token=TOKEN) as puller:
        for token in ("", TOKEN + "-wrong"):  # no token (plain), another token: never connected, dropped and counted
            with FeaturePusher(puller.endpoint, token=token) as stranger:
                assert not stranger.wait_connected(0.5)  # never connected: no batch could go
                start = time.monotonic()
                assert not _push_until_sent(stranger, 1.0)
                assert time.monotonic() - start < 3 and stranger.dropped > 0 and stranger.sent == 0
        with FeaturePusher(puller.endpoint, token=TOKEN) as pusher:
            assert _push_until_sent(pusher, 5.0)
            got = puller.recv(3.0)
            assert got is not None and got.sender == pusher.sender
        assert puller.recv(0.3) is None and puller.frames == 1 and puller.garbage == 0  # nothing of the strangers'


def test_the_right_server_key_with_a_client_key_of_its_own_is_refused_by_zap(
        no_env_token: None, capsys: pytest.CaptureFixture) -> None:
    """Knowing the server's public key is not enough: the ZAP handler admits the token's client key only. Peers
    refused one after another are said once (a minute apart), with the count, not once per handshake."""
    keys = curve_keys(TOKEN)
    with FeaturePuller("tcp://127.0.0.1:*", token=TOKEN) as puller, zmq.Context() as ctx:
        for _ in range(3):
            with ctx.socket(zmq.PUSH) as rogue:
                rogue.setsockopt(zmq.LINGER, 0)
                rogue.curve_serverkey = keys.server_public
                rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
                rogue.connect(puller.endpoint)
                rogue.send(events_pb2.Envelope(features=_batch()).SerializeToString(), flags=zmq.NOBLOCK)
                assert puller.recv(0.5) is None and puller.frames == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "zmq_peer_refused" in line]
    assert len(said) == 1 and "total=1" in said[0], said


def test_capacity_events_and_snapshots_need_the_token(no_env_token: None) -> None:
    with CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.1,
                           token=TOKEN) as pub:
        pub.publish(events_pb2.CapacityEvent(replica_id=0, state=IDLE))
        with CapacitySubscriber(pub.pub_endpoint, pub.snapshot_endpoint, token=TOKEN) as sub:
            assert [e.replica_id for e in sub.snapshot(timeout_s=5)] == [0]
            event = sub.recv(3.0)  # heartbeats, every 0.1 s
            assert event is not None and event.replica_id == 0
        for token in ("", TOKEN + "-wrong"):
            with CapacitySubscriber(pub.pub_endpoint, pub.snapshot_endpoint, token=token) as stranger:
                start = time.monotonic()
                with pytest.raises(TimeoutError):
                    stranger.snapshot(timeout_s=0.5)
                assert stranger.recv(0.5) is None  # ten heartbeats went out meanwhile
                assert time.monotonic() - start < 3 and stranger.latest == {}


def test_the_coordinator_answers_workers_with_its_token_only(tmp_path, model_dir) -> None:  # noqa: ANN001, F811
    """The coordinator's ROUTER takes the config's token ([drafter] control_token), which beats TLT_AUTH_TOKEN; a
    worker with another one gets CoordinatorUnavailable after its timeout, nothing applied."""
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.coordinator_client import CoordinatorClient, CoordinatorUnavailable

    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False, control_token=TOKEN)  # no capacity events: never subscribed
    coord = Coordinator(cfg, str(model_dir), None, None).start()
    hello = {"hello": drafter_pb2.WorkerHello(worker_id=5, replica_id=0, pid=os.getpid())}
    try:
        for token in (TOKEN + "-wrong", os.environ.get(TOKEN_ENV, "") or "other"):  # the env's (conftest) is not it
            client = CoordinatorClient(coord.endpoint, worker_id=5, replica_id=0, timeout_s=0.8, token=token)
            start = time.monotonic()
            with pytest.raises(CoordinatorUnavailable):
                client.ask(**hello)
            assert time.monotonic() - start < 3
            client.close()
        assert 5 not in coord.workers
        client = CoordinatorClient(coord.endpoint, worker_id=5, replica_id=0, timeout_s=10, token=TOKEN)
        client.ask(**hello)
        client.close()
        assert 5 in coord.workers
    finally:
        coord.close()


def test_without_a_token_loopback_is_plain_zeromq_as_before(no_env_token: None) -> None:
    with FeaturePuller("tcp://127.0.0.1:*") as puller, FeaturePusher(puller.endpoint) as pusher:
        assert _push_until_sent(pusher, 5.0) and puller.recv(3.0) is not None
    with FeaturePuller("tcp://127.0.0.1:*") as puller, zmq.Context() as ctx, ctx.socket(zmq.PUSH) as plain:
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(puller.endpoint)  # a plain socket, as any peer before
        plain.send(events_pb2.Envelope(features=_batch(2)).SerializeToString())
        got = puller.recv(3.0)
        assert got is not None and len(got.sequences) == 2
    with CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        pub.publish(events_pb2.CapacityEvent(replica_id=1, state=IDLE))
        with CapacitySubscriber(pub.pub_endpoint, pub.snapshot_endpoint) as sub:
            assert [e.replica_id for e in sub.snapshot(timeout_s=5)] == [1]


def test_without_a_token_in_process_and_ipc_binds_are_local(no_env_token: None, tmp_path) -> None:
    """inproc:// and ipc:// never leave the host: plain ZeroMQ, as a loopback tcp bind is; the pair still talks."""
    with zmq.Context() as ctx, ZmqAuth(ctx) as auth:
        for endpoint in ("inproc://tlt-features", f"ipc://{tmp_path}/features"):
            with ctx.socket(zmq.PULL) as pull, ctx.socket(zmq.PUSH) as push:
                pull.setsockopt(zmq.LINGER, 0)
                push.setsockopt(zmq.LINGER, 0)
                auth.bind(pull, endpoint)
                auth.connect(push, endpoint)
                push.send(b"x")
                assert pull.poll(3000) and pull.recv() == b"x" and auth.mode == "plain"


@pytest.mark.parametrize("make", [
    lambda local, other: FeaturePuller(f"tcp://0.0.0.0:{other}"),
    lambda local, other: CapacityPublisher(f"tcp://127.0.0.1:{local}", f"tcp://*:{other}"),
])
def test_without_a_token_a_non_loopback_bind_is_refused_in_one_line(no_env_token: None, make) -> None:  # noqa: ANN001
    local, other = free_ports(2)  # distinct
    with pytest.raises(ZmqAuthError) as err:
        make(local, other)
    message = str(err.value)
    assert "\n" not in message and TOKEN_ENV in message and "127.0.0.1" in message
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as again:  # nothing was left bound
        again.setsockopt(zmq.LINGER, 0)
        again.bind(f"tcp://127.0.0.1:{local}")
        again.bind(f"tcp://0.0.0.0:{other}")


def test_a_non_loopback_bind_with_a_token_is_curve(no_env_token: None) -> None:
    with zmq.Context() as ctx, ZmqAuth(ctx, TOKEN) as auth, ctx.socket(zmq.PULL) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        auth.bind(sock, "tcp://0.0.0.0:*")
        assert sock.curve_server and auth.mode == "curve"


def test_a_rollout_with_a_config_token_secures_capacity_and_hands_it_to_its_replicas(
        no_env_token: None, tmp_path_factory) -> None:  # noqa: ANN001
    """`[rollout] control_token` alone (no TLT_AUTH_TOKEN in the environment, a TOML's token): the capacity sockets
    are under it and so are the replicas' features PUSH, whose process gets the front's token (not its
    environment's, which has none): a drafter with that token receives the features and the events."""
    from rollout_helpers import ServerThread, tiny_checkpoint
    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    model = tiny_checkpoint(tmp_path_factory.mktemp("m"))
    with FeaturePuller("tcp://127.0.0.1:*", token=TOKEN) as puller, \
            ServerThread(model, replicas=1, capacity_pub="tcp://127.0.0.1:*",
                         capacity_snapshot="tcp://127.0.0.1:*", capacity_heartbeat_s=0.2,
                         features_push=puller.endpoint, control_token=TOKEN) as s:
        with CapacitySubscriber(s.server.capacity.pub_endpoint, s.server.capacity.snapshot_endpoint) as stranger:
            with pytest.raises(TimeoutError):
                stranger.snapshot(timeout_s=0.5)
        with CapacitySubscriber(s.server.capacity.pub_endpoint, s.server.capacity.snapshot_endpoint,
                                token=TOKEN) as sub:
            assert [e.replica_id for e in sub.snapshot(timeout_s=5)] == [0]
        with RolloutClient(s.grpc_address) as client:
            params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=8, seed=3)
            done = list(client.batch_generate(["1+2="], n=2, params=params))
        got, deadline = 0, time.monotonic() + 10
        while got < len(done) and time.monotonic() < deadline:
            batch = puller.recv(0.5)
            got += len(batch.sequences) if batch is not None else 0
        assert got == len(done) == 2


def test_a_client_the_server_refuses_says_in_one_line_the_peer_may_require_a_token(
        no_env_token: None, capsys: pytest.CaptureFixture, tmp_path, model_dir) -> None:  # noqa: ANN001, F811
    """A plain client (no token here) or one with another token against a CURVE server: the pusher's drops, the
    snapshot's TimeoutError and the worker's CoordinatorUnavailable used to be all one saw. Now the client says once
    that the peer may require the control token; a client the server admits, or a plain pair, says nothing."""
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.coordinator_client import CoordinatorClient, CoordinatorUnavailable

    with FeaturePuller("tcp://127.0.0.1:*", token=TOKEN) as puller:
        for token in ("", TOKEN + "-wrong"):
            capsys.readouterr()
            with FeaturePusher(puller.endpoint, token=token) as stranger:
                assert not _push_until_sent(stranger, 1.0)
            err = capsys.readouterr().err
            said = [line for line in err.splitlines() if "zmq_handshake_failed" in line]
            assert len(said) == 1 and "may require the control token" in said[0], err  # once, in one line
            assert TOKEN not in err
        with FeaturePusher(puller.endpoint, token=TOKEN) as pusher:
            assert _push_until_sent(pusher, 5.0)
            for _ in range(50):  # a full queue drops too: a handshake that succeeded says nothing of a token
                pusher.push(_batch(4))
        assert "zmq_handshake_failed" not in capsys.readouterr().err
    with CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", token=TOKEN) as pub:
        with CapacitySubscriber(pub.pub_endpoint, pub.snapshot_endpoint) as stranger:
            with pytest.raises(TimeoutError, match="may require the control token"):
                stranger.snapshot(timeout_s=1.0)
    with CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:  # plain, nobody refused
        nobody = f"tcp://127.0.0.1:{free_port()}"  # nobody there: a plain timeout
        with CapacitySubscriber(pub.pub_endpoint, nobody) as sub:
            with pytest.raises(TimeoutError) as err:
                sub.snapshot(timeout_s=0.3)
            assert "token" not in str(err.value)
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False, control_token=TOKEN)
    coord = Coordinator(cfg, str(model_dir), None, None).start()
    try:
        client = CoordinatorClient(coord.endpoint, worker_id=5, replica_id=0, timeout_s=1.0, token="")
        with pytest.raises(CoordinatorUnavailable, match="may require the control token"):
            client.ask(hello=drafter_pb2.WorkerHello(worker_id=5, replica_id=0, pid=os.getpid()))
        client.close()  # its handshake monitor closed too: term does not hang
    finally:
        coord.close()


def test_a_refused_snapshot_asked_again_warns_once_a_minute_not_every_attempt(
        no_env_token: None, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A drafter with another token than its rollout asks for the capacity snapshot every 2 s until it answers;
    each request is a new socket with a new watch, so `zmq_handshake_failed` was logged at every attempt, by the
    coordinator and by each worker, for as long as the mismatch lasted. Now one warning per endpoint and minute;
    every attempt's TimeoutError still carries the hint. Real CURVE publisher and subscriber on 127.0.0.1."""
    from tlt.services.common import zmq_auth

    monkeypatch.setattr(zmq_auth, "_handshake_warned", {}, raising=False)
    with CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", token=TOKEN) as pub, \
            CapacitySubscriber(pub.pub_endpoint, pub.snapshot_endpoint, token=TOKEN + "-wrong") as stranger:
        capsys.readouterr()
        for _ in range(3):
            with pytest.raises(TimeoutError, match="may require the control token"):
                stranger.snapshot(timeout_s=0.5)
        said = [line for line in capsys.readouterr().err.splitlines() if "zmq_handshake_failed" in line]
        assert len(said) == 1 and "warning" in said[0], said
        monkeypatch.setattr(zmq_auth, "HANDSHAKE_WARN_EVERY_S", 0.0)  # the minute has passed: said again
        with pytest.raises(TimeoutError):
            stranger.snapshot(timeout_s=0.5)
        assert "zmq_handshake_failed" in capsys.readouterr().err


@pytest.mark.parametrize("make", [
    lambda: FeaturePusher("tcp://127.0.0.1:44508"),
    lambda: FeaturePuller("tcp://127.0.0.1:*"),
    lambda: CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
    lambda: CapacitySubscriber("tcp://127.0.0.1:44510", "tcp://127.0.0.1:44511"),
    lambda: __import__("tlt.services.drafter.coordinator_client", fromlist=["x"]).CoordinatorClient(
        "tcp://127.0.0.1:44512", 0, 0),
])
def test_a_token_file_that_cannot_be_used_leaves_no_zeromq_context_behind(
        monkeypatch: pytest.MonkeyPatch, tmp_path, make) -> None:  # noqa: ANN001
    """A blank TLT_AUTH_TOKEN_FILE raises (one line) before any ZeroMQ context is made: none left to the collector
    with its I/O thread, nor a socket ("Unclosed context", "Unclosed socket")."""
    import gc
    import warnings

    from tlt.services.common.auth import AuthConfigError

    blank = tmp_path / "token"
    blank.write_text("  \n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv(TOKEN_FILE_ENV, str(blank))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            make()
        except AuthConfigError as e:
            assert "empty" in str(e)
        else:
            pytest.fail("a blank token file was taken")
        gc.collect()
    assert not [str(w.message) for w in seen if "Unclosed" in str(w.message)]  # context or socket
