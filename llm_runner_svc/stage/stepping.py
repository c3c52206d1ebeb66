"""Cohorts (the members of one Step stream) and the stage's own decode loop.

The loop runs `runtime.step()` on one worker thread whenever the runtime has work and every
cohort with live members has a credit, then turns the runtime's per-request events into one
`CohortEvent` per cohort. A cohort that is out of credit holds the loop: the slow reader slows
decoding instead of growing a queue. Cancels still land while the loop is held (they produce
only terminal updates, at most one per member). Everything here runs on the event loop thread
except `runtime.step`. When every cohort will still hold a credit after the step that just
ended is delivered, the next step starts on the worker thread before that delivery (and the
hidden-port publishing) runs on the event loop, so an accelerator is not left idle while
Python turns a step into messages; otherwise the loop waits for the reader, as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from llm_runner_svc.errors import Internal, ResourceExhausted, RunnerError
from llm_runner_svc.runtime import FinishReason, InferenceRuntime, StepEvent
from llm_runner_svc.stage.slots import Slot

log = logging.getLogger(__name__)

MAX_PENDING_REFUSALS = 1024


@dataclass
class MemberUpdate:
    """What one step did for one member."""

    slot_id: int
    is_ended: bool
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None


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


class Cohort:
    """One Step stream: its members, its credit window and its outgoing events."""

    def __init__(self, max_window: int, wake: Callable[[], None]) -> None:
        self.max_window = max_window
        self.members: dict[int, Slot] = {}  # live members (their run has not ended)
        self.joined: dict[int, Slot] = {}  # every slot that ever joined
        self.credits = 0
        self.is_client_done = False
        self.is_closed = False
        self._wake = wake
        self._queue: asyncio.Queue[CohortEvent | None] = asyncio.Queue()
        self._refused: list[JoinRefusal] = []
        self._error: RunnerError | None = None
        self._last_step = 0

    @property
    def is_blocked(self) -> bool:
        return bool(self.members) and self.credits == 0 and not self.is_closed

    def grant(self, credits: int) -> None:
        if self.credits + credits > self.max_window:
            raise ResourceExhausted(
                f"credit window would reach {self.credits + credits}; the most a Step stream "
                f"may hold is {self.max_window}")
        self.credits += credits
        if self._refused and self.credits:
            self.deliver(CohortEvent(self._last_step))
        self._wake()

    def add(self, slot: Slot) -> None:
        self.members[slot.slot_id] = slot
        self.joined[slot.slot_id] = slot

    def refuse(self, refusal: JoinRefusal) -> None:
        self._refused.append(refusal)
        if len(self._refused) > MAX_PENDING_REFUSALS:
            self.fail(ResourceExhausted(
                f"more than {MAX_PENDING_REFUSALS} refused joins wait for a credit"))
        elif self.credits:
            self.deliver(CohortEvent(self._last_step))

    def deliver(self, event: CohortEvent) -> None:
        """Queue an event; it spends a credit. An event may overdraw an empty window (a member
        that joined during a step, or terminal updates of cancels): at most one per step, and
        the loop then holds until the reader grants more."""
        if self.is_closed:
            return
        event.refused.extend(self._refused)
        self._refused.clear()
        self._last_step = event.step
        self.credits = max(0, self.credits - 1)
        self._queue.put_nowait(event)

    def client_done(self) -> None:
        self.is_client_done = True
        self.maybe_end()

    def maybe_end(self) -> None:
        if self.is_client_done and not self.members and not self.is_closed:
            self._queue.put_nowait(None)

    def fail(self, error: RunnerError) -> None:
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


class StepLoop:
    """Drives `runtime.step()` for every cohort of the stage."""

    def __init__(self, runtime: InferenceRuntime, resolve: Callable[[str], Slot | None],
                 on_orphan_end: Callable[[Slot], None],
                 publish: Callable[[list[tuple[Slot, StepEvent]]], Awaitable[None]]) -> None:
        self.runtime = runtime
        self.cohorts: set[Cohort] = set()
        self.num_steps = 0
        self._resolve = resolve
        self._on_orphan_end = on_orphan_end
        self._publish = publish  # hidden states; may hold the loop (a blocking subscriber)
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="decode")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive(), name="step-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    def wake(self) -> None:
        self._wake.set()

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        ahead: asyncio.Future[list[StepEvent]] | None = None  # a step started early
        while True:
            await self._wake.wait()
            self._wake.clear()
            while ahead is not None or self.runtime.has_work:
                if ahead is None and any(c.is_blocked for c in self.cohorts):
                    if not self.runtime.has_cancels:
                        break  # a grant, join or cancel wakes us
                    await self._publish(self._dispatch(self.runtime.apply_cancels()))
                    continue
                step = ahead or loop.run_in_executor(self._executor, self.runtime.step)
                ahead = None
                try:
                    events = await step
                except Exception as exc:
                    log.exception("decode step failed outside any request")
                    for cohort in list(self.cohorts):
                        cohort.fail(Internal(f"decode loop failed: {exc}"))
                    break
                if self.runtime.has_work and self._can_step_ahead():
                    ahead = loop.run_in_executor(self._executor, self.runtime.step)
                await self._publish(self._dispatch(events))

    def _can_step_ahead(self) -> bool:
        """Every cohort with members keeps a credit after this step's event is delivered."""
        return all(c.credits >= 2 or not c.members or c.is_closed for c in self.cohorts)

    def _dispatch(self, events: list[StepEvent]) -> list[tuple[Slot, StepEvent]]:
        """Route the runtime's events to their slots and cohorts; return (slot, event)."""
        self.num_steps += 1
        pairs: list[tuple[Slot, StepEvent]] = []
        batch_size = sum(1 for ev in events if ev.token_ids)
        updates: dict[Cohort, list[MemberUpdate]] = {}
        for ev in events:
            slot = self._resolve(ev.request_id)
            if slot is None:
                log.error("step event for unknown request %s", ev.request_id)
                continue
            pairs.append((slot, ev))
            slot.output_ids.extend(ev.token_ids)
            if ev.text:
                slot.output_text.append(ev.text)
            if ev.token_ids:
                slot.num_steps += 1
                slot.batch_size_sum += batch_size
                slot.max_batch_size = max(slot.max_batch_size, batch_size)
            is_ended = ev.finish_reason is not None
            if ev.finish_reason is not None:
                slot.end(ev.finish_reason, ev.error, ev.metrics)
            cohort = slot.cohort
            if cohort is None or cohort.is_closed:
                if is_ended:
                    self._on_orphan_end(slot)
                continue
            updates.setdefault(cohort, []).append(MemberUpdate(
                slot.slot_id, is_ended, list(ev.token_ids), ev.text, ev.finish_reason, ev.error))
            if is_ended:
                cohort.members.pop(slot.slot_id, None)
        for cohort, members in updates.items():
            cohort.deliver(CohortEvent(self.num_steps, members))
            cohort.maybe_end()
        return pairs
