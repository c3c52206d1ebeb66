"""The routes: each parses its body into Calls (call.py), makes one Generate call per choice
(runs.py) and answers in OpenAI's shapes (answers.py, shapes.py). Errors are raised, never
answered here (middleware.py maps them).

Streaming waits for the first event of every choice's Generate stream before it answers 200,
so what fails before any text (a refused request, a full queue, an orchestrator that is down)
gets its own HTTP status; a failure after that ends the stream with an error event and no
`[DONE]`. A client that goes away cancels the handler (the runner is built with handler
cancellation), which closes the Generate calls and so cancels the request on every stage.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Iterable

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.errors import InvalidArgument, ServiceError
from services.gateway.answers import ChoiceStream, whole_choice
from services.gateway.call import Call, parse_chat, parse_completions
from services.gateway.config import GatewayConfig
from services.gateway.middleware import METRICS, json_error, route_of
from services.gateway.runs import Merged, jobs_of, prompt_of, run_all
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
    return await _generate(request, (parse_chat(await body_of(request)),), "chatcmpl-")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completions(await body_of(request)), "cmpl-")


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


async def _generate(request: web.Request, calls: tuple[Call, ...], prefix: str
                    ) -> web.StreamResponse:
    """Every choice of the request: n per prompt (runs.py), shaped (answers.py)."""
    upstream = request.app[UPSTREAM]
    first = calls[0]
    await upstream.check_model(first.model)
    request_id = prefix + uuid.uuid4().hex
    trace.get_current_span().set_attributes({
        "llmstage.request_id": request_id, "gen_ai.request.model": first.model,
        "gen_ai.request.stream": first.is_stream, "gen_ai.request.choice.count": first.n,
        "llmstage.num_prompts": len(calls),
        **({"enduser.id": first.user} if first.user else {})})
    shaper = Shaper.create(first.kind, request_id, first.model)
    jobs = jobs_of(calls, request_id)
    prompts = [await prompt_of(upstream, call) for call in calls]

    def texts(ids: Iterable[int]) -> Awaitable[dict[int, str]]:
        return upstream.token_texts(first.model, ids)

    timeout_s = request.app[CONFIG].request_timeout_s
    if first.is_stream:
        streams = [ChoiceStream(job.call, job.index, prompts[0], texts) for job in jobs]
        return await _stream(request, Merged(upstream, jobs, timeout_s), streams, shaper,
                             first.include_usage)
    gens = await run_all(upstream, jobs, timeout_s)
    failed = next((g.outcome for g in gens if g.outcome and g.outcome.finish_reason == "error"),
                  None)
    if failed is not None:
        return json_error(GENERATION_FAILED, failed_generation(failed))
    choices = [await whole_choice(job.call, job.index, gen, prompts[job.index // first.n],
                                  texts) for job, gen in zip(jobs, gens, strict=True)]
    outcomes = [gen.outcome for gen in gens if gen.outcome is not None]
    return web.json_response(shaper.whole(choices, outcomes, first.n),
                             headers={"X-Request-Id": request_id})


async def _stream(request: web.Request, merged: Merged, streams: list[ChoiceStream],
                  shaper: Shaper, include_usage: bool) -> web.StreamResponse:
    """Every choice's chunks, interleaved as they come; [DONE] once all have ended."""
    t0 = time.perf_counter()
    try:
        # what fails before every choice's first event is an HTTP error status
        held: list[tuple[int, Piece | Outcome | Exception]] = []
        while len({i for i, _ in held}) < len(streams):
            index, ev = await merged.next()
            if isinstance(ev, Exception):
                raise ev
            if isinstance(ev, Outcome) and ev.finish_reason == "error":
                return json_error(GENERATION_FAILED, failed_generation(ev))
            held.append((index, ev))
        response = web.StreamResponse(headers={**_SSE_HEADERS,
                                               "X-Request-Id": shaper.request_id})
        await response.prepare(request)
        await _relay(request, merged, held, streams, shaper, response, t0, include_usage)
    finally:
        await merged.close()  # cancels the calls still running when the client went away
    with contextlib.suppress(ConnectionResetError):  # a client may leave once it has [DONE]
        await response.write_eof()
    return response


async def _relay(request: web.Request, merged: Merged,
                 held: list[tuple[int, Piece | Outcome | Exception]],
                 streams: list[ChoiceStream], shaper: Shaper, response: web.StreamResponse,
                 t0: float, include_usage: bool) -> None:
    ttft = request.app[METRICS].ttft.labels(route_of(request))
    outcomes: dict[int, Outcome] = {}
    is_first = True
    try:
        while len(outcomes) < len(streams):
            index, ev = held.pop(0) if held else await merged.next()
            if isinstance(ev, Exception):
                raise ev
            if isinstance(ev, Piece):
                if is_first:
                    ttft.observe(time.perf_counter() - t0)
                    is_first = False
                choices = await streams[index].piece(ev)
            elif ev.finish_reason == "error":
                await response.write(event(failed_generation(ev)))
                return
            else:
                outcomes[index] = ev
                choices = await streams[index].end(ev)
            for choice in choices:
                await response.write(shaper.chunk([choice]))
        if include_usage:
            n = len(streams)
            await response.write(shaper.usage_chunk([outcomes[i] for i in range(n)], n))
        await response.write(DONE)
    except ServiceError as exc:  # after the 200: the stream ends with an error event
        trace.get_current_span().record_exception(exc)
        await response.write(event(error_for(exc)[1]))
