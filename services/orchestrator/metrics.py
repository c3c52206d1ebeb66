"""The orchestrator's Prometheus metrics."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.metrics import LATENCY_BUCKETS

State = Callable[[], Mapping[str, int]]


class OrchestratorMetrics:
    """Counters and histograms fed per request; gauges read `state()` (the orchestrator's
    state accounting: runs, running, queued, in_flight, step_streams, stream_members)."""

    def __init__(self, state: State) -> None:
        r = self.registry = CollectorRegistry()
        b = LATENCY_BUCKETS
        self.requests = Counter("llmstage_orchestrator_requests_total",
                                "Generate calls by outcome (finish reason or status code)",
                                ["outcome"], registry=r)
        self.ttft = Histogram("llmstage_orchestrator_time_to_first_token_seconds",
                              "Generate call to first delta", registry=r, buckets=b)
        self.e2e = Histogram("llmstage_orchestrator_e2e_request_latency_seconds",
                             "Generate call to final report", registry=r, buckets=b)
        self.queue = Histogram("llmstage_orchestrator_queue_time_seconds",
                               "Time waiting for admission", registry=r, buckets=b)
        Gauge("llmstage_orchestrator_requests_running", "Requests generating",
              registry=r).set_function(functools.partial(_read, state, "running"))
        Gauge("llmstage_orchestrator_requests_waiting", "Requests queued for admission",
              registry=r).set_function(functools.partial(_read, state, "queued"))
        held = Gauge("llmstage_orchestrator_state",
                      "What the orchestrator holds now, by kind: runs, in_flight (slots on "
                      "replicas), step_streams (open Step streams), stream_members",
                      ["kind"], registry=r)
        for kind in ("runs", "in_flight", "step_streams", "stream_members"):
            held.labels(kind).set_function(functools.partial(_read, state, kind))


def _read(state: State, kind: str) -> float:
    return state()[kind]
