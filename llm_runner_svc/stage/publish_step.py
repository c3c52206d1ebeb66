"""One step's events to the hidden port: each run's captured windows (the prefill window in
chunks, a decode step's row) and its end, with a CRC-32 of the states kept on the slot so a
consumer can prove it received these exact bytes."""

from __future__ import annotations

import zlib
from typing import Any

from llm_runner_svc.runtime import StepEvent
from llm_runner_svc.stage.publish import HiddenPublisher
from services.stage.slot import Slot


async def publish_step(hidden: HiddenPublisher, pairs: list[tuple[Slot, StepEvent]]) -> None:
    """Prefill windows first, then the step's decode rows together, then the ends (a
    request's rows always precede its end)."""
    rows: list[tuple[str, int, int, Any, Any]] = []
    ends: list[tuple[str, str, str | None]] = []
    for slot, ev in pairs:
        if not slot.request.wants_hidden:
            continue
        rid = slot.request.request_id
        num_prompt = len(slot.admitted)
        for hs in ev.hidden:
            # A checksum at the source, so a consumer can prove it got these exact bytes.
            slot.telemetry.hidden_crc32 = zlib.crc32(hs.states.tobytes(),
                                                   slot.telemetry.hidden_crc32)
            slot.telemetry.num_hidden_windows += 1
            p = hs.start_position
            if p < num_prompt:
                n = hs.states.shape[0]
                await hidden.publish(rid, p, list(slot.admitted[p:p + n]), hs.embeddings,
                                     hs.states, True)
            else:  # one decode position: the token fed there is an earlier output
                rows.append((rid, p, slot.run.output_ids[p - num_prompt], hs.embeddings,
                             hs.states))
        if ev.finish_reason is not None:
            ends.append((rid, ev.finish_reason.value, ev.error))
    await hidden.publish_rows(rows)
    for rid, reason, error in ends:
        await hidden.end(rid, reason, error)
