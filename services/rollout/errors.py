"""What the replica pool raises; the servers map them to status codes (400 / 503 / a refused push)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The engine refused the request; the message is fit for a 400 answer."""


class ReplicaUnavailableError(RuntimeError):
    """No live replica, or the replica serving a request died."""


class OverloadedError(RuntimeError):
    """The replicas hold as many sequences as `max_pending_sequences` allows: retry later (429 / RESOURCE_EXHAUSTED)."""


class WeightUpdateError(ValueError):
    """A weight push was rejected (validation) or failed to apply; nothing changed unless the message says so."""
