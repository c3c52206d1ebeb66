"""Helpers shared by test modules (importable because tests/ is on sys.path via conftest)."""

from __future__ import annotations

from llm_runner_svc.engines import create_engine
from llm_runner_svc.models import Model
from llm_runner_svc.runtime import InferenceRuntime, RuntimeConfig


def make_runtime(model: Model, **cfg) -> InferenceRuntime:
    """A preallocated runtime over the numpy engine; the caller closes it."""
    rt = InferenceRuntime(create_engine("numpy", model.config, model.weights), model.tokenizer,
                          RuntimeConfig(**cfg))
    rt.preallocate()
    return rt
