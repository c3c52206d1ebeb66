"""A slot: one request's state on a stage, split by who writes what.

`Slot.request` and `Slot.admitted` are fixed at Admit; `Slot.prepared` at Prepare. `run` is the
run record the step loop writes (how it ended, what it produced, its Step stream); `telemetry`
holds timings and counters for Diagnostics, metrics and traces. Only `SlotMachine` changes
`state`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from services.stage.ending import FinishReason


class Membership(Protocol):
    """The Step stream a slot joined (a `Cohort`), as a slot sees it."""

    is_closed: bool


class SlotState(Enum):
    ADMITTED = "ADMITTED"
    PREPARED = "PREPARED"
    RUNNING = "RUNNING"
    ADMITTED_ENDED = "ADMITTED_ENDED"  # cancelled before Prepare; waits for Finish or Reset
    PREPARED_ENDED = "PREPARED_ENDED"  # cancelled before it joined; waits for Finish or Reset
    ENDED = "ENDED"  # a member's run ended; waits for Finish
    FINISHING = "FINISHING"  # Finish waits for the run to stop
    ORPHANED = "ORPHANED"  # its Step stream broke while it ran; its end frees it
    FINISHED = "FINISHED"

    @property
    def wire(self) -> str:
        """The state the contract names (ADMITTED, PREPARED, RUNNING or FINISHED)."""
        return _WIRE[self]

    @property
    def is_live(self) -> bool:
        """Its run has not ended."""
        return self in (_S.ADMITTED, _S.PREPARED, _S.RUNNING, _S.FINISHING, _S.ORPHANED)


_S = SlotState
_WIRE = {_S.ADMITTED: "ADMITTED", _S.PREPARED: "PREPARED", _S.RUNNING: "RUNNING",
         _S.ADMITTED_ENDED: "ADMITTED", _S.PREPARED_ENDED: "PREPARED", _S.ENDED: "RUNNING",
         _S.FINISHING: "RUNNING", _S.ORPHANED: "RUNNING", _S.FINISHED: "FINISHED"}


@dataclass
class RunRecord:
    """What the request's run did. Written by the step loop and the stage core."""

    ended: FinishReason | None = None  # why the run ended, once it has
    error: str | None = None
    metrics: Any = None  # the stepper's per-request metrics, from its last event
    output_ids: list[int] = field(default_factory=list)
    output_text: list[str] = field(default_factory=list)
    cohort: Membership | None = None  # the Step stream it joined
    ended_signal: asyncio.Event = field(default_factory=asyncio.Event)

    def end(self, reason: FinishReason, error: str | None = None, metrics: Any = None) -> bool:
        """Record the end; only the first counts. True when this call recorded it."""
        if self.ended is not None:
            return False
        self.ended, self.error, self.metrics = reason, error, metrics
        self.ended_signal.set()
        return True


@dataclass
class Telemetry:
    """Timings and counters of one slot (Diagnostics, metrics, traces)."""

    request_ctx: Any = None  # trace context of the request
    admit_ms: float = 0.0
    prepare_ms: float = 0.0
    t_join_ns: int = 0  # wall clock when it joined a Step stream
    t_cancel_ns: int = 0  # wall clock of the first cancel
    num_steps: int = 0  # steps that gave it tokens
    batch_size_sum: int = 0  # rows with tokens summed over those steps
    max_batch_size: int = 0
    hidden_crc32: int = 0  # zlib CRC-32 chained over every published states window
    num_hidden_windows: int = 0


@dataclass(eq=False)
class Slot:
    """One request on this stage, keyed by the caller's slot id."""

    slot_id: int
    request: Any  # what the caller asked (frozen; the stage's own request type)
    admitted: Any = None  # what Admit derived from it (frozen; e.g. prompt token ids)
    prepared: Any = None  # what Prepare built for the stepper (e.g. the runtime request)
    state: SlotState = SlotState.ADMITTED
    run: RunRecord = field(default_factory=RunRecord)
    telemetry: Telemetry = field(default_factory=Telemetry)
    touched_at: float = field(default_factory=time.monotonic)
    diagnostics: dict[str, Any] = field(default_factory=dict)  # fixed at Finish

    @functools.cached_property
    def runtime_id(self) -> str:
        """The id of its run in the stepper (read for every member of every step)."""
        return f"slot-{self.slot_id}"
