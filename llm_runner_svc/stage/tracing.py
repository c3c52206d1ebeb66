"""The stage's spans for one request: admit, prepare, prefill, decode and finish.

Admit, Prepare and Finish spans are children of the calling RPC's context (the orchestrator's
client span, from gRPC metadata); prefill and decode are children of the request's own context
(AdmitRequest.traceparent), so requests that share a Step stream land in their own traces.
Prefill and decode are written once the run ends, with the times the runtime measured: no span
and no event per token.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from llm_runner_svc.stage.slots import Slot

tracer = trace.get_tracer("llmstage.stage")


def call_span(name: str, parent: otel_context.Context | None, stage_id: str, slot_id: int,
              request_id: str = "") -> Span:
    """A SERVER span for one stage RPC about one slot; the caller ends it."""
    return tracer.start_span(f"stage.{name}", context=parent, kind=SpanKind.SERVER,
                             attributes={"llmstage.stage_id": stage_id,
                                         "llmstage.slot": slot_id,
                                         "llmstage.request_id": request_id})


def run_spans(slot: Slot, stage_id: str) -> None:
    """Prefill and decode spans of a run that just ended (skipped for a run that never
    reached the model)."""
    m = slot.metrics
    if m is None or not slot.t_join_ns or slot.request_ctx is None:
        return
    ms = 1_000_000
    start = slot.t_join_ns + int(m.queue_ms * ms)
    first = start + int(m.prefill_ms * ms)
    end = first + int(m.decode_ms * ms) if m.decode_ms else time.time_ns()
    attrs: dict[str, Any] = {"llmstage.stage_id": stage_id, "llmstage.slot": slot.slot_id,
                             "llmstage.request_id": slot.request.request_id}
    prefill = tracer.start_span("stage.prefill", context=slot.request_ctx, start_time=start,
                                attributes={**attrs, "gen_ai.usage.input_tokens":
                                            len(slot.prompt_ids)})
    if slot.output_ids:
        prefill.add_event("first_token", timestamp=first)
    prefill.end(end_time=first)
    reason = slot.ended.value if slot.ended else "unknown"
    decode = tracer.start_span("stage.decode", context=slot.request_ctx, start_time=first,
                               attributes={**attrs,
                                           "gen_ai.usage.output_tokens": len(slot.output_ids),
                                           "gen_ai.response.finish_reasons": [reason],
                                           "llmstage.decode_steps": slot.num_steps,
                                           "llmstage.batch_size.max": slot.max_batch_size})
    if slot.t_cancel_ns:
        decode.add_event("cancel", timestamp=max(first, slot.t_cancel_ns))
    decode.add_event("finish", {"llmstage.finish_reason": reason}, timestamp=end)
    if slot.error:
        decode.set_status(Status(StatusCode.ERROR, slot.error))
    decode.end(end_time=end)
