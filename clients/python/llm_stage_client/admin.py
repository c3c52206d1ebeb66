"""Admin calls on one stage (`llmstage.v1.Stage`, not the orchestrator): load and unload
LoRA adapters. They carry `authorization: Bearer <token>` metadata, the token the stage was
started with (its LLM_RUNNER_ADMIN_TOKEN). Every failed call raises `StageClientError`
(PERMISSION_DENIED without the right token, INVALID_ARGUMENT for a malformed adapter,
FAILED_PRECONDITION for an adapter still in use, ...)."""

from __future__ import annotations

import grpc

from llm_stage_client._contract.llmstage.v1 import stage_pb2 as pb
from llm_stage_client._contract.llmstage.v1 import stage_pb2_grpc
from llm_stage_client.types import error_from_rpc

ADMIN_TOKEN_ENV = "LLM_RUNNER_ADMIN_TOKEN"


class StageAdmin:
    """A connection to one stage at `target` ("host:port") with its admin `token`."""

    def __init__(self, target: str, token: str | None, timeout: float | None = 60.0) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(target)
        self._stub = stage_pb2_grpc.StageStub(self._channel)

    def __enter__(self) -> StageAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def adapters(self) -> list[str]:
        """The LoRA adapters the stage serves now (Describe; no token needed)."""
        try:
            return list(self._stub.Describe(pb.DescribeRequest(),
                                            timeout=self.timeout).lora_adapters)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def load_adapter(self, name: str, path: str) -> list[str]:
        """Load the PEFT adapter directory `path` (relative to the stage's artifact) as
        `name`; returns the adapters served afterwards."""
        try:
            return list(self._stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=path),
                                               timeout=self.timeout,
                                               metadata=self._metadata).lora_adapters)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def unload_adapter(self, name: str) -> list[str]:
        """Unload `name`; returns the adapters served afterwards."""
        try:
            return list(self._stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name),
                                                 timeout=self.timeout,
                                                 metadata=self._metadata).lora_adapters)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
