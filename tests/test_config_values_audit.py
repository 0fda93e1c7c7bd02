"""The shapes of config values several sections share (services/common/config_values.py), at the edges the other
config tests left open (a mutation audit of the module, audit V-6 to V-29).

Each `*_problem` function is called on its own (it is pure: it only reads the text), and one case goes through
load_config as `tlt train` does. What is pinned: a value that would only fail later (in torch inside a replica or
worker, in ZeroMQ as a service starts, or as gRPC "not reachable" after a whole connect timeout) is refused when the
config loads, and a value that works is not refused. No part is faked.
"""

from __future__ import annotations

from tlt.services.common.config import load_config
from tlt.services.common.config_values import device_problem, grpc_address_problem, zmq_endpoint_problem
from tlt.services.trainer.config import TrainerConfig


def test_zeromq_endpoints_port_0_trailing_text_and_the_forms_each_side_is_told() -> None:
    """Port 0, like *, picks a free port only where a socket binds: a connect to tcp://HOST:0 reaches nothing, so it
    is refused for a connecting side and taken for a binding one (audit V-11). The whole text must be the endpoint:
    tcp://127.0.0.1:5704x is no port ZeroMQ can use (audit V-10). And a refusal tells each side the forms it may
    use: only a binding side is told that * or 0 picks a free port (audit V-27)."""
    assert zmq_endpoint_problem("tcp://127.0.0.1:0", bind=True) is None
    problem = zmq_endpoint_problem("tcp://127.0.0.1:0", bind=False)
    assert problem is not None and "picks a free port only where one binds" in problem, problem
    for text in ("tcp://127.0.0.1:5704x", "tcp://127.0.0.1:5704 ", "tcp://127.0.0.1:5704:1x"):
        for bind in (True, False):
            assert zmq_endpoint_problem(text, bind=bind) is not None, (text, bind)
    bind_says, connect_says = zmq_endpoint_problem("foo", bind=True), zmq_endpoint_problem("foo", bind=False)
    assert "PORT * or 0 picks a free one" in bind_says, bind_says
    assert "picks a free" not in connect_says and "tcp://HOST:PORT" in connect_says, connect_says


def test_grpc_addresses_unix_sockets_port_edges_and_malformed_host_ports() -> None:
    """unix:PATH is a gRPC target the refusal itself offers (audit V-8); ports 1 and 65535 can be dialled and 65536
    cannot (audits V-18, V-19). A host:port with no host, an unbracketed IPv6 address, a port given twice or text
    after the port is no address gRPC dials as meant; it failed only after the caller's whole connect timeout
    (audits V-6, V-26, V-29)."""
    for good in ("unix:/run/tlt/reward.sock", "unix:///tmp/reward.sock", "127.0.0.1:1", "127.0.0.1:65535",
                 "[::1]:65535", "rollout.svc:50051"):
        assert grpc_address_problem(good) is None, good
    problem = grpc_address_problem("127.0.0.1:65536")
    assert problem is not None and "is not a TCP port a client can dial (1-65535)" in problem, problem
    for bad in (":50051", "::1:50051", "rollout:50051:50051", "rollout:50051x", "rollout:50051/", "[::1]:5x"):
        problem = grpc_address_problem(bad)
        assert problem is not None and problem.startswith("must be a gRPC address HOST:PORT"), (bad, problem)
    # through the trainer's config, as `tlt train` loads it: a reward service on a unix socket is taken
    cfg = load_config(TrainerConfig, "trainer", None, {"reward": "grpc", "reward_address": "unix:/run/tlt/reward.sock"},
                      environ={})
    assert cfg.reward_address == "unix:/run/tlt/reward.sock"


def test_devices_two_digit_gpus_and_malformed_cpu_or_cuda() -> None:
    """cuda:10 is a GPU of a 16-GPU node (audit V-25); 'cuda:' with no index, 'cpu0' or 'cpux' are refused by torch
    only when a model is moved there, in every replica or worker process (audits V-9, V-21, V-30). A template
    device (the drafter's, indexed=False) is told its forms are cpu or cuda, never cuda:N, which it refuses
    (audit V-28)."""
    assert device_problem("cuda:10") is None and device_problem("cuda:15") is None
    for bad in ("cuda:", "cpu0", "cpux", "cpu ", "cuda0", "cudax"):
        problem = device_problem(bad)
        assert problem is not None and problem.startswith("must be a torch device"), (bad, problem)
    template = device_problem("gpu", indexed=False)
    assert template == "must be a torch device, cpu or cuda; got 'gpu'", template
    assert device_problem("gpu") == "must be a torch device, cpu, cuda or cuda:N (e.g. cuda:0); got 'gpu'"


def test_grpc_targets_of_the_xds_resolvers_are_taken_and_passthrough_is_refused() -> None:
    """The reward client hands any scheme but dns: to gRPC's own resolver (services/reward/replicas.py, and
    docs/DEPLOY.md says an `xds:///...` target is left to it; tests/test_reward_client_replicas.py dials one), but the
    trainer's config refused `xds:///tlt-reward:50061` before the client was built: a service mesh's reward
    service could not be named at all (found by the audit of this module). grpcio registers xds: and google-c2p:
    beside its own schemes; passthrough: is grpc-go's and grpc-java's only (grpcio takes `passthrough:///HOST:PORT`
    for a DNS name and never connects), so it stays refused, with the forms that work."""
    for good in ("xds:///tlt-reward:50061", "xds:tlt-reward", "google-c2p:///reward.example.com"):
        assert grpc_address_problem(good) is None, good
    cfg = load_config(TrainerConfig, "trainer", None, {"reward": "grpc", "reward_address": "xds:///tlt-reward:50061"},
                      environ={})
    assert cfg.reward_address == "xds:///tlt-reward:50061"
    problem = grpc_address_problem("passthrough:///127.0.0.1:50061")
    assert problem is not None and "xds:///NAME" in problem and "unix:PATH" in problem, problem
