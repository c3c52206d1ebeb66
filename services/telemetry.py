"""Tracing setup and W3C trace-context helpers shared by every Python service.

Configured only by the standard OTEL_* variables: with neither OTEL_EXPORTER_OTLP_ENDPOINT nor
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set, nothing is installed and the API's no-op tracer makes
every span call a cheap no-op. With one set, spans go to that OTLP/gRPC endpoint in batches;
OTEL_SERVICE_NAME names the service and OTEL_TRACES_SAMPLER(_ARG) picks the sampler.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_installed: list[object] = []


def init_tracing(default_service_name: str) -> bool:
    """Install the OTLP exporter when an endpoint is configured; True when tracing is on."""
    if _installed or not any(os.environ.get(v) for v in _ENDPOINT_VARS):
        return bool(_installed)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _installed.append(provider)
    atexit.register(provider.shutdown)
    log.info("tracing to %s as %s", next(os.environ[v] for v in _ENDPOINT_VARS
                                         if os.environ.get(v)), name)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (also runs at exit)."""
    for provider in _installed:
        provider.shutdown()  # type: ignore[attr-defined]


def traceparent(ctx: otel_context.Context | None = None) -> str:
    """The W3C traceparent of `ctx` (default: the current context); "" when there is none."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def context_from(value: str | None = None,
                 metadata: Sequence[tuple[str, str | bytes]] | Mapping[str, str] | None = None
                 ) -> otel_context.Context | None:
    """The trace context of a traceparent string, else of gRPC metadata; None when absent."""
    carrier: dict[str, str] = {}
    if metadata is not None:
        items = metadata.items() if isinstance(metadata, Mapping) else metadata
        carrier = {k.lower(): v if isinstance(v, str) else v.decode() for k, v in items
                   if k.lower() in ("traceparent", "tracestate")}
    if value:
        carrier = {"traceparent": value}
    if "traceparent" not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    span = trace.get_current_span(ctx)
    return ctx if span.get_span_context().is_valid else None


def metadata_for(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the trace context."""
    tp = traceparent(ctx)
    return [("traceparent", tp)] if tp else []
