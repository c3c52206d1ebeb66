"""The C++ talker's slot table (clients/cpp/talker/slot_machine.{h,cc}) against the stage kit's
(services/stage/slot_machine.py), read from the source: which call each sub-state allows, in
the same order (refusals list them), which members a broken Step stream orphans, and which
sub-states the slot TTL may free. The talker has every sub-state of the kit but ORPHANED, which
lasts no time there (an orphan's run ends as its stream breaks).

test_illegal_calls.py runs both over the wire; this covers what the wire cannot hold still
(FINISHING, the moves a client does not make)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.stage.slot import SlotState
from services.stage.slot_machine import CALLS, TRANSITIONS, Move

TALKER = Path(__file__).resolve().parents[2] / "clients" / "cpp" / "talker"
HEADER = (TALKER / "slot_machine.h").read_text()
SOURCE = (TALKER / "slot_machine.cc").read_text()


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def _enum(name: str) -> list[str]:
    """The enumerators of `enum class name` in slot_machine.h, less their k."""
    match = re.search(rf"enum class {name} \{{(.*?)\}};", HEADER, re.S)
    assert match, f"enum class {name} not found in slot_machine.h"
    body = re.sub(r"//[^\n]*", "", match.group(1))
    return re.findall(r"\bk(\w+)", body)


def _bools(text: str) -> list[bool]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    assert set(values) <= {"true", "false"}, values
    return [v == "true" for v in values]


SUB_STATES = [_snake(name) for name in _enum("SubState")]  # "ADMITTED_ENDED", ...
CPP_CALLS = _enum("SlotCall")  # "Admit", "Prepare", ...


def _table() -> dict[str, list[bool]]:
    rows = re.findall(r"\{SlotCall::k(\w+), \{([^}]*)\}\}", SOURCE)
    assert [call for call, _ in rows] == CPP_CALLS, rows
    out = {call: _bools(cells) for call, cells in rows}
    assert all(len(cells) == len(SUB_STATES) for cells in out.values()), out
    return out


def _column(name: str) -> list[bool]:
    match = re.search(rf"constexpr std::array<bool, kNumSubStates> {name} = \{{([^}}]*)\}};",
                      SOURCE)
    assert match, f"{name} not found in slot_machine.cc"
    cells = _bools(match.group(1))
    assert len(cells) == len(SUB_STATES), (name, cells)
    return cells


def test_the_talker_has_every_sub_state_of_the_kit_but_orphaned() -> None:
    assert [s.value for s in SlotState if s is not SlotState.ORPHANED] == SUB_STATES
    for state in SUB_STATES:  # SubStateName spells them as the kit does
        assert f'case SubState::k{state.title().replace("_", "")}: return "{state}";' in SOURCE


@pytest.mark.parametrize("state", SUB_STATES)
def test_each_sub_state_allows_the_kits_calls_in_the_kits_order(state: str) -> None:
    column = SUB_STATES.index(state)
    table = _table()
    assert not any(table["Admit"]), "Admit is never legal on an existing slot"
    cpp = [call for call in CPP_CALLS if table[call][column]]
    kit = [call for call, states in CALLS.items() if SlotState(state) in states]
    assert cpp == kit, (state, cpp, kit)


def test_a_broken_stream_orphans_what_the_kit_orphans() -> None:
    cpp = {s for s, on in zip(SUB_STATES, _column("kOrphanedByBreak"), strict=True) if on}
    assert cpp == {s.value for s in TRANSITIONS[Move.ORPHAN]} == {"RUNNING"}


def test_the_slot_ttl_frees_what_the_kit_expires() -> None:
    cpp = {s for s, on in zip(SUB_STATES, _column("kMayExpire"), strict=True) if on}
    kit = {s.value for s in TRANSITIONS[Move.EXPIRE]} - {SlotState.ORPHANED.value}
    assert cpp == kit
    assert not cpp & {"RUNNING", "FINISHING"}
