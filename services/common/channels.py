"""Options of every gRPC client channel of the project (RewardClient, RolloutClient).

Reconnecting: while a server is down (or still loading), grpc retries the
connection with a back-off that by default grows to 120 s, and every channel to
the same address in one process shares that connection (grpc's global
subchannel pool). A server restarted on the same port then kept getting
"Connection refused" answers from the cached failure for as long as the
back-off had grown to, even through a freshly made client
(docs/RELIABILITY.md). So each client gets its own connection and the back-off
is capped: a (re)started server is reached within about `max_reconnect_backoff_s`.

Keepalive (`keepalive_options`, the rollout's clients and server): a server process that hangs (a deadlock, a
frozen cgroup, SIGSTOP) keeps its TCP connection open, so a call without a deadline (a trainer's rollout) waited
for it forever and nothing noticed. The client pings the connection while a call runs; a server that does not
answer within the timeout ends the call with UNAVAILABLE. The server must accept such pings (SERVER_KEEPALIVE):
grpc's default sends GOAWAY "too_many_pings" to a client that pings more often than every 5 minutes.
"""

from __future__ import annotations


def client_options(max_message_bytes: int, max_reconnect_backoff_s: float = 1.0) -> list[tuple[str, int]]:
    if max_reconnect_backoff_s <= 0:
        raise ValueError(f"max_reconnect_backoff_s must be > 0, got {max_reconnect_backoff_s}")
    backoff_ms = max(1, int(max_reconnect_backoff_s * 1000))
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.use_local_subchannel_pool", 1),  # a new client never inherits another's back-off
            ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 1000)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms)]


def keepalive_options(every_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Client channel options: ping every `every_s` while a call runs; no answer in `timeout_s` ends the call."""
    if every_s <= 0 or timeout_s <= 0:
        raise ValueError(f"keepalive every_s and timeout_s must be > 0, got {every_s}, {timeout_s}")
    return [("grpc.keepalive_time_ms", int(every_s * 1000)), ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            # what grpc core waits for the ping's answer (keepalive_timeout_ms alone left it at the default 60 s)
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),  # only while a call waits
            ("grpc.http2.max_pings_without_data", 0)]  # a quiet stream (a long generation) keeps being pinged


# Server options that accept the clients' keepalive pings (any rate, also between data frames)
SERVER_KEEPALIVE = [("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                    ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY a pinging client
                    ("grpc.keepalive_permit_without_calls", 1)]
