"""The routes: each parses its body into a Call (call.py), makes one Generate call through
Upstream and answers in OpenAI's shapes (shapes.py). Errors are raised, never answered here
(middleware.py maps them).

Streaming waits for the first event of the Generate stream before it answers 200, so what
fails before any text (a refused request, a full queue, an orchestrator that is down) gets its
own HTTP status; a failure after that ends the stream with an error event and no `[DONE]`.
A client that goes away cancels the handler (the runner is built with handler cancellation),
which closes the Generate call and so cancels the request on every stage.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.errors import Internal, InvalidArgument, ServiceError
from services.gateway.call import Call, parse_chat, parse_completions
from services.gateway.config import GatewayConfig
from services.gateway.middleware import METRICS, json_error, route_of
from services.gateway.shapes import (
    DONE,
    GENERATION_FAILED,
    Shaper,
    error_for,
    event,
    failed_generation,
)
from services.gateway.upstream import Outcome, Piece, Upstream

UPSTREAM = web.AppKey("upstream", Upstream)
CONFIG = web.AppKey("config", GatewayConfig)
STARTED = web.AppKey("started", int)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat(await body_of(request)), "chatcmpl-")


async def completions(request: web.Request) -> web.StreamResponse:
    calls = parse_completions(await body_of(request))
    if len(calls) == 1:
        return await _generate(request, calls[0], "cmpl-")
    return await _batch(request, calls, "cmpl-")


async def metrics(request: web.Request) -> web.Response:
    """The gateway's Prometheus metrics on its own port (as --metrics-port serves them)."""
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_models(request: web.Request) -> web.Response:
    ids = await request.app[UPSTREAM].models()
    return web.json_response({"object": "list",
                              "data": [_model(request, model) for model in ids]})


async def get_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    await request.app[UPSTREAM].check_model(model)
    return web.json_response(_model(request, model))


async def health(request: web.Request) -> web.Response:
    upstream = request.app[UPSTREAM]
    if await upstream.is_serving():
        return web.json_response({"status": "ok", "orchestrator": upstream.target})
    return json_error(503, {"error": {
        "message": f"the orchestrator at {upstream.target} is not serving",
        "type": "service_unavailable_error", "param": None, "code": "unavailable"}})


def _model(request: web.Request, model: str) -> dict:
    return {"id": model, "object": "model", "created": request.app[STARTED],
            "owned_by": "llm-runner-svc"}


async def body_of(request: web.Request) -> object:
    """The request's JSON body; InvalidArgument when it does not parse."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidArgument("the request body is not valid JSON") from None


async def _generate(request: web.Request, call: Call, prefix: str) -> web.StreamResponse:
    upstream = request.app[UPSTREAM]
    await upstream.check_model(call.model)
    request_id = prefix + uuid.uuid4().hex
    trace.get_current_span().set_attributes({
        "llmstage.request_id": request_id, "gen_ai.request.model": call.model,
        "gen_ai.request.stream": call.is_stream, **({"enduser.id": call.user} if call.user
                                                    else {})})
    shaper = Shaper.create(call.kind, request_id, call.model)
    events = upstream.generate(call, request_id, request.app[CONFIG].request_timeout_s)
    try:
        if call.is_stream:
            return await _stream(request, events, shaper, call.include_usage)
        return await _whole(events, shaper)
    finally:
        await events.aclose()  # cancels the call when the client went away first


async def _whole(events: AsyncIterator[Piece | Outcome], shaper: Shaper) -> web.Response:
    text, outcome = await _read(events)
    if outcome.finish_reason == "error":
        return json_error(GENERATION_FAILED, failed_generation(outcome))
    return web.json_response(shaper.whole(text, outcome),
                             headers={"X-Request-Id": shaper.request_id})


async def _read(events: AsyncIterator[Piece | Outcome]) -> tuple[str, Outcome]:
    """A whole Generate stream: its text and its outcome."""
    parts: list[str] = []
    outcome = None
    async for ev in events:
        if isinstance(ev, Piece):
            parts.append(ev.text)
        else:
            outcome = ev
    if outcome is None:
        raise Internal("the Generate stream ended without a final report")
    return "".join(parts), outcome


async def _batch(request: web.Request, calls: tuple[Call, ...], prefix: str) -> web.Response:
    """Several prompts of one request: each its own Generate call, as many at once as the
    orchestrator runs (its maxRunning: more would only wait in its queue, and a batch larger
    than the queue would be refused); choice i answers prompt i, the usage is their sum. The
    first to fail fails the request and cancels the others."""
    upstream = request.app[UPSTREAM]
    await upstream.check_model(calls[0].model)
    request_id = prefix + uuid.uuid4().hex
    trace.get_current_span().set_attributes({
        "llmstage.request_id": request_id, "gen_ai.request.model": calls[0].model,
        "llmstage.num_prompts": len(calls)})
    timeout_s = request.app[CONFIG].request_timeout_s

    in_flight = asyncio.Semaphore(upstream.max_running)

    async def one(i: int, call: Call) -> tuple[str, Outcome]:
        async with in_flight:
            events = upstream.generate(call, f"{request_id}-{i}", timeout_s)
            try:
                return await _read(events)
            finally:
                await events.aclose()

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, call)) for i, call in enumerate(calls)]
    except ExceptionGroup as failures:  # the first prompt's error answers (its HTTP status)
        raise failures.exceptions[0] from None
    answers = [task.result() for task in tasks]
    failed = next((outcome for _, outcome in answers if outcome.finish_reason == "error"), None)
    if failed is not None:
        return json_error(GENERATION_FAILED, failed_generation(failed))
    shaper = Shaper.create(calls[0].kind, request_id, calls[0].model)
    return web.json_response(shaper.batch(answers), headers={"X-Request-Id": request_id})


async def _stream(request: web.Request, events: AsyncIterator[Piece | Outcome], shaper: Shaper,
                  include_usage: bool) -> web.StreamResponse:
    t0 = time.perf_counter()
    first = await anext(events, None)  # what fails before this is an HTTP error status
    if isinstance(first, Outcome) and first.finish_reason == "error":
        return json_error(GENERATION_FAILED, failed_generation(first))
    response = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": shaper.request_id})
    await response.prepare(request)
    ttft = request.app[METRICS].ttft.labels(route_of(request))
    is_first = True
    try:
        ev = first
        while ev is not None:
            if isinstance(ev, Piece):
                if is_first:
                    ttft.observe(time.perf_counter() - t0)
                await response.write(shaper.chunk(ev.text, is_first=is_first))
                is_first = False
            elif ev.finish_reason == "error":
                await response.write(event(failed_generation(ev)))
                break
            else:
                if is_first and shaper.kind == "chat":  # no text at all: still name the role
                    await response.write(shaper.chunk("", is_first=True))
                await response.write(shaper.last_chunk(ev))
                if include_usage:
                    await response.write(shaper.usage_chunk(ev))
                await response.write(DONE)
                break
            ev = await anext(events, None)
        else:
            raise Internal("the Generate stream ended without a final report")
    except ServiceError as exc:  # after the 200: the stream ends with an error event
        trace.get_current_span().record_exception(exc)
        await response.write(event(error_for(exc)[1]))
    await response.write_eof()
    return response
