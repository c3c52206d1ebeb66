"""Prometheus plumbing shared by the services: a registry per service object (so several can
live in one process, as in tests) and an HTTP endpoint serving it."""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

# Latency buckets in seconds: 1 ms .. 60 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[WSGIServer, int]:
    """Serve `registry` at http://host:port/metrics on a daemon thread; return the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return server, bound
