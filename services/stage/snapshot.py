"""The kit's part of a stage's state accounting, as stage-wide Diagnostics reports it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CoreSnapshot:
    """The kit's part of the stage-wide state accounting."""

    num_slots: int
    slots_by_state: Mapping[str, int]
    num_cohorts: int
    num_cohort_slots: int  # slots the open Step streams still index
    num_runs_indexed: int  # runs the step loop can still route events to
    num_steps: int
    is_draining: bool


def core_diagnostics(snap: CoreSnapshot) -> dict[str, Any]:
    """The kit's keys of stage-wide Diagnostics."""
    return {"slots": snap.num_slots, "slots_by_state": dict(snap.slots_by_state),
            "cohorts": snap.num_cohorts, "cohort_slots": snap.num_cohort_slots,
            "runs_indexed": snap.num_runs_indexed, "steps": snap.num_steps,
            "draining": snap.is_draining}
