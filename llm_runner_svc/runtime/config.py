"""Runtime configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime.sampling import SamplingDefaults


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch: int = 8  # requests decoding together (maxBatch)
    max_seq: int = 0  # positions per request, prompt included (maxSeq); 0 = min(model, 2048)
    page_size: int = 16  # tokens per KV page
    prefill_chunk: int = 256  # prompt tokens per engine forward
    max_waiting: int = 256  # requests queued for a free batch row before refusing
    hidden_layer: int | None = None  # accept_hidden_layer; None = no hidden-state capture
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    def __post_init__(self) -> None:
        for name in ("max_batch", "page_size", "prefill_chunk", "max_waiting"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_seq < 0:
            raise InvalidArgument(f"max_seq must be >= 0, got {self.max_seq}")

    def resolved_max_seq(self, model_max_position: int) -> int:
        if self.max_seq == 0:
            return min(model_max_position, 2048)
        if self.max_seq > model_max_position:
            raise InvalidArgument(
                f"max_seq {self.max_seq} exceeds the model's context of {model_max_position}")
        return self.max_seq
