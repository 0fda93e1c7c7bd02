"""Options of every gRPC client channel of the project (RewardClient, RolloutClient).

Reconnecting: while a server is down (or still loading), grpc retries the
connection with a back-off that by default grows to 120 s, and every channel to
the same address in one process shares that connection (grpc's global
subchannel pool). A server restarted on the same port then kept getting
"Connection refused" answers from the cached failure for as long as the
back-off had grown to, even through a freshly made client
(docs/RELIABILITY.md). So each client gets its own connection and the back-off
is capped: a (re)started server is reached within about `max_reconnect_backoff_s`.
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
