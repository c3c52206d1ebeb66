"""The synchronous client of the orchestrator (`llmstage.v1.Orchestrator`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Unpack

import grpc

from llm_stage_client._contract.llmstage.v1 import orchestrator_pb2 as opb
from llm_stage_client._contract.llmstage.v1 import orchestrator_pb2_grpc
from llm_stage_client.types import (
    Delta,
    FinalReport,
    GenerateOptions,
    build_generate_request,
    error_from_rpc,
    event_from_pb,
    text_and_report,
    topology_from_pb,
)

log = logging.getLogger(__name__)

DEFAULT_TARGET = "127.0.0.1:50050"
# Diagnostics of a long multi-stage request can outgrow gRPC's 4 MiB default.
_MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)]


class Client:
    """A connection to an orchestrator at `target` ("host:port").

    `timeout` (seconds) is the default deadline of every call; None means no deadline. Use it as
    a context manager or call `close()`. Every failed call raises `StageClientError`.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel; calls still running end with CANCELLED."""
        self._channel.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> Iterator[Delta | FinalReport]:
        """Streams one generation: the sink ports' `Delta`s as they come, then one `FinalReport`.

        Give exactly one of `prompt`, `token_ids=` or `messages=`; see `GenerateOptions` for the
        rest. `timeout` (seconds) overrides the client's default and bounds the whole request.
        Raises ValueError / TypeError at once for bad arguments, and StageClientError while
        iterating when the call fails. Stopping the iteration early cancels the call.
        """
        request = build_generate_request(prompt=prompt, **options)
        return self._stream(request, self._deadline(timeout))

    def _stream(self, request: opb.GenerateRequest,
                timeout: float | None) -> Iterator[Delta | FinalReport]:
        call = self._stub.Generate(request, timeout=timeout)
        try:
            for event in call:
                item = event_from_pb(event)
                if item is not None:
                    yield item
        except grpc.RpcError as exc:
            log.debug("Generate on %s failed: %s", self.target, exc)
            raise error_from_rpc(exc) from exc
        finally:
            # A caller that stops reading (break, exception, garbage collection) must not leave
            # the request running on every stage; after a normal end this is a no-op.
            call.cancel()

    def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                      **options: Unpack[GenerateOptions]) -> tuple[str, FinalReport]:
        """Runs one generation to its end: the text of all deltas joined, and the final report.

        With several sinks their texts interleave in arrival order (pass `sinks=` to pick one).
        Raises like `generate`, and StageClientError("UNKNOWN") if no final report came.
        """
        return text_and_report(list(self.generate(prompt, timeout=timeout, **options)))

    def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Asks the orchestrator to cancel a running request; False when none has that id.

        Raises StageClientError when the call fails.
        """
        try:
            answer = self._stub.Cancel(opb.CancelGenerateRequest(request_id=request_id),
                                       timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return bool(answer.found)

    def topology(self, *, timeout: float | None = None) -> dict[str, Any]:
        """What is deployed: stages with replicas, sinks, default sinks, queue limits and load,
        with the proto's field names. Raises StageClientError when the call fails."""
        try:
            answer = self._stub.Topology(opb.TopologyRequest(), timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return topology_from_pb(answer)
