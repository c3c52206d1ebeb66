"""The Stage servicer: decode the proto, call one LlmStage method, encode the answer.

Errors are typed exceptions; the server's interceptor maps them to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from llm_runner_svc import codec
from llm_runner_svc.errors import InvalidArgument, RunnerError
from llm_runner_svc.stage import LlmStage
from llm_runner_svc.stage.slots import check_slot_id
from llm_runner_svc.stage.stepping import Cohort
from llm_runner_svc.stage.tracing import call_span
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.telemetry import context_from

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Stage"].full_name


def _call_ctx(context: grpc.aio.ServicerContext) -> Any:
    """The caller's trace context from the call's metadata (None when it sent none)."""
    return context_from(metadata=context.invocation_metadata() or ())


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, stage: LlmStage) -> None:
        self.stage = stage

    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
                       ) -> pb.DescribeResponse:
        return codec.describe_to_pb(self.stage.describe())

    async def Admit(self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AdmitResponse:
        check_slot_id(request.slot_id)
        if not request.HasField("request"):
            raise InvalidArgument("AdmitRequest.request is required")
        req = codec.request_from_pb(request.slot_id, request.request)
        return codec.admission_to_pb(self.stage.admit(
            request.slot_id, req, _call_ctx(context), context_from(request.traceparent)))

    async def Prepare(self, request: pb.PrepareRequest, context: grpc.aio.ServicerContext
                      ) -> pb.PrepareResponse:
        return codec.prepared_to_pb(self.stage.prepare(request.slot_id, _call_ctx(context)))

    async def Step(self, request_iterator: AsyncIterator[pb.StepRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepEvent]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            raise InvalidArgument("Step needs a first message joining at least one slot")
        if not first.join:
            raise InvalidArgument("the first Step message must join at least one slot")
        for sid in first.join:
            check_slot_id(sid)
        cohort = self.stage.open_cohort(list(first.join), first.credits)
        reader = asyncio.create_task(self._read_controls(request_iterator, cohort))
        is_complete = False
        try:
            async for event in cohort.events():
                yield codec.event_to_pb(event)
            is_complete = True
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.stage.close_cohort(cohort, is_broken=not is_complete)

    async def _read_controls(self, request_iterator: AsyncIterator[pb.StepRequest],
                             cohort: Cohort) -> None:
        """Later Step messages: joins and credits. A malformed one fails the stream."""
        try:
            async for msg in request_iterator:
                if any(sid < 0 for sid in msg.join):
                    raise InvalidArgument("join holds a negative slot id")
                if msg.credits:
                    cohort.grant(msg.credits)
                if msg.join:
                    self.stage.join(cohort, list(msg.join))
        except RunnerError as exc:
            cohort.fail(exc)
            return
        except grpc.aio.AioRpcError:
            return  # the stream broke; the handler's finally cleans up
        cohort.client_done()

    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext
                     ) -> pb.FinishResponse:
        reason = codec.reason_from_pb(request.reason)
        return codec.finished_to_pb(await self.stage.finish(request.slot_id, reason,
                                                            _call_ctx(context)))

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext
                    ) -> pb.ResetResponse:
        return pb.ResetResponse(existed=self.stage.reset(request.slot_id))

    async def Diagnostics(self, request: pb.DiagnosticsRequest,
                          context: grpc.aio.ServicerContext) -> pb.DiagnosticsResponse:
        slot_id = request.slot_id if request.HasField("slot_id") else None
        return pb.DiagnosticsResponse(values=codec.struct_from(self.stage.diagnostics(slot_id)))

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext
                     ) -> pb.CancelResponse:
        state, was_running = self.stage.cancel(request.slot_id)
        return pb.CancelResponse(state=codec.state_to_pb(state), was_running=was_running)

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.SubscribeEvent]:
        target = request.WhichOneof("target")
        if target is None or (target == "all_requests" and not request.all_requests):
            raise InvalidArgument("Subscribe needs a request_id or all_requests = true")
        request_id = request.request_id if target == "request_id" else None
        if request.transport not in (pb.TRANSPORT_UNSPECIFIED, pb.TRANSPORT_GRPC_BYTES,
                                     pb.TRANSPORT_SHARED_MEMORY):
            raise InvalidArgument(f"transport {request.transport} is not a Transport value")
        sub = await self.stage.subscribe(request_id, request.port,
                                         request.transport == pb.TRANSPORT_SHARED_MEMORY)
        # One span for the life of the subscription, under the subscriber's call context.
        span = call_span("subscribe", _call_ctx(context), self.stage.config.stage_id, -1,
                         request_id or "")
        try:
            yield pb.SubscribeEvent(subscribed=pb.Subscribed())  # registered: nothing is missed
            while (msg := await sub.get()) is not None:
                yield codec.port_message_to_pb(msg)
        finally:
            self.stage.unsubscribe(sub)
            span.end()
