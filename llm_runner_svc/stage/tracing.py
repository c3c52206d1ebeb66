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

from services.stage.slot import Slot

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
    run, tel = slot.run, slot.telemetry
    m = run.metrics
    if m is None or not tel.t_join_ns or tel.request_ctx is None:
        return
    ms = 1_000_000
    start = tel.t_join_ns + int(m.queue_ms * ms)
    first = start + int(m.prefill_ms * ms)
    end = first + int(m.decode_ms * ms) if m.decode_ms else time.time_ns()
    attrs: dict[str, Any] = {"llmstage.stage_id": stage_id, "llmstage.slot": slot.slot_id,
                             "llmstage.request_id": slot.request.request_id}
    prefill = tracer.start_span("stage.prefill", context=tel.request_ctx, start_time=start,
                                attributes={**attrs, "gen_ai.usage.input_tokens":
                                            len(slot.admitted)})
    if run.output_ids:
        prefill.add_event("first_token", timestamp=first)
    prefill.end(end_time=first)
    reason = run.ended.value if run.ended else "unknown"
    decode = tracer.start_span("stage.decode", context=tel.request_ctx, start_time=first,
                               attributes={**attrs,
                                           "gen_ai.usage.output_tokens": len(run.output_ids),
                                           "gen_ai.response.finish_reasons": [reason],
                                           "llmstage.decode_steps": tel.num_steps,
                                           "llmstage.batch_size.max": tel.max_batch_size})
    if tel.t_cancel_ns:
        decode.add_event("cancel", timestamp=max(first, tel.t_cancel_ns))
    decode.add_event("finish", {"llmstage.finish_reason": reason}, timestamp=end)
    if run.error:
        decode.set_status(Status(StatusCode.ERROR, run.error))
    decode.end(end_time=end)
