"""The gateway's Prometheus metrics: HTTP requests by route and status code, their latency, the
time to the first streamed token, and the requests in flight. `route` is the route's pattern
("/v1/chat/completions"), or "unmatched" for a path no route serves, so the label set stays
small whatever clients send. A client that went away before the answer ended counts as 499."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.metrics import LATENCY_BUCKETS


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        b = LATENCY_BUCKETS
        self.requests = Counter("llmstage_gateway_http_requests_total",
                                "HTTP requests by route, method and status code",
                                ["route", "method", "code"], registry=r)
        self.latency = Histogram("llmstage_gateway_http_request_duration_seconds",
                                 "HTTP request to the end of its answer (a stream's last "
                                 "event included)", ["route"], registry=r, buckets=b)
        self.ttft = Histogram("llmstage_gateway_time_to_first_token_seconds",
                              "HTTP request to its first generated text", ["route"],
                              registry=r, buckets=b)
        self.in_flight = Gauge("llmstage_gateway_http_requests_in_flight",
                               "HTTP requests being served", registry=r)
