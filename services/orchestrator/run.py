"""One request's run through its route: Admit on every active stage in route order, Prepare,
join each stage's cohort, stream the sink ports, then Finish, Diagnostics and Reset everywhere.

Any ending (success, refusal, failure, cancel, deadline, client gone) leaves no slot behind:
`cleanup()` finishes and resets whatever was admitted, and the caller runs it on every path
that does not end in `_finish_all`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    error_for,
)
from services.orchestrator.codec import (
    Delta,
    Event,
    FinalReport,
    FinishReason,
    Usage,
    finish_reason_from_pb,
    finish_reason_to_pb,
)
from services.orchestrator.cohorts import CohortStream
from services.orchestrator.replicas import Replica
from services.orchestrator.routes import Route
from services.orchestrator.updates import Item, Scores, UpdateBuffer
from services.telemetry import metadata_for, traceparent

log = logging.getLogger(__name__)

_tracer = trace.get_tracer("llmstage.orchestrator")
CONTROL_TIMEOUT_S = 30.0  # a single control call when the caller set no deadline
MAX_TOKENS_PER_DELTA = 256  # the most a lagging caller's delta gathers
# A relay whose event loop is behind: an update that waited longer than this before its
# request took it. Every delta is a message, a send and a few wakeups, and a loop that sends
# one delta per update for every member of every step never catches up (it reads one stage
# event per turn of the loop, so updates never pile up to be gathered). A request that sees
# its update waited that long waits as long again, at most PACING_MAX_S, and sends what
# arrived meanwhile as one delta: fewer, larger deltas until the loop catches up.
PACING_LAG_S = 0.001
PACING_MAX_S = 0.01


@dataclass
class Placement:
    """Where one stage of the route runs this request."""

    stage_id: str
    replica: Replica
    slot_id: int
    ports: tuple[str, ...] = ()  # ports this stage must produce for the route
    inputs: tuple[tuple[str, str], ...] = ()  # (input "stage:port", upstream stage id)
    admit_call: asyncio.Task[Any] | None = None  # Admit, once sent; outlives a cancel
    stream: CohortStream | None = None  # the Step stream it joined
    is_ended: bool = False
    is_released: bool = False
    finish: pb.FinishResponse | None = None
    diagnostics: dict[str, Any] = field(default_factory=dict)


class RequestRun:
    def __init__(self, request_id: str, request: pb.GenerationRequest, route: Route,
                 placements: list[Placement], deadline: float | None,
                 trace_ctx: otel_context.Context | None = None) -> None:
        self.request_id = request_id
        self.request = request
        self.route = route
        self.placements = placements
        self.deadline = deadline  # event-loop time, None = no deadline
        self.is_cancelled = False
        self.trace_ctx = trace_ctx  # the request's root span: parent of every stage call
        self.has_first_token = False
        # Log-probabilities to relay: looked at per delta only when the caller asked for them.
        self.wants_scores = request.HasField("logprobs") or request.HasField("prompt_logprobs")
        # Bounded by each stage's member window (cohorts.MEMBER_WINDOW) plus its ending.
        self._updates = UpdateBuffer()
        self._by_stage = {p.stage_id: p for p in placements}

    # ---- the happy path ----------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """Deltas of the sink ports, then the final report. The member credits of the
        updates a delta carries go back to their stage when the caller asks for the next
        event (this generator resumes), of other updates when nothing is left to read."""
        sink_ports = {s.split(":", 1)[0]: s.split(":", 1)[1] for s in reversed(self.route.sinks)}
        by_stage = {p.stage_id: p for p in self.placements}
        for p in self.placements:
            request = pb.GenerationRequest()
            request.CopyFrom(self.request)
            request.request_id = self.request_id
            request.ClearField("ports")
            request.ports.extend(p.ports)
            # Admit runs as its own task with its own timeout: a cancel or deadline that lands
            # while it is in flight stops the wait, not the call, so cleanup learns whether
            # the stage admitted the slot and frees it.
            p.admit_call = asyncio.get_running_loop().create_task(self._call(
                p, p.replica.stub.Admit, pb.AdmitRequest(
                    slot_id=p.slot_id, request=request,
                    traceparent=traceparent(self.trace_ctx)), CONTROL_TIMEOUT_S))
            ans = await self._await_admit(p.admit_call)
            if not ans.admitted:
                kind = ResourceExhausted if ans.refusal == pb.REFUSAL_NO_CAPACITY \
                    else InvalidArgument
                raise kind(f"stage {p.stage_id} refused the request "
                           f"({pb.Refusal.Name(ans.refusal)}): {ans.reason}")
            if self.is_cancelled:
                return
        for p in self.placements:
            bindings = [pb.InputBinding(input=inp, endpoint=by_stage[up].replica.endpoint,
                                        request_id=self.request_id) for inp, up in p.inputs]
            await self._call(p, p.replica.stub.Prepare,
                             pb.PrepareRequest(slot_id=p.slot_id, inputs=bindings))
        if self.is_cancelled:
            return
        for p in self.placements:
            p.stream = p.replica.cohort(self.route.fingerprint)
            p.stream.join(p.slot_id, self._updates)
        while not all(p.is_ended for p in self.placements):
            stage_id, item = await self._next_update()
            if isinstance(item, ServiceError):
                raise item
            if item.status == pb.MEMBER_STATUS_ENDED:
                by_stage[stage_id].is_ended = True
            if stage_id in sink_ports and (item.token_ids or item.text or item.prompt_logprobs):
                # (prompt log-probabilities come alone when the first pick ends the request)
                if not self.has_first_token:
                    self.has_first_token = True
                    trace.get_current_span(self.trace_ctx).add_event(
                        "first_token", {"llmstage.stage_id": stage_id})
                elif self._updates.head_wait_s > PACING_LAG_S:  # never the first token
                    await asyncio.sleep(min(self._updates.head_wait_s, PACING_MAX_S))
                scores = Scores.of(item) if self.wants_scores else None
                token_ids, text = self._coalesce(stage_id, list(item.token_ids), item.text,
                                                 scores)
                port = sink_ports[stage_id]
                yield Delta(stage_id, port, token_ids, text) if scores is None else \
                    Delta(stage_id, port, token_ids, text, scores.logprobs,
                          scores.prompt_logprobs)
                self._return_credits()
        yield await self._finish_all()

    def cancel(self) -> None:
        """Stop the request on every stage; its stream ends with finish reason CANCELLED."""
        self.is_cancelled = True
        trace.get_current_span(self.trace_ctx).add_event("cancel")
        for p in self.placements:
            if p.stream is not None and not p.is_ended:
                asyncio.get_running_loop().create_task(self._quiet(
                    p, p.replica.stub.Cancel, pb.CancelRequest(slot_id=p.slot_id), 5.0))

    async def cleanup(self, reason: FinishReason) -> None:
        """Finish (with `reason`) and Reset every slot still held. Never raises."""
        for p in self.placements:
            if p.admit_call is not None and not p.is_released:
                p.is_released = True
                stub = p.replica.stub
                state = await self._admit_outcome(p.admit_call)
                if state == "admitted":
                    await self._quiet(p, stub.Finish,
                                      pb.FinishRequest(
                                          slot_id=p.slot_id, reason=finish_reason_to_pb(reason)),
                                      10.0)
                if state != "refused":
                    # Reset is idempotent: after an Admit whose answer never came it frees
                    # the slot if the stage did admit it, and is a no-op otherwise.
                    await self._quiet(p, stub.Reset, pb.ResetRequest(slot_id=p.slot_id), 5.0)
            if p.stream is not None:
                p.stream.leave(p.slot_id)

    def final_cancelled(self) -> FinalReport:
        return FinalReport(self.request_id, FinishReason.CANCELLED, self.route.stages)

    # ---- internals ---------------------------------------------------------------------
    async def _await_admit(self, call: asyncio.Task[Any]) -> Any:
        """Admit's answer within the request's deadline; the call itself is not cancelled."""
        if self.deadline is None:
            return await asyncio.shield(call)
        try:
            return await asyncio.wait_for(asyncio.shield(call), self._remaining())
        except TimeoutError:
            raise DeadlineExceeded(f"request {self.request_id}: deadline exceeded while "
                                   "admitting") from None

    @staticmethod
    async def _admit_outcome(call: asyncio.Task[Any]) -> str:
        """'admitted', 'refused' or 'unknown' (the call failed: the stage may hold a slot)."""
        try:
            ans = await call
        except (Exception, asyncio.CancelledError):
            return "unknown"
        return "admitted" if ans.admitted else "refused"

    def _remaining(self) -> float:
        if self.deadline is None:
            return CONTROL_TIMEOUT_S
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.request_id}: deadline exceeded")
        return left

    def _coalesce(self, stage_id: str, token_ids: list[int], text: str,
                  scores: Scores | None = None) -> tuple[list[int], str]:
        """Add to one delta the updates of `stage_id` already waiting behind it (a caller
        that reads slower than the stages step gets fewer, larger deltas instead of a growing
        backlog); their log-probabilities go to `scores` when given, in the same order.
        Stops at another stage's update, an ending or an error, which stays for the next
        `_next_update`."""
        while len(token_ids) < MAX_TOKENS_PER_DELTA:
            nxt = self._updates.peek()
            if nxt is None:
                break
            nxt_stage, update = nxt
            if (nxt_stage != stage_id or isinstance(update, ServiceError)
                    or update.status == pb.MEMBER_STATUS_ENDED):
                break
            self._updates.take()
            token_ids += update.token_ids
            text += update.text
            if scores is not None:
                scores.add(update)
        return token_ids, text

    def _return_credits(self) -> None:
        """Hand each stage the member credits of the updates taken since the last call: one
        Step message per stage, however many updates."""
        for stage_id, n in self._updates.take_consumed().items():
            p = self._by_stage[stage_id]
            if p.stream is not None:
                p.stream.grant(p.slot_id, n)

    async def _next_update(self) -> Item:
        if len(self._updates):
            self._remaining()  # raises once the deadline has passed
            return self._updates.take()
        self._return_credits()  # all read: nothing else will hand these back
        if self.deadline is None:
            return await self._updates.get()
        self._remaining()
        try:
            # a timer on the waiting task: wait_for would start a task of its own per update
            async with asyncio.timeout_at(self.deadline):
                return await self._updates.get()
        except TimeoutError:
            raise DeadlineExceeded(f"request {self.request_id}: deadline exceeded while "
                                   "generating") from None

    async def _call(self, p: Placement, method: Any, request: Any,
                    timeout: float | None = None) -> Any:
        name = type(request).__name__.removesuffix("Request")
        span = _tracer.start_span(f"llmstage.v1.Stage/{name}", context=self.trace_ctx,
                                  kind=SpanKind.CLIENT, attributes={
                                      "rpc.system": "grpc", "rpc.service": "llmstage.v1.Stage",
                                      "rpc.method": name, "server.address": p.replica.endpoint,
                                      "llmstage.stage_id": p.stage_id,
                                      "llmstage.slot": p.slot_id,
                                      "llmstage.request_id": self.request_id})
        try:
            return await method(request, timeout=timeout or self._remaining(),
                                metadata=metadata_for(trace.set_span_in_context(span)))
        except grpc.aio.AioRpcError as exc:
            span.set_status(Status(StatusCode.ERROR, f"{exc.code().name}: {exc.details()}"))
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"request {self.request_id}: deadline exceeded at stage "
                                       f"{p.stage_id}") from None
            if code == grpc.StatusCode.UNAVAILABLE:
                p.replica.mark_down(exc.details() or "unavailable")
                raise Unavailable(f"stage {p.stage_id} replica {p.replica.endpoint} is "
                                  f"unavailable: {exc.details()}") from None
            raise error_for(code.name, f"stage {p.stage_id}: {exc.details()}") from None
        finally:
            span.end()

    async def _finish_all(self) -> FinalReport:
        diagnostics: dict[str, Any] = {}
        for p in self.placements:
            p.finish = await self._call(p, p.replica.stub.Finish,
                                        pb.FinishRequest(slot_id=p.slot_id))
            diag = await self._call(p, p.replica.stub.Diagnostics,
                                    pb.DiagnosticsRequest(slot_id=p.slot_id))
            diagnostics[p.stage_id] = MessageToDict(diag.values)
            await self._call(p, p.replica.stub.Reset, pb.ResetRequest(slot_id=p.slot_id))
            p.is_released = True
        first = self.placements[0].finish
        sink_id = self.route.sink_stages()[0]
        sink = next(p for p in self.placements if p.stage_id == sink_id).finish
        assert first is not None and sink is not None
        return FinalReport(
            self.request_id, finish_reason_from_pb(sink.finish_reason), self.route.stages,
            error=sink.error, usage=Usage(prompt_tokens=first.metrics.prompt_tokens,
                                          completion_tokens=len(sink.output_token_ids)),
            diagnostics=diagnostics)

    async def _quiet(self, p: Placement, method: Any, request: Any, timeout: float) -> None:
        """A cleanup call: traced like any other, failures only logged."""
        try:
            await self._call(p, method, request, timeout)
        except ServiceError as exc:
            log.debug("cleanup call to %s failed: %s", p.stage_id, exc.message)
