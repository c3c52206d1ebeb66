"""What every HTTP request goes through: its SERVER span (the trace's root, or a child of the
caller's W3C `traceparent`), its metrics, and the mapping of raised errors to OpenAI-shaped
bodies with their HTTP status. Handlers raise typed errors (services/errors.py) and never build
error answers themselves; anything else raised is a bug: logged, 500."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.gateway.metrics import GatewayMetrics
from services.gateway.shapes import error_body, error_for
from services.telemetry import context_from

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("llmstage.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
METRICS = web.AppKey("metrics", GatewayMetrics)
CLIENT_GONE = 499  # nginx's code for a client that closed the connection first
_RETRY_AFTER = {429: "1", 503: "1"}


def json_error(status: int, body: dict) -> web.Response:
    headers = {"Retry-After": _RETRY_AFTER[status]} if status in _RETRY_AFTER else None
    return web.json_response(body, status=status, headers=headers)


def route_of(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[METRICS]
    route = route_of(request)
    parent = context_from(value=request.headers.get("traceparent"))
    span = _tracer.start_span(f"{request.method} {route}", context=parent, kind=SpanKind.SERVER,
                              attributes={"http.request.method": request.method,
                                          "http.route": route, "url.path": request.path})
    token = otel_context.attach(trace.set_span_in_context(span))
    t0 = time.perf_counter()
    metrics.in_flight.inc()
    code = 500
    try:
        response = await _answer(request, handler)
        code = response.status
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        code = CLIENT_GONE
        span.add_event("client_gone")
        raise
    finally:
        metrics.in_flight.dec()
        metrics.requests.labels(route, request.method, str(code)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - t0)
        span.set_attribute("http.response.status_code", code)
        if code >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {code}"))
        otel_context.detach(token)
        span.end()


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:  # aiohttp's own: no route, wrong method, body too large
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return json_error(exc.status, error_body(exc.reason, kind, None))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        status, body = error_for(exc)
        if status == 500:
            log.error("%s %s failed", request.method, request.path, exc_info=exc)
        trace.get_current_span().record_exception(exc)
        return json_error(status, body)
