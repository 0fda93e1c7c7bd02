"""Shapes of config values that more than one section takes: ZeroMQ endpoints, gRPC addresses, torch devices.

Each `*_problem(text)` says why `text` is no such value (a sentence naming the value and the forms that would
do), or None when it is one; a config's field validator raises it, so load_config reports it with the field and
where the value came from. Only the shape is checked: nothing is resolved, bound or connected, and no device is
looked for (a config may be checked on a machine that has none of them).
"""

from __future__ import annotations

import re

_TCP = re.compile(r"tcp://(?P<host>[^\s/]+):(?P<port>[0-9]+|\*)")
_NAMED = re.compile(r"(ipc|inproc)://\S+")
# gRPC client targets: host:port (a name, IPv4, or [IPv6]), or a name-resolver URI that gRPC reads itself
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>[0-9]+)")
# the resolvers gRPC's core registers (what grpcio dials): its own, and the xDS ones (xds: wants a bootstrap file,
# google-c2p: falls back to DNS off Google Cloud). passthrough: is grpc-go's and grpc-java's, not grpcio's: refused
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:", "google-c2p:")
_CUDA = re.compile(r"cuda(:(?P<index>[0-9]+))?")


def zmq_endpoint_problem(text: str, bind: bool) -> str | None:
    """Why `text` is no ZeroMQ endpoint this side can bind (`bind`) or connect to; None when it is one.

    ZeroMQ itself refuses '' or 'foo' only when a socket binds or connects: a ZMQError traceback as the service
    starts, or never, in a worker that waits for the rollout's capacity snapshot before it connects its coordinator."""
    shape = ("tcp://HOST:PORT (e.g. tcp://127.0.0.1:5704; PORT * or 0 picks a free one), ipc://PATH or inproc://NAME"
             if bind else "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5704), ipc://PATH or inproc://NAME")
    if _NAMED.fullmatch(text):
        return None
    m = _TCP.fullmatch(text)
    if m is None:
        return f"must be a ZeroMQ endpoint {shape}, got {text!r}"
    if m["port"] == "*" or int(m["port"]) == 0:
        return None if bind else f"port {m['port']} of {text!r} picks a free port only where one binds; give the port"
    if int(m["port"]) > 65535:
        return f"port {m['port']} of {text!r} is not a TCP port (1-65535)"
    if m["host"] == "*" and not bind:
        return f"host * of {text!r} is for a bind (every interface); give the host to connect to"
    return None


def grpc_address_problem(text: str) -> str | None:
    """Why `text` is no gRPC address a client can dial; None when it is one.

    gRPC takes any string as a target and fails only when it connects: after the caller's whole connect timeout
    (minutes, for a trainer waiting on its rollout servers), as "not reachable", for a typo such as a missing port."""
    if text.startswith(_GRPC_SCHEMES):
        return None
    m = _HOST_PORT.fullmatch(text)
    if m is None:
        return (f"must be a gRPC address HOST:PORT (e.g. 127.0.0.1:50051, rollout.svc:50051, [::1]:50051) "
                f"or a gRPC target URI (dns:///HOST:PORT, unix:PATH, xds:///NAME), got {text!r}")
    if not 1 <= int(m["port"]) <= 65535:
        return f"port {m['port']} of {text!r} is not a TCP port a client can dial (1-65535)"
    return None


def device_problem(text: str, indexed: bool = True) -> str | None:
    """Why `text` is no torch device this project runs on (cpu, cuda, cuda:N); None when it is one. `indexed`:
    cuda:N may be given (False: a template that each process completes with its own index, so only cuda).

    torch refuses '' or 'gpu' only when a model is moved there, inside a replica or worker process."""
    if text == "cpu":
        return None
    m = _CUDA.fullmatch(text)
    if m is None:
        forms = "cpu, cuda or cuda:N (e.g. cuda:0)" if indexed else "cpu or cuda"
        return f"must be a torch device, {forms}; got {text!r}"
    if m["index"] is not None and not indexed:
        return (f"{text!r} names one GPU, but this is a template: each process uses cuda:<its replica>; "
                "give cuda")
    return None
