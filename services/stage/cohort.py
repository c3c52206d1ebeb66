"""A cohort: the members of one Step stream, its credit window and its members' windows.

Every event the stream sends spends one of the stream's credits; an event that carries tokens
for a member with a window of its own (`grant_member`) also spends one of that member's. A
member is held (it takes no step, the rest of the stage goes on) while the stream or its own
window is out of credit, so a reader that stops reading slows only its own members. An event
may overdraw an empty window: a member that joined during a step, a step already under way
when the window emptied, or terminal updates, which need no credit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from services.errors import ResourceExhausted, ServiceError
from services.stage.ending import FinishReason
from services.stage.slot import Slot
from services.stage.stepper import TokenScore

MAX_PENDING_REFUSALS = 1024
# A member whose window holds at most this many events may be held within the steps in flight
# (step_loop.MAX_IN_FLIGHT); the loop looks only at those, not at every member of every stream.
LOW_WINDOW = 2


@dataclass
class MemberUpdate:
    """What one step did for one member."""

    slot_id: int
    is_ended: bool
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: Sequence[TokenScore] = ()  # one per token id, when the run asked
    prompt_logprobs: Sequence[TokenScore] | None = None  # once, when the run asked


@dataclass
class JoinRefusal:
    slot_id: int
    code: str  # gRPC status name
    message: str


@dataclass
class CohortEvent:
    step: int
    members: list[MemberUpdate] = field(default_factory=list)
    refused: list[JoinRefusal] = field(default_factory=list)
    has_scores: bool = False  # a member's update has log-probabilities: encode them


class Cohort:
    """One Step stream. Runs on the event loop thread."""

    def __init__(self, max_window: int, wake: Callable[[], None]) -> None:
        self.max_window = max_window
        self.members: dict[int, Slot] = {}  # live members (their run has not ended)
        self.joined: dict[int, Slot] = {}  # every slot that joined and is not finished yet
        self.credits = 0
        self.member_credits: dict[int, int] = {}  # slot id -> its own window, when it has one
        self._low: set[int] = set()  # members whose own window is at most LOW_WINDOW
        self.is_client_done = False
        self.is_closed = False
        self._out_since: float | None = None  # when the window last ran dry
        self._wake = wake
        self._queue: asyncio.Queue[CohortEvent | None] = asyncio.Queue()
        self._refused: list[JoinRefusal] = []
        self._error: ServiceError | None = None
        self._last_step = 0

    def grant(self, credits: int) -> None:
        if self.credits + credits > self.max_window:
            raise ResourceExhausted(
                f"credit window would reach {self.credits + credits}; the most a Step stream "
                f"may hold is {self.max_window}")
        self.credits += credits
        if self.credits:
            self._out_since = None
        if self._refused and self.credits:
            self.deliver(CohortEvent(self._last_step))
        self._wake()

    def grant_member(self, slot_id: int, credits: int) -> None:
        """Add to a live member's own window; a slot that is not one is ignored (it may have
        just ended). The caller wakes the loop once for all the grants of a message."""
        if slot_id not in self.members:
            return
        total = self.member_credits.get(slot_id, 0) + credits
        if total > self.max_window:
            raise ResourceExhausted(
                f"slot {slot_id}'s window would reach {total}; the most a member may hold "
                f"is {self.max_window}")
        self._set_own(slot_id, total)

    def available(self, slot_id: int) -> int:
        """Events with tokens this member may still receive."""
        own = self.member_credits.get(slot_id)
        return self.credits if own is None else min(self.credits, own)

    def low_members(self) -> Iterator[tuple[Slot, int]]:
        """(slot, available) of every live member with at most LOW_WINDOW events available:
        all of them when the stream's own window is that low, else those whose own is."""
        sids: Iterable[int] = self.members if self.credits <= LOW_WINDOW else self._low
        for sid in sids:
            yield self.members[sid], self.available(sid)

    def _set_own(self, slot_id: int, credits: int) -> None:
        self.member_credits[slot_id] = credits
        if credits <= LOW_WINDOW:
            self._low.add(slot_id)
        else:
            self._low.discard(slot_id)

    @property
    def starved_since(self) -> float | None:
        """Since when live members have waited on a window the client has not refilled."""
        return self._out_since if self.members and not self.credits else None

    def add(self, slot: Slot) -> None:
        if not self.members and not self.credits:
            self._out_since = time.monotonic()  # waiting starts with its first member
        self.members[slot.slot_id] = slot
        self.joined[slot.slot_id] = slot

    def drop(self, slot_id: int) -> None:
        """The member's run ended: it takes no more steps."""
        self.members.pop(slot_id, None)
        self.member_credits.pop(slot_id, None)
        self._low.discard(slot_id)

    def forget(self, slot: Slot) -> None:
        """The slot is finished or freed: the stream keeps nothing of it."""
        self.drop(slot.slot_id)
        if self.joined.get(slot.slot_id) is slot:
            del self.joined[slot.slot_id]

    def refuse(self, refusal: JoinRefusal) -> None:
        self._refused.append(refusal)
        if len(self._refused) > MAX_PENDING_REFUSALS:
            self.fail(ResourceExhausted(
                f"more than {MAX_PENDING_REFUSALS} refused joins wait for a credit"))
        elif self.credits:
            self.deliver(CohortEvent(self._last_step))
            self._wake()  # the refusal spent a credit

    def deliver(self, event: CohortEvent) -> None:
        """Queue an event; it spends a credit of the stream and of each member with a window
        that it gives tokens."""
        if self.is_closed:
            return
        event.refused.extend(self._refused)
        self._refused.clear()
        self._last_step = event.step
        self.credits = max(0, self.credits - 1)
        if not self.credits and self._out_since is None:
            self._out_since = time.monotonic()
        for m in event.members:
            own = self.member_credits.get(m.slot_id)
            if own is not None and m.token_ids:
                self._set_own(m.slot_id, max(0, own - 1))
        self._queue.put_nowait(event)

    def client_done(self) -> None:
        self.is_client_done = True
        self.maybe_end()

    def maybe_end(self) -> None:
        if self.is_client_done and not self.members and not self.is_closed:
            self._queue.put_nowait(None)

    def fail(self, error: ServiceError) -> None:
        self._error = error
        self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[CohortEvent]:
        """The events in order; ends when the client is done and no member is left."""
        while True:
            event = await self._queue.get()
            if event is None:
                if self._error is not None:
                    raise self._error
                return
            yield event
