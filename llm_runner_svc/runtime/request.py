"""A generation request, its finish reasons and metrics, and the runtime's per-request state."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from llm_runner_svc.engines.base import HiddenStates, SampleSpec
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.tokenizer import StreamDecoder
from llm_runner_svc.runtime.sampling import SamplingParams
from llm_runner_svc.runtime.stops import StopMatcher
from services.stage.ending import FinishReason  # the contract's reasons, shared with stages

__all__ = ["FinishReason", "GenerationRequest", "RequestMetrics", "SequenceState", "StepEvent"]


@dataclass(frozen=True)
class GenerationRequest:
    """What a caller asks of the runtime. Tokenization happened before (see `prompt_ids`)."""

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    stop: Sequence[str] = ()
    capture_hidden: bool = False
    ignore_eos: bool = False
    label: str = ""  # the caller's own name for the request (a stage: its client's id)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidArgument("request_id must not be empty")
        if len(self.prompt_ids) == 0:
            raise InvalidArgument("prompt is empty: at least one token is required")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode rate: tokens after the first over the time spent producing them."""
        if self.generated_tokens <= 1 or self.decode_ms <= 0:
            return 0.0
        return (self.generated_tokens - 1) / (self.decode_ms / 1000.0)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "queue_ms": round(self.queue_ms, 3), "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3), "ttft_ms": round(self.ttft_ms, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


@dataclass
class StepEvent:
    """What one step did for one request: new tokens, new text, and whether it ended."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    hidden: list[HiddenStates] = field(default_factory=list)


class SequenceState:
    """Mutable state of one admitted request inside the runtime."""

    def __init__(self, req: GenerationRequest, decoder: StreamDecoder, stops: StopMatcher) -> None:
        self.req = req
        self.decoder = decoder
        self.stops = stops
        self.pages: list[int] = []
        self.output_ids: list[int] = []
        self.next_position = 0  # KV positions written so far
        self.last_token = -1  # the token to feed at next_position
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(req.prompt_ids))
        self.t_submit = time.perf_counter()
        self.t_first_token = 0.0
        self.greedy_spec: SampleSpec | None = None  # set by the first greedy pick

    def latch(self, reason: FinishReason, error: str | None = None) -> bool:
        """Record why the request ends; only the first reason sticks."""
        if self.finish_reason is not None:
            return False
        self.finish_reason = reason
        self.error = error
        return True
