"""A test OTLP/gRPC receiver: the collector's standard TraceService, keeping every span."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    status_code: int
    status_message: str


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """OTEL_* settings that send a process's spans here quickly."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "50",
                "OTEL_TRACES_SAMPLER": "always_on"}

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for rs in request.resource_spans:
                service = next((_value(a.value) for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(SpanRecord(
                            service, s.name, s.trace_id.hex(), s.span_id.hex(),
                            s.parent_span_id.hex(), s.kind,
                            {a.key: _value(a.value) for a in s.attributes},
                            tuple(e.name for e in s.events), s.status.code, s.status.message))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[SpanRecord]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate: Any, timeout: float = 15.0) -> list[SpanRecord]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def request_trace(self, root_name: str, request_id: str, names: frozenset[str],
                      timeout: float = 15.0) -> tuple[SpanRecord | None, list[SpanRecord]]:
        """The span `root_name` that carries `request_id` and every span of its trace, once
        spans of each of `names` are in that trace (each process exports on its own
        schedule); (None, []) when no such root came within `timeout`."""
        def root(spans: list[SpanRecord]) -> SpanRecord | None:
            return next((s for s in spans if s.name == root_name
                         and s.attributes.get("llmstage.request_id") == request_id), None)

        def done(spans: list[SpanRecord]) -> bool:
            r = root(spans)
            return r is not None and names <= {s.name for s in spans if s.trace_id == r.trace_id}

        found = root(self.wait_for(done, timeout))
        return found, [] if found is None else self.trace(found.trace_id)

    def stop(self) -> None:
        self.server.stop(0)
