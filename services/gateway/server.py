"""The gateway's app and process: `create_gateway(config) -> GatewayHandle` (listening, the
bound port known), `serve(config, metrics_port)` until SIGTERM or SIGINT.

aiohttp serves it: one dependency with its own HTTP/1.1 server and a C parser, server-sent
events as plain writes on a `StreamResponse`, and handler cancellation when a client's
connection drops, which is how a client leaving mid-stream cancels its request upstream.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

from aiohttp import web

from services.gateway import handlers, tokens
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import METRICS, observe
from services.gateway.upstream import Upstream
from services.metrics import serve_metrics
from services.telemetry import init_tracing

log = logging.getLogger(__name__)


def create_app(config: GatewayConfig, upstream: Upstream, metrics: GatewayMetrics
               ) -> web.Application:
    app = web.Application(middlewares=[observe], client_max_size=config.max_body_bytes)
    app[handlers.UPSTREAM] = upstream
    app[handlers.CONFIG] = config
    app[handlers.STARTED] = int(time.time())
    app[METRICS] = metrics
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model}", handlers.get_model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_post("/tokenize", tokens.tokenize)
    app.router.add_post("/detokenize", tokens.detokenize)
    app.router.add_get("/tokenizer_info", tokens.tokenizer_info)
    return app


@dataclass
class GatewayHandle:
    runner: web.AppRunner
    port: int
    upstream: Upstream
    metrics: GatewayMetrics

    async def close(self) -> None:
        """Stop listening, end open streams (their calls are cancelled), close the channel."""
        await self.runner.cleanup()
        await self.upstream.close()


async def create_gateway(config: GatewayConfig) -> GatewayHandle:
    """Listen on config.host:config.port (0: any free port). The orchestrator need not be up:
    requests answer 503 until it is. Raises OSError when the port cannot be bound."""
    upstream = Upstream(config.orchestrator, num_channels=config.num_channels,
                        served_model_name=config.served_model_name)
    metrics = GatewayMetrics()
    runner = web.AppRunner(create_app(config, upstream, metrics), handler_cancellation=True,
                           access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_port=config.is_port_shared)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        await upstream.close()
        raise
    return GatewayHandle(runner, int(runner.addresses[0][1]), upstream, metrics)


async def serve(config: GatewayConfig, metrics_port: int | None = None) -> None:
    """Serve until SIGTERM or SIGINT; print one line saying where once listening."""
    init_tracing("llmstage-gateway")
    handle = await create_gateway(config)
    metrics_line = ""
    if metrics_port is not None:
        _, bound = serve_metrics(handle.metrics.registry, config.host, metrics_port)
        metrics_line = f", metrics on {config.host}:{bound}"
    print(f"gateway listening on http://{config.host}:{handle.port} (OpenAI API; "
          f"orchestrator {config.orchestrator}){metrics_line}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await handle.close()
