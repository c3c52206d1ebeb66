"""Runtime configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.runtime.sampling import SamplingDefaults
from llm_runner_svc.runtime.speculative import SpecConfig


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch: int = 8  # requests decoding together (maxBatch)
    max_seq: int = 0  # positions per request, prompt included (maxSeq); 0 = min(model, 2048)
    page_size: int = 16  # tokens per KV page
    prefill_chunk: int = 256  # tokens per engine pass (a longer step runs in several)
    max_tokens_per_step: int = 0  # decode rows + prefill chunks in one step
    # (maxTokensPerStep); 0 = the engine's default; at least max_batch
    kv_memory_bytes: int = 0  # KV pool on the host; 0 = max_batch requests of max_seq
    kv_memory_fraction: float = 0.0  # KV pool on a device: this share of the memory free
    # after the weights (kvMemoryFraction); 0 = sized by kv_memory_bytes
    max_waiting: int = 256  # requests queued for a free batch row before refusing
    hidden_layer: int | None = None  # accept_hidden_layer; None = no hidden-state capture
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    prefix_cache: bool = False  # reuse the KV of cached prefixes (context_cache.enable_reuse)
    prefix_cache_records: int = 0  # pages the cache names at most; 0 = only the pool bounds
    prefix_cache_snapshots: int = 0  # named pages keeping their captured states; 0 = none
    spec: SpecConfig | None = None  # speculative decoding (spec_decode); None = plain decode

    def __post_init__(self) -> None:
        for name in ("max_batch", "page_size", "prefill_chunk", "max_waiting"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_seq", "max_tokens_per_step", "kv_memory_bytes",
                     "prefix_cache_records", "prefix_cache_snapshots"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.kv_memory_fraction < 1.0:
            raise InvalidArgument(
                f"kv_memory_fraction must be in [0, 1), got {self.kv_memory_fraction}")

    def step_tokens(self, engine_default: int) -> int:
        """Tokens per step: the configured budget or the engine's, never below max_batch
        (every decode row fits)."""
        return max(self.max_tokens_per_step or engine_default, self.max_batch)

    def resolved_max_seq(self, model_max_position: int) -> int:
        if self.max_seq == 0:
            return min(model_max_position, 2048)
        if self.max_seq > model_max_position:
            raise InvalidArgument(
                f"max_seq {self.max_seq} exceeds the model's context of {model_max_position}")
        return self.max_seq
