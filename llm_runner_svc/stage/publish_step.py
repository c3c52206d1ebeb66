"""One step's events to the hidden port: each run's captured windows (the prefill window in
chunks, a decode step's row) and its end, with a CRC-32 of the states kept on the slot so a
consumer can prove it received these exact bytes."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from llm_runner_svc.engines.batch import HiddenStates
from llm_runner_svc.runtime import StepEvent
from llm_runner_svc.stage.hidden_messages import WireArray
from llm_runner_svc.stage.publish import HiddenPublisher
from services.stage.slot import Slot


def _concat(parts: Sequence[Any]) -> Any:
    """Row blocks [n_i, hidden] of one dtype as one [sum n_i, hidden]."""
    if isinstance(parts[0], WireArray):
        return WireArray(np.concatenate([p.bits for p in parts]), parts[0].dtype.name)
    return np.concatenate(parts)


def _nbytes(rows: Any) -> int:
    return int(np.prod(rows.shape)) * rows.dtype.itemsize


def _joined(pieces: Sequence[HiddenStates]) -> HiddenStates:
    """Consecutive windows as one (a single window as it is, without a copy)."""
    if len(pieces) == 1:
        return pieces[0]
    return HiddenStates(_concat([p.embeddings for p in pieces]),
                        _concat([p.states for p in pieces]), pieces[0].start_position)


class PromptWindows:
    """Each request's prompt states, held until its whole prompt is prefilled and then
    published as one prefill window. A prompt prefilled over several steps (the step's
    token budget cuts it into chunks; a reused prefix arrives page by page) thus reaches
    subscribers in the same messages as one prefilled in a single step: one window of
    [prompt_len, hidden] from position 0, chunked only under the message limit, with the
    same sequence numbers and CRC over the same bytes.

    Bounded: one prompt's states (embeddings and states, [prompt_len <= maxSeq, hidden]
    each) per running request on the port, so at most maxBatch prompts. A request's
    pieces are dropped when it ends, whatever the reason (a request that ends before its
    prompt is fully prefilled publishes no prefill window, only its end), by `retain`
    for requests no longer live, and by `clear`."""

    def __init__(self) -> None:
        self._held: dict[str, list[HiddenStates]] = {}

    @property
    def num_bytes(self) -> int:
        """Bytes of the states held (embeddings and states)."""
        return sum(_nbytes(h.embeddings) + _nbytes(h.states)
                   for pieces in self._held.values() for h in pieces)

    def take(self, request_id: str, windows: Sequence[HiddenStates],
             num_prompt: int) -> list[HiddenStates]:
        """The windows of one step of a request to publish now, in order: decode rows as
        they are, and the prompt's window once its last prompt position is among them.
        The runtime hands each position's states once and in order, so the pieces held
        are consecutive."""
        out: list[HiddenStates] = []
        for hs in windows:
            if hs.start_position >= num_prompt:
                out.append(hs)
                continue
            pieces = self._held.setdefault(request_id, [])
            pieces.append(hs)
            if hs.start_position + hs.states.shape[0] >= num_prompt:
                out.append(_joined(self._held.pop(request_id)))
        return out

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def retain(self, live: Iterable[str]) -> None:
        """Drop the pieces of every request not in `live` (its end was never handed over,
        as when the decode loop failed)."""
        if self._held:
            keep = set(live)
            for rid in [r for r in self._held if r not in keep]:
                del self._held[rid]

    def clear(self) -> None:
        self._held.clear()

    @property
    def num_requests(self) -> int:
        return len(self._held)


async def publish_step(hidden: HiddenPublisher, prompts: PromptWindows,
                       pairs: list[tuple[Slot, StepEvent]]) -> None:
    """Prefill windows first, then the step's decode rows together, then the ends (a
    request's rows always precede its end). What each request publishes is settled (and
    an ended request's held pieces dropped) before the first message goes out."""
    todo: list[tuple[Slot, list[HiddenStates]]] = []
    ends: list[tuple[str, str, str | None]] = []
    for slot, ev in pairs:
        if not slot.request.wants_hidden:
            continue
        rid = slot.request.request_id
        todo.append((slot, prompts.take(rid, ev.hidden, len(slot.admitted))))
        if ev.finish_reason is not None:
            prompts.drop(rid)
            ends.append((rid, ev.finish_reason.value, ev.error))
    rows: list[tuple[str, int, int, Any, Any]] = []
    for slot, windows in todo:
        rid = slot.request.request_id
        num_prompt = len(slot.admitted)
        for hs in windows:
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
    await hidden.publish_rows(rows)
    for rid, reason, error in ends:
        await hidden.end(rid, reason, error)
