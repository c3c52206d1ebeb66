"""The inference runtime: decode loop, KV pages, sampling settings, request lifecycle."""

from llm_runner_svc.runtime.config import RuntimeConfig
from llm_runner_svc.runtime.request import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    StepEvent,
)
from llm_runner_svc.runtime.runtime import InferenceRuntime
from llm_runner_svc.runtime.sampling import SamplingDefaults, SamplingParams, resolve
from llm_runner_svc.runtime.speculative import SpecConfig

__all__ = [
    "FinishReason", "GenerationRequest", "InferenceRuntime", "RequestMetrics", "RuntimeConfig",
    "SamplingDefaults", "SamplingParams", "SpecConfig", "StepEvent", "resolve",
]
