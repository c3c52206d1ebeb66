"""The slot machine's one table against the contract's table (DESIGN, section 3)."""

from __future__ import annotations

import pytest

from services.errors import FailedPrecondition, NotFound
from services.stage.slot import Slot, SlotState
from services.stage.slot_machine import CALLS, TRANSITIONS, IllegalTransition, Move, SlotMachine

S = SlotState
# The contract's table, written out here: state -> the calls it allows.
CONTRACT = {
    "ADMITTED": {"Prepare", "Cancel", "Finish", "Reset"},
    "PREPARED": {"Step", "Cancel", "Finish", "Reset"},
    "RUNNING": {"Cancel", "Finish"},
    "FINISHED": {"Diagnostics", "Reset"},
}
# A run that ended before Finish: no Prepare or Step (nothing left to run); Cancel is
# acknowledged; a second Finish while the first waits is refused.
SUB_STATES = {
    S.ADMITTED_ENDED: {"Cancel", "Finish", "Reset"},
    S.PREPARED_ENDED: {"Cancel", "Finish", "Reset"},
    S.ENDED: {"Cancel", "Finish"},
    S.FINISHING: {"Cancel"},
    S.ORPHANED: {"Cancel", "Finish"},
}


def allowed(state: SlotState) -> set[str]:
    return {call for call, states in CALLS.items() if state in states}


@pytest.mark.parametrize("state", [S.ADMITTED, S.PREPARED, S.RUNNING, S.FINISHED])
def test_the_contract_states_allow_what_the_contract_says(state: SlotState) -> None:
    assert allowed(state) == CONTRACT[state.wire]


@pytest.mark.parametrize("state", list(SUB_STATES))
def test_sub_states_allow_less_than_their_contract_state(state: SlotState) -> None:
    assert allowed(state) == SUB_STATES[state]
    assert allowed(state) <= CONTRACT[state.wire] | {"Finish", "Cancel"}


def test_every_state_is_reachable_and_every_slot_can_be_freed() -> None:
    reach, todo = {S.ADMITTED}, [S.ADMITTED]
    while todo:
        state = todo.pop()
        for targets in TRANSITIONS.values():
            nxt = targets.get(state)
            if nxt is not None and nxt not in reach:
                reach.add(nxt)
                todo.append(nxt)
    assert reach == set(SlotState)
    frees = {s for targets in TRANSITIONS.values() for s, t in targets.items() if t is None}
    # A state that cannot be freed directly must lead to one that can.
    for state in set(SlotState) - frees:
        assert any(targets.get(state) in frees for targets in TRANSITIONS.values()), state


def test_moves_follow_the_table_and_free_the_slot() -> None:
    m = SlotMachine()
    slot = Slot(7, request=None)
    m.admit(slot)
    assert m.move(slot, Move.PREPARE) is S.PREPARED
    assert m.move(slot, Move.JOIN) is S.RUNNING
    with pytest.raises(IllegalTransition):
        m.move(slot, Move.RESET)  # a running slot is never freed by Reset
    assert m.move(slot, Move.FINISH) is S.FINISHING
    assert m.move(slot, Move.RUN_END) is S.FINISHED
    assert m.count() == {"ADMITTED": 0, "PREPARED": 0, "RUNNING": 0, "FINISHED": 1}
    assert m.move(slot, Move.RESET) is None
    assert m.get(7) is None and len(m) == 0
    with pytest.raises(IllegalTransition):
        m.move(slot, Move.RESET)  # a freed slot moves no more


def test_an_orphan_is_freed_by_its_end_unless_finish_claimed_it() -> None:
    m = SlotMachine()
    a, b = Slot(1, request=None), Slot(2, request=None)
    for slot in (a, b):
        m.admit(slot)
        m.move(slot, Move.PREPARE)
        m.move(slot, Move.JOIN)
        m.move(slot, Move.ORPHAN)
    assert m.move(a, Move.RUN_END) is None and m.get(1) is None
    assert m.move(b, Move.FINISH) is S.FINISHING
    assert m.move(b, Move.RUN_END) is S.FINISHED and m.get(2) is b


def test_an_ended_member_is_not_orphaned_and_waits_for_finish() -> None:
    m = SlotMachine()
    slot = Slot(4, request=None)
    m.admit(slot)
    for move in (Move.PREPARE, Move.JOIN, Move.RUN_END):
        m.move(slot, move)
    assert slot.state is S.ENDED and not m.can_move(slot, Move.ORPHAN)
    with pytest.raises(IllegalTransition):
        m.move(slot, Move.ORPHAN)
    assert m.move(slot, Move.FINISH) is S.FINISHED and m.get(4) is slot


def test_illegal_calls_name_the_contract_state_and_change_nothing() -> None:
    m = SlotMachine()
    slot = Slot(3, request=None)
    m.admit(slot)
    m.move(slot, Move.PREPARE)
    m.move(slot, Move.JOIN)
    m.move(slot, Move.RUN_END)  # its run ended before Finish
    with pytest.raises(FailedPrecondition, match=r"slot 3 is RUNNING.*allowed now: Cancel, Finish"):
        m.require(3, "Reset")
    assert slot.state is S.ENDED
    with pytest.raises(NotFound):
        m.require(4, "Finish")
    with pytest.raises(FailedPrecondition, match="already exists in state RUNNING"):
        m.admit(Slot(3, request=None))
