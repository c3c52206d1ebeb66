"""Fault injection for reliability tests: off unless the environment variable
`LLM_RUNNER_FAULTS` holds a JSON object when the stage starts.

    LLM_RUNNER_FAULTS='{"step_delay_ms": 50}'                 every decode step sleeps 50 ms
    LLM_RUNNER_FAULTS='{"step_delay_ms": 50, "slow_prefix": "slow"}'
        only steps that run a request whose id starts with "slow" sleep
    LLM_RUNNER_FAULTS='{"error_prefix": "boom", "error_after_tokens": 2}'
        a request whose id starts with "boom" ends with finish reason ERROR once it has
        streamed 2 tokens, through the same path as any per-request failure of a step

The faults act inside `InferenceRuntime.step`, so everything above the runtime (slots,
cohorts, hidden port, Finish) sees them as it would see a slow engine or a failing request.
An unknown key or a bad value stops the stage at start; nothing is read later.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llm_runner_svc.engines.base import Engine
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.tokenizer import Tokenizer
from llm_runner_svc.runtime import (
    FinishReason,
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    StepEvent,
)

ENV = "LLM_RUNNER_FAULTS"
INJECTED_ERROR = "injected fault: the request failed on purpose"


@dataclass(frozen=True)
class Faults:
    step_delay_ms: float = 0.0  # added to every decode step (or those of slow requests)
    slow_prefix: str = ""  # "" = every step is slow; else only steps running such requests
    error_prefix: str = ""  # requests whose id starts with this fail ("" = none)
    error_after_tokens: int = 1  # ... after streaming this many tokens

    def __post_init__(self) -> None:
        if self.step_delay_ms < 0 or self.error_after_tokens < 0:
            raise InvalidArgument(f"{ENV}: step_delay_ms and error_after_tokens must be >= 0")


def faults_from_env(environ: Mapping[str, str] | None = None) -> Faults | None:
    """The faults the environment asks for, or None when the variable is unset or empty."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{ENV}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise InvalidArgument(f"{ENV}: must be a JSON object")
    unknown = sorted(set(doc) - set(Faults.__dataclass_fields__))
    if unknown:
        raise InvalidArgument(f"{ENV}: unknown key {unknown[0]!r} (valid: "
                              f"{sorted(Faults.__dataclass_fields__)})")
    try:
        return Faults(**doc)
    except TypeError as exc:
        raise InvalidArgument(f"{ENV}: {exc}") from exc


class FaultyRuntime(InferenceRuntime):
    """The runtime with `faults` applied to each step. Which requests fail or slow the steps
    is read from the caller's request id the stage puts in each request's `label`."""

    def __init__(self, faults: Faults, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults
        self._marked: dict[str, int] = {}  # runtime id -> tokens streamed so far
        self._doomed: set[str] = set()  # cancelled by us: their end becomes ERROR
        self._slow: set[str] = set()  # runtime ids of live slow requests

    def submit(self, req: GenerationRequest) -> None:
        """Decide, by the caller's request id (`label`), whether `req` fails or slows the
        steps, then queue it."""
        f = self.faults
        if f.error_prefix and req.label.startswith(f.error_prefix):
            self._marked[req.request_id] = 0
        if f.slow_prefix and req.label.startswith(f.slow_prefix):
            self._slow.add(req.request_id)
        super().submit(req)

    def step(self, held: frozenset[str] = frozenset()) -> list[StepEvent]:
        if self.faults.step_delay_ms and (self._slow or not self.faults.slow_prefix):
            time.sleep(self.faults.step_delay_ms / 1000.0)
        return self._apply(super().step(held))

    def apply_cancels(self) -> list[StepEvent]:
        return self._apply(super().apply_cancels())

    def _apply(self, events: list[StepEvent]) -> list[StepEvent]:
        for ev in events:
            if ev.request_id in self._marked:
                self._inject_error(ev)
            if ev.finish_reason is not None:
                self._slow.discard(ev.request_id)
        return events

    def _inject_error(self, ev: StepEvent) -> None:
        rid = ev.request_id
        if ev.finish_reason is not None:
            del self._marked[rid]
            if rid in self._doomed:
                self._doomed.discard(rid)
                ev.finish_reason, ev.error = FinishReason.ERROR, INJECTED_ERROR
            return
        self._marked[rid] += len(ev.token_ids)
        if self._marked[rid] >= self.faults.error_after_tokens and rid not in self._doomed:
            self._doomed.add(rid)
            self.cancel(rid)  # lands at the top of the next step; its end is rewritten above


def faulty_runtime_factory(faults: Faults) -> Callable[..., InferenceRuntime]:
    """A RuntimeFactory whose runtimes apply `faults` (for in-process tests)."""
    def create(engine: Engine, tokenizer: Tokenizer, config: RuntimeConfig,
               draft: Engine | None = None) -> InferenceRuntime:
        return FaultyRuntime(faults, engine, tokenizer, config, draft)
    return create


def runtime_factory_from_env(environ: Mapping[str, str] | None = None
                             ) -> Callable[..., InferenceRuntime]:
    """The plain runtime, or the faulty one when LLM_RUNNER_FAULTS asks for it (processes
    started by the reliability suite)."""
    faults = faults_from_env(environ)
    return InferenceRuntime if faults is None else faulty_runtime_factory(faults)
