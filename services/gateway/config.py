"""The gateway's settings; its command line's defaults are these fields'."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class GatewayConfig:
    orchestrator: str = "127.0.0.1:50050"  # host:port of the Orchestrator API
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    request_timeout_s: float | None = 600.0  # each Generate's deadline; None: none
    max_body_bytes: int = 16 * MiB  # larger request bodies are 413
    # gRPC channels to the orchestrator, each its own connection, calls dealt round robin: one
    # HTTP/2 connection sticks to one orchestrator worker (or replica behind a Service).
    num_channels: int = 4
    is_port_shared: bool = False  # SO_REUSEPORT: one of several workers (services/workers.py)
    # The name the first text model is served under instead of its stage id (e.g. the Hugging
    # Face repo id its tokenizer loads by); None: the stage id.
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if ":" not in self.orchestrator:
            raise ValueError(f"orchestrator must be host:port, got {self.orchestrator!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.num_channels < 1:
            raise ValueError(f"num_channels must be >= 1, got {self.num_channels}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
