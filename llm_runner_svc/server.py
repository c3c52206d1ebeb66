"""The llm_runner_svc process: an LlmStage behind the Stage service.

`create_stage_server(config, options)` builds and starts everything and returns the handle and
stage (tests use port 0); `serve(config, options)` runs until SIGTERM and drains.
"""

from __future__ import annotations

import asyncio
import logging

from llm_runner_svc.admin import admin_token_from_env
from llm_runner_svc.servicer import SERVICE_NAME, StageServicer
from llm_runner_svc.stage import LlmStage
from llm_runner_svc.stage.llm_stage import RuntimeFactory, StageConfig
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.metrics import serve_metrics
from services.server import ServerHandle, ServerOptions, create_server, serve_until_signal
from services.telemetry import init_tracing

log = logging.getLogger(__name__)


async def create_stage_server(config: StageConfig, options: ServerOptions,
                              slot_ttl_s: float = 600.0,
                              runtime_factory: RuntimeFactory | None = None
                              ) -> tuple[ServerHandle, LlmStage]:
    """Load the model, preallocate, start the decode loop and the server. `runtime_factory`
    builds the runtime (default: the plain one, or LLM_RUNNER_FAULTS's faulty one). Admin
    calls take the token in LLM_RUNNER_ADMIN_TOKEN (none set: they are refused)."""
    stage = LlmStage.create(config, slot_ttl_s, options.max_message_bytes, runtime_factory)
    await stage.start()
    try:
        servicer = StageServicer(stage, admin_token_from_env())
        handle = await create_server(
            options, [(stage_pb2_grpc.add_StageServicer_to_server, servicer, SERVICE_NAME)])
    except BaseException:
        await stage.close()
        raise
    return handle, stage


async def stop_stage_server(handle: ServerHandle, stage: LlmStage, grace_s: float = 0.0) -> None:
    """Drain (NOT_SERVING, running members finish or are cancelled), stop, release."""
    await handle.set_serving(False)
    await stage.drain(grace_s)
    await handle.server.stop(grace=1.0)
    await stage.close()


async def _serve(config: StageConfig, options: ServerOptions, slot_ttl_s: float,
                 metrics_port: int | None) -> None:
    init_tracing(f"llmstage-{config.stage_id}")
    handle, stage = await create_stage_server(config, options, slot_ttl_s)
    metrics_line = ""
    if metrics_port is not None:
        _, bound = serve_metrics(stage.metrics.registry, options.host, metrics_port)
        metrics_line = f", metrics on {options.host}:{bound}"
    desc = stage.describe()
    # The one line a launcher (or a person) reads to learn where the stage listens.
    print(f"llm-runner: stage {desc.stage_id!r} ({desc.model.name}, engine {desc.engine}, "
          f"maxBatch {desc.max_batch}, maxSeq {desc.max_seq}) listening on "
          f"{options.host}:{handle.port}{metrics_line}", flush=True)
    try:
        await serve_until_signal(handle, options, stage.drain)
    finally:
        await stage.close()
    log.info("stopped")


def serve(config: StageConfig, options: ServerOptions, slot_ttl_s: float = 600.0,
          metrics_port: int | None = None) -> None:
    asyncio.run(_serve(config, options, slot_ttl_s, metrics_port))
