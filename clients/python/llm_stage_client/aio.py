"""The asyncio client of the orchestrator, over `grpc.aio`; the same API as `Client`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Unpack

import grpc
import grpc.aio

from llm_stage_client._contract.llmstage.v1 import orchestrator_pb2 as opb
from llm_stage_client._contract.llmstage.v1 import orchestrator_pb2_grpc
from llm_stage_client.client import CHANNEL_OPTIONS, DEFAULT_TARGET
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


class AsyncClient:
    """A `grpc.aio` connection to an orchestrator at `target` ("host:port").

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
    `timeout` (seconds) is the default deadline of every call; None means no deadline. Use
    `async with` or `await close()`. Every failed call raises `StageClientError`.
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout: float | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel; calls still running end with CANCELLED."""
        await self._channel.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> AsyncIterator[Delta | FinalReport]:
        """Streams one generation (`async for`): the sink ports' `Delta`s, then a `FinalReport`.

        Arguments as for `Client.generate`. Raises ValueError / TypeError at once for bad
        arguments, and StageClientError while iterating when the call fails. Closing the
        iterator (`aclose()`, `contextlib.aclosing`) cancels the call at once; one abandoned
        after a `break` is cancelled when the event loop finalizes it.
        """
        # A plain method returning the async generator, so bad arguments fail at the call.
        request = build_generate_request(prompt=prompt, **options)
        return self._stream(request, self._deadline(timeout))

    async def _stream(self, request: opb.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[Delta | FinalReport]:
        call = self._stub.Generate(request, timeout=timeout)
        try:
            async for event in call:
                item = event_from_pb(event)
                if item is not None:
                    yield item
        except grpc.RpcError as exc:
            log.debug("Generate on %s failed: %s", self.target, exc)
            raise error_from_rpc(exc) from exc
        finally:
            # A caller that stops reading must not leave the request running on every stage;
            # after a normal end this is a no-op.
            call.cancel()

    async def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                            **options: Unpack[GenerateOptions]) -> tuple[str, FinalReport]:
        """Runs one generation to its end: the text of all deltas joined, and the final report.

        Raises like `generate`, and StageClientError("UNKNOWN") if no final report came.
        """
        items = [item async for item in self.generate(prompt, timeout=timeout, **options)]
        return text_and_report(items)

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Asks the orchestrator to cancel a running request; False when none has that id.

        Raises StageClientError when the call fails.
        """
        try:
            answer = await self._stub.Cancel(opb.CancelGenerateRequest(request_id=request_id),
                                             timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return bool(answer.found)

    async def topology(self, *, timeout: float | None = None) -> dict[str, Any]:
        """What is deployed (see `Client.topology`). Raises StageClientError when the call
        fails."""
        try:
            answer = await self._stub.Topology(opb.TopologyRequest(),
                                               timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        return topology_from_pb(answer)
