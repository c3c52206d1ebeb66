"""Client library for the llm-runner-svc orchestrator.

`Client` (sync) and `AsyncClient` (asyncio) call `llmstage.v1.Orchestrator`; a generation
streams `Delta`s (with `TokenLogprob`s when asked) and ends with one `FinalReport`; every failed
call raises `StageClientError`.
"""

from llm_stage_client.aio import AsyncClient
from llm_stage_client.client import DEFAULT_TARGET, Client
from llm_stage_client.controls import TokenLogprob
from llm_stage_client.types import Delta, FinalReport, GenerateOptions, StageClientError

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "Client",
    "Delta",
    "FinalReport",
    "GenerateOptions",
    "StageClientError",
    "TokenLogprob",
]
