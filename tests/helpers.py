"""Helpers shared by test modules (importable because tests/ is on sys.path via conftest)."""

from __future__ import annotations

from llm_runner_svc.engines import create_engine
from llm_runner_svc.models import Model
from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime, RuntimeConfig, resolve


def make_runtime(model: Model, **cfg) -> InferenceRuntime:
    """A preallocated runtime over the numpy engine; the caller closes it."""
    rt = InferenceRuntime(create_engine("numpy", model.config, model.weights), model.tokenizer,
                          RuntimeConfig(**cfg))
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
