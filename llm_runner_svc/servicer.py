"""The Stage servicer: decode the proto, call one LlmStage method, encode the answer.

The slot calls (Prepare, Step, Cancel, Finish, Diagnostics, Reset) come from the stage kit's
generic servicer; this one adds Describe, Admit and Subscribe and encodes the LLM's own
Prepare and Finish answers. Errors are typed exceptions; the server's interceptor maps them
to status codes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from llm_runner_svc import codec
from llm_runner_svc.admin import check_admin
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.stage import LlmStage
from llm_runner_svc.stage.tracing import call_span
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.stage.servicer import StageServicerBase, call_ctx
from services.stage.slot import Slot
from services.stage.slot_machine import check_slot_id
from services.telemetry import context_from

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Stage"].full_name


class StageServicer(StageServicerBase):
    def __init__(self, stage: LlmStage, admin_token: str | None = None) -> None:
        """`admin_token`: what admin calls must carry (llm_runner_svc/admin.py); None: the
        admin calls are refused."""
        super().__init__(stage)
        self.stage = stage
        self._admin_token = admin_token

    def prepared_to_pb(self, slot: Slot) -> pb.PrepareResponse:
        return codec.prepared_to_pb(slot)

    def finished_to_pb(self, slot: Slot) -> pb.FinishResponse:
        return codec.finished_to_pb(slot)

    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
                       ) -> pb.DescribeResponse:
        return codec.describe_to_pb(self.stage.describe())

    async def Admit(self, request: pb.AdmitRequest, context: grpc.aio.ServicerContext
                    ) -> pb.AdmitResponse:
        check_slot_id(request.slot_id)
        if not request.HasField("request"):
            raise InvalidArgument("AdmitRequest.request is required")
        early = self.stage.refuse_oversized(request.slot_id,
                                            codec.request_sizes(request.request))
        if early is not None:  # refused before paying to convert what it carries
            return codec.admission_to_pb(early)
        req = codec.request_from_pb(request.slot_id, request.request)
        return codec.admission_to_pb(await self.stage.admit(
            request.slot_id, req, call_ctx(context), context_from(request.traceparent)))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> pb.TokenizeResponse:
        prompt = request.request
        is_empty_text = prompt.WhichOneof("prompt") == "text" and not prompt.text
        req = None if is_empty_text else codec.request_from_pb(0, prompt)
        add = (request.add_special_tokens if request.HasField("add_special_tokens")
               else True)
        return codec.tokenized_to_pb(await self.stage.tokenize(req, add))

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        return pb.DetokenizeResponse(text=self.stage.detokenize(list(request.token_ids)))

    async def LoadAdapter(self, request: pb.LoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> pb.LoadAdapterResponse:
        check_admin(self._admin_token, context.invocation_metadata(), "LoadAdapter")
        names = await self.stage.load_adapter(request.name, request.path)
        return pb.LoadAdapterResponse(lora_adapters=names)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> pb.UnloadAdapterResponse:
        check_admin(self._admin_token, context.invocation_metadata(), "UnloadAdapter")
        return pb.UnloadAdapterResponse(lora_adapters=self.stage.unload_adapter(request.name))

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
        span = call_span("subscribe", call_ctx(context), self.stage.config.stage_id, -1,
                         request_id or "")
        try:
            yield pb.SubscribeEvent(subscribed=pb.Subscribed())  # registered: nothing is missed
            while (msg := await sub.get()) is not None:
                yield codec.port_message_to_pb(msg)
        finally:
            self.stage.unsubscribe(sub)
            span.end()
