"""One step's events to the hidden port: each run's captured windows (the prefill window in
chunks, a decode step's row) and its end, with a CRC-32 of the states kept on the slot so a
consumer can prove it received these exact bytes."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from llm_runner_svc.engines.batch import HiddenStates
from llm_runner_svc.runtime import StepEvent
from llm_runner_svc.stage.publish import HiddenPublisher
from services.stage.slot import Slot


def _joined_prefill(windows: Sequence[HiddenStates], num_prompt: int) -> list[HiddenStates]:
    """Consecutive prompt windows of one step as one (a reused prefix arrives page by page),
    so the prefill window is published as it would be without the prefix cache."""
    out: list[HiddenStates] = []
    for hs in windows:
        last = out[-1] if out else None
        if last is not None and hs.start_position < num_prompt and \
                last.start_position + len(last.states) == hs.start_position:
            out[-1] = HiddenStates(np.concatenate([last.embeddings, hs.embeddings]),
                                   np.concatenate([last.states, hs.states]),
                                   last.start_position)
        else:
            out.append(hs)
    return out


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
        for hs in _joined_prefill(ev.hidden, num_prompt):
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
