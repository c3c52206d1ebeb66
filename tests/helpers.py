"""Helpers shared by test modules (importable because tests/ is on sys.path via conftest)."""

from __future__ import annotations

import os
from typing import Any

from llm_runner_svc.engines import create_engine, engine_class
from llm_runner_svc.models import Model
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve

# The engine the runtime and stage tests run on; CI runs them again with LLM_TEST_ENGINE=onnx.
TEST_ENGINE = os.environ.get("LLM_TEST_ENGINE", "numpy")
# whether it gives prompt log-probabilities (the graph engines' graphs keep last logits only)
TEST_ENGINE_SCORES = engine_class(TEST_ENGINE).supports_scores


def make_runtime(model: Model, **cfg) -> InferenceRuntime:
    """A preallocated runtime over the test engine (numpy unless LLM_TEST_ENGINE names
    another); the caller closes it."""
    rt = InferenceRuntime(create_engine(TEST_ENGINE, model.config, model.weights),
                          model.tokenizer, RuntimeConfig(**cfg))
    rt.preallocate()
    return rt


def solo(stories: Model, spec: dict) -> tuple[list[int], str, str]:
    """Tokens, text and finish reason of `spec` run alone in-process."""
    spec = dict(spec)
    text, ids = spec.pop("text", None), spec.pop("token_ids", None)
    if ids is None:
        ids = stories.tokenizer.encode(text, add_bos=stories.tokenizer.default_add_bos())
    stop = tuple(spec.pop("stop", ()))
    max_tokens = spec.pop("max_tokens")
    ignore_eos = spec.pop("ignore_eos", False)
    rt = make_runtime(stories, max_batch=1, max_seq=512)
    try:
        req = GenerationRequest("solo", ids, resolve(rt.config.sampling, max_new_tokens=max_tokens,
                                                     **spec), stop=stop, ignore_eos=ignore_eos)
        tokens, out, reason = [], "", None
        for ev in rt.generate(req):
            tokens += ev.token_ids
            out += ev.text
            reason = ev.finish_reason
        return tokens, out, reason.value
    finally:
        rt.close()


def drain(rt: InferenceRuntime) -> dict[str, list[int]]:
    """Step `rt` until it is idle; return each request's generated token ids."""
    return drain_with_metrics(rt)[0]


def drain_with_metrics(rt: InferenceRuntime) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Step `rt` until it is idle; each request's generated token ids and the last metrics
    its events carried."""
    got: dict[str, list[int]] = {}
    metrics: dict[str, Any] = {}
    while rt.has_work:
        for ev in rt.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.metrics is not None:
                metrics[ev.request_id] = ev.metrics
    return got, metrics
