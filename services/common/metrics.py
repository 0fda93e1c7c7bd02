"""Prometheus metrics helper: one registry per service, typed metric factories.

Each service builds its metrics on its own `CollectorRegistry` (so several
services in one test process do not clash) and exposes them either through
its HTTP app (`render()` gives the text format) or a standalone exporter
(`serve(port)`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)


class Metrics:
    """A namespaced registry: `m = Metrics("rollout"); m.counter("requests_total", "...")`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labelnames=labels, namespace=self.namespace, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labelnames=labels, namespace=self.namespace, registry=self.registry)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] | None = None
    ) -> Histogram:
        kw = {"buckets": tuple(buckets)} if buckets else {}
        return Histogram(name, doc, labelnames=labels, namespace=self.namespace, registry=self.registry, **kw)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsExporter:
        """Expose /metrics on its own port (for services without an HTTP app); port 0 picks a free one."""
        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsExporter(httpd, thread)


class MetricsExporter:
    """A running /metrics HTTP exporter: `port` is the bound port, `close()` stops it."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.port: int = httpd.server_address[1]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
