"""The generic half of a Stage servicer: Prepare, Step, Cancel, Finish, Diagnostics, Reset
over a `StageCore`. A stage's servicer subclasses it, adds Describe, Admit and Subscribe, and
encodes its own Prepare and Finish answers. Translation only: decode, call, encode.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.errors import InvalidArgument, ServiceError
from services.stage import codec
from services.stage.cohort import Cohort
from services.stage.core import StageCore
from services.stage.slot import Slot
from services.stage.slot_machine import check_slot_id
from services.telemetry import context_from


def call_ctx(context: grpc.aio.ServicerContext) -> Any:
    """The caller's trace context from the call's metadata (None when it sent none)."""
    return context_from(metadata=context.invocation_metadata() or ())


class StageServicerBase(stage_pb2_grpc.StageServicer):
    def __init__(self, stage: StageCore) -> None:
        self.core = stage

    # ---- what a stage's servicer supplies ----------------------------------------------
    def prepared_to_pb(self, slot: Slot) -> pb.PrepareResponse:
        return pb.PrepareResponse()

    def finished_to_pb(self, slot: Slot) -> pb.FinishResponse:
        return pb.FinishResponse(slot_id=slot.slot_id,
                                 finish_reason=codec.reason_to_pb(slot.run.ended),
                                 error=slot.run.error or "")

    # ---- the contract ------------------------------------------------------------------
    async def Prepare(self, request: pb.PrepareRequest, context: grpc.aio.ServicerContext
                      ) -> pb.PrepareResponse:
        return self.prepared_to_pb(self.core.prepare(request.slot_id, call_ctx(context)))

    async def Step(self, request_iterator: AsyncIterator[pb.StepRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepEvent]:
        first = await anext(aiter(request_iterator), None)
        if first is None:
            raise InvalidArgument("Step needs a first message joining at least one slot")
        if not first.join:
            raise InvalidArgument("the first Step message must join at least one slot")
        for sid in first.join:
            check_slot_id(sid)
        cohort = self.core.open_cohort(list(first.join), first.credits,
                                       codec.member_credits_from_pb(first))
        reader = asyncio.create_task(self._read_controls(request_iterator, cohort, context))
        is_complete = False
        try:
            async for event in cohort.events():
                yield codec.event_to_pb(event)
            is_complete = True
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            # A client that cancels may end the reads as a half-close would: its stream is
            # broken all the same, so members still running are cancelled (ended ones stay).
            self.core.close_cohort(cohort, is_broken=not is_complete or context.cancelled())

    async def _read_controls(self, request_iterator: AsyncIterator[pb.StepRequest],
                             cohort: Cohort, context: grpc.aio.ServicerContext) -> None:
        """Later Step messages: joins and credits. A malformed one fails the stream."""
        try:
            async for msg in request_iterator:
                if any(sid < 0 for sid in msg.join):
                    raise InvalidArgument("join holds a negative slot id")
                if msg.join:
                    self.core.join(cohort, list(msg.join))
                self.core.grant(cohort, msg.credits, codec.member_credits_from_pb(msg))
        except grpc.aio.AioRpcError:
            return  # the stream broke; the handler's finally cleans up
        except ServiceError as exc:
            cohort.fail(exc)
            return
        if context.cancelled():
            return  # not a half-close: the handler's finally cleans up as after a break
        cohort.client_done()

    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext
                     ) -> pb.FinishResponse:
        reason = codec.reason_from_pb(request.reason)
        return self.finished_to_pb(await self.core.finish(request.slot_id, reason,
                                                          call_ctx(context)))

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext
                    ) -> pb.ResetResponse:
        return pb.ResetResponse(existed=self.core.reset(request.slot_id))

    async def Diagnostics(self, request: pb.DiagnosticsRequest,
                          context: grpc.aio.ServicerContext) -> pb.DiagnosticsResponse:
        values = self.core.slot_diagnostics(request.slot_id) if request.HasField("slot_id") \
            else self.core.stage_diagnostics()
        return pb.DiagnosticsResponse(values=codec.struct_from(values))

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext
                     ) -> pb.CancelResponse:
        state, was_running = self.core.cancel(request.slot_id)
        return pb.CancelResponse(state=codec.state_to_pb(state), was_running=was_running)
