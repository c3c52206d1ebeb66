"""The runner declaration Describe returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llm_runner_svc.models import Model
from llm_runner_svc.runtime import InferenceRuntime, SamplingDefaults
from llm_runner_svc.stage.config import RUNNER, StageConfig

CONTRACT_VERSION = "llmstage.v1"


@dataclass(frozen=True)
class PortDecl:
    name: str
    dtype: str | None  # "float32", ... ; None for text and tokens
    width: int


@dataclass(frozen=True)
class StageDescription:
    contract_version: str
    stage_id: str
    runner: str
    emits: tuple[PortDecl, ...]
    inputs: tuple[str, ...]
    max_batch: int
    max_seq: int
    max_step_window: int
    engine: str
    model: Model
    sampling: SamplingDefaults
    lora_adapters: tuple[str, ...] = ()  # names a request may give in `lora`
    max_loras: int = 0  # adapters resident at once


def describe(config: StageConfig, model: Model, runtime: InferenceRuntime,
             max_step_window: int, adapters: Sequence[str] | None = None) -> StageDescription:
    """`adapters`: the LoRA adapter names served now (default: config.lora_adapters)."""
    widths = {"text": 0, "tokens": 0, "hidden": model.config.hidden_size}
    dtypes = {"text": None, "tokens": "int32", "hidden": "float32"}
    ports = tuple(PortDecl(p, dtypes[p], widths[p]) for p in config.emits)
    return StageDescription(
        CONTRACT_VERSION, config.stage_id, RUNNER, ports, config.inputs, config.max_batch,
        runtime.max_seq, max_step_window, config.engine, model, config.sampling,
        tuple(adapters if adapters is not None else (n for n, _ in config.lora_adapters)),
        config.num_lora_slots)
