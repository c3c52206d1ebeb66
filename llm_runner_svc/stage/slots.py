"""Slots: one per request, keyed by the caller's slot id, with an explicit state machine.

    Admit -> ADMITTED -> Prepare -> PREPARED -> join -> RUNNING -> Finish -> FINISHED -> Reset

A slot's *run* may end (completed, failed or cancelled) before Finish is called; `ended` then
holds the reason and the slot waits in its state for Finish. `SlotTable.require` is the one place
that decides whether a call is legal; an illegal one raises FailedPrecondition naming the state
and changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, NotFound
from llm_runner_svc.runtime import FinishReason, GenerationRequest, RequestMetrics
from llm_runner_svc.stage.request import StageRequest

if TYPE_CHECKING:
    from llm_runner_svc.stage.stepping import Cohort


class SlotState(Enum):
    ADMITTED = "ADMITTED"
    PREPARED = "PREPARED"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"


_S = SlotState
ALLOWED: dict[str, frozenset[SlotState]] = {
    "Prepare": frozenset({_S.ADMITTED}),
    "Step": frozenset({_S.PREPARED}),
    "Cancel": frozenset({_S.ADMITTED, _S.PREPARED, _S.RUNNING}),
    "Finish": frozenset({_S.ADMITTED, _S.PREPARED, _S.RUNNING}),
    "Diagnostics": frozenset({_S.FINISHED}),
    "Reset": frozenset({_S.ADMITTED, _S.PREPARED, _S.FINISHED}),
}
# Calls that need a run that has not ended yet.
_NEEDS_LIVE_RUN = frozenset({"Prepare", "Step"})


def allowed_calls(state: SlotState, is_ended: bool) -> list[str]:
    return [c for c, states in ALLOWED.items()
            if state in states and not (is_ended and c in _NEEDS_LIVE_RUN)]


@dataclass
class Slot:
    """One request's state on this stage."""

    slot_id: int
    request: StageRequest
    prompt_ids: tuple[int, ...]
    state: SlotState = SlotState.ADMITTED
    runtime_request: GenerationRequest | None = None  # built by Prepare
    seed: int = 0
    ended: FinishReason | None = None  # why the run ended, once it has
    error: str | None = None
    metrics: RequestMetrics | None = None
    output_ids: list[int] = field(default_factory=list)
    output_text: list[str] = field(default_factory=list)
    cohort: Cohort | None = None
    admit_ms: float = 0.0
    prepare_ms: float = 0.0
    is_finishing: bool = False
    request_ctx: Any = None  # trace context of the request (AdmitRequest.traceparent)
    t_join_ns: int = 0  # wall clock when it joined a cohort
    t_cancel_ns: int = 0  # wall clock of the first cancel
    hidden_crc32: int = 0  # zlib CRC-32 chained over every published states window, in order
    num_hidden_windows: int = 0
    num_steps: int = 0  # decode steps this slot took part in
    batch_size_sum: int = 0  # running rows summed over those steps
    max_batch_size: int = 0
    touched_at: float = field(default_factory=time.monotonic)
    ended_signal: asyncio.Event = field(default_factory=asyncio.Event)
    diagnostics: dict[str, Any] = field(default_factory=dict)

    @property
    def runtime_id(self) -> str:
        return f"slot-{self.slot_id}"

    def end(self, reason: FinishReason, error: str | None = None,
            metrics: RequestMetrics | None = None) -> None:
        """Record the end of the run; only the first end counts."""
        if self.ended is not None:
            return
        self.ended = reason
        self.error = error
        self.metrics = metrics
        self.ended_signal.set()


class SlotTable:
    """Live slots by id; the legality check of every slot call."""

    def __init__(self) -> None:
        self._slots: dict[int, Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Slot]:
        """Iterates over a snapshot, so callers may add or remove slots meanwhile."""
        return iter(list(self._slots.values()))

    def get(self, slot_id: int) -> Slot | None:
        return self._slots.get(slot_id)

    def add(self, slot: Slot) -> None:
        old = self._slots.get(slot.slot_id)
        if old is not None:
            raise FailedPrecondition(
                f"Admit is not allowed: slot {slot.slot_id} already exists in state "
                f"{old.state.value}; Reset it before admitting a new request into it")
        self._slots[slot.slot_id] = slot

    def remove(self, slot_id: int) -> Slot | None:
        return self._slots.pop(slot_id, None)

    def require(self, slot_id: int, call: str) -> Slot:
        """The slot, if `call` is legal on it now; else NotFound or FailedPrecondition."""
        check_slot_id(slot_id)
        slot = self._slots.get(slot_id)
        if slot is None:
            raise NotFound(f"{call}: slot {slot_id} does not exist")
        is_ended = slot.ended is not None
        if slot.state not in ALLOWED[call] or (is_ended and call in _NEEDS_LIVE_RUN):
            how = f" and its run ended ({slot.ended.value})" if slot.ended else ""
            raise FailedPrecondition(
                f"{call} is not allowed: slot {slot_id} is {slot.state.value}{how}; allowed now: "
                + ", ".join(allowed_calls(slot.state, is_ended)))
        slot.touched_at = time.monotonic()
        return slot

    def count(self, *states: SlotState) -> int:
        return sum(1 for s in self._slots.values() if s.state in states)


def check_slot_id(slot_id: int) -> None:
    if slot_id < 0:
        raise InvalidArgument(f"slot id {slot_id} is negative; slot ids are >= 0")
