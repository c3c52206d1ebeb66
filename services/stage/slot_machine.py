"""The slot state machine: one transition table, and the only code that creates, moves and
frees slots. The C++ talker mirrors it in clients/cpp/talker/slot_machine.{h,cc}.

    Admit -> ADMITTED -Prepare-> PREPARED -join-> RUNNING -Finish-> FINISHING -> FINISHED
    -Reset-> (gone)

A run can end before Finish: a cancel while ADMITTED or PREPARED (ADMITTED_ENDED,
PREPARED_ENDED), or a member's generation ending while RUNNING (ENDED). A RUNNING member whose
Step stream broke is ORPHANED: nobody will call Finish, so its end frees it. An ENDED member
waits for Finish whatever becomes of its stream (the client read its end and may break the
stream before it finishes); the slot TTL frees it when nobody comes. The contract shows four
states (`SlotState.wire`); the sub-states only change which calls are legal.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from enum import Enum

from services.errors import FailedPrecondition, InvalidArgument, NotFound
from services.stage.slot import Slot, SlotState

_S = SlotState


FREED = None  # the target of a transition that frees the slot


class Move(Enum):
    PREPARE = "prepare"  # Prepare built the run
    JOIN = "join"  # joined a Step stream
    CANCEL_UNSTARTED = "cancel unstarted"  # a run that never joined ends
    RUN_END = "run end"  # the stepper reported the run's end
    FINISH = "finish"  # Finish was called
    ORPHAN = "orphan"  # its Step stream broke
    RESET = "reset"  # Reset was called
    EXPIRE = "expire"  # nobody touched it for the slot TTL


# (move, from) -> to. A pair not listed is a bug in the caller (IllegalTransition).
TRANSITIONS: dict[Move, dict[SlotState, SlotState | None]] = {
    Move.PREPARE: {_S.ADMITTED: _S.PREPARED},
    Move.JOIN: {_S.PREPARED: _S.RUNNING},
    Move.CANCEL_UNSTARTED: {_S.ADMITTED: _S.ADMITTED_ENDED, _S.PREPARED: _S.PREPARED_ENDED},
    Move.RUN_END: {_S.RUNNING: _S.ENDED, _S.FINISHING: _S.FINISHED, _S.ORPHANED: FREED},
    Move.FINISH: {_S.ADMITTED: _S.FINISHED, _S.PREPARED: _S.FINISHED,
                  _S.ADMITTED_ENDED: _S.FINISHED, _S.PREPARED_ENDED: _S.FINISHED,
                  _S.ENDED: _S.FINISHED, _S.RUNNING: _S.FINISHING,
                  _S.ORPHANED: _S.FINISHING},
    Move.ORPHAN: {_S.RUNNING: _S.ORPHANED},
    Move.RESET: {_S.ADMITTED: FREED, _S.PREPARED: FREED, _S.ADMITTED_ENDED: FREED,
                 _S.PREPARED_ENDED: FREED, _S.FINISHED: FREED},
    Move.EXPIRE: {s: FREED for s in SlotState
                  if s not in (_S.RUNNING, _S.FINISHING, _S.ORPHANED)},
}

# Which contract call is legal in which state (Admit: only where no slot exists).
CALLS: dict[str, frozenset[SlotState]] = {
    "Prepare": frozenset({_S.ADMITTED}),
    "Step": frozenset({_S.PREPARED}),
    "Cancel": frozenset(SlotState) - {_S.FINISHED},
    "Finish": frozenset(SlotState) - {_S.FINISHING, _S.FINISHED},
    "Diagnostics": frozenset({_S.FINISHED}),
    "Reset": frozenset(TRANSITIONS[Move.RESET]),
}


class IllegalTransition(Exception):
    """A bug: code moved a slot along a transition the table does not have."""


def check_slot_id(slot_id: int) -> None:
    if slot_id < 0:
        raise InvalidArgument(f"slot id {slot_id} is negative; slot ids are >= 0")


def allowed_calls(state: SlotState) -> list[str]:
    return [call for call, states in CALLS.items() if state in states]


class SlotMachine:
    """Live slots by id. Every state change goes through `move`."""

    def __init__(self) -> None:
        self._slots: dict[int, Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Slot]:
        """Iterates over a snapshot, so callers may move or free slots meanwhile."""
        return iter(list(self._slots.values()))

    def get(self, slot_id: int) -> Slot | None:
        return self._slots.get(slot_id)

    def check_free(self, slot_id: int) -> None:
        """Admit's check: FailedPrecondition when the slot id is taken."""
        check_slot_id(slot_id)
        old = self._slots.get(slot_id)
        if old is not None:
            raise FailedPrecondition(
                f"Admit is not allowed: slot {slot_id} already exists in state "
                f"{old.state.wire}; Reset it before admitting a new request into it")

    def admit(self, slot: Slot) -> None:
        self.check_free(slot.slot_id)
        slot.state = _S.ADMITTED
        self._slots[slot.slot_id] = slot

    def require(self, slot_id: int, call: str) -> Slot:
        """The slot, if `call` is legal on it now; else NotFound or FailedPrecondition."""
        check_slot_id(slot_id)
        slot = self._slots.get(slot_id)
        if slot is None:
            raise NotFound(f"{call}: slot {slot_id} does not exist")
        if slot.state not in CALLS[call]:
            raise FailedPrecondition(
                f"{call} is not allowed: slot {slot_id} is {slot.state.wire}"
                f"{_why(slot)}; allowed now: {', '.join(allowed_calls(slot.state))}")
        slot.touched_at = time.monotonic()
        return slot

    def move(self, slot: Slot, move: Move) -> SlotState | None:
        """Apply `move`; returns the new state, or None when the slot was freed."""
        targets = TRANSITIONS[move]
        if slot.state not in targets or self._slots.get(slot.slot_id) is not slot:
            raise IllegalTransition(f"slot {slot.slot_id}: no {move.value} from "
                                    f"{slot.state.value}")
        new = targets[slot.state]
        if new is FREED:
            del self._slots[slot.slot_id]
        else:
            slot.state = new
        return new

    def can_move(self, slot: Slot, move: Move) -> bool:
        return slot.state in TRANSITIONS[move] and self._slots.get(slot.slot_id) is slot

    def count(self) -> dict[str, int]:
        """Live slots by the contract's state names."""
        out = dict.fromkeys(("ADMITTED", "PREPARED", "RUNNING", "FINISHED"), 0)
        for slot in self._slots.values():
            out[slot.state.wire] += 1
        return out

    def idle_since(self, cutoff: float) -> list[Slot]:
        """Slots nobody touched since `cutoff` that may expire."""
        return [s for s in self._slots.values()
                if s.touched_at < cutoff and s.state in TRANSITIONS[Move.EXPIRE]]


def _why(slot: Slot) -> str:
    if slot.state is _S.FINISHING:
        return " and already being finished"
    if slot.state is _S.ORPHANED:
        return " and its Step stream is gone"
    ended = slot.run.ended
    if not slot.state.is_live and ended is not None:
        return f" and its run ended ({ended.value})"
    return ""
