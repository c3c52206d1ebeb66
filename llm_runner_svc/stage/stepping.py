"""Cohorts (the members of one Step stream) and the stage's own decode loop.

A decode thread (`decode_thread.py`) runs `runtime.step()` on its own, one step after another,
while the runtime has work, fewer than MAX_IN_FLIGHT of its results wait to be delivered and
published, and every cohort with live members holds more credits than the results not yet
delivered. It hands each result to the event loop without waiting; there, in step order, the
runtime's per-request events become one `CohortEvent` per cohort, then the step is published
to the hidden port, then the thread may start more. So an accelerator is not left idle while
Python turns a step into messages. A cohort that is out of credit holds decoding: the slow
reader slows decoding instead of growing a queue; a blocking hidden-port subscriber holds it
too (through MAX_IN_FLIGHT). Cancels still land while readers hold decoding: the thread then
runs `runtime.apply_cancels()` (only terminal updates, at most one per member). Everything
here runs on the event loop thread, which recomputes the thread's permission on every
delivered result, grant, join, refused join, closed cohort and `wake()`; the decode thread only
posts its results (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from llm_runner_svc.errors import Internal, ResourceExhausted, RunnerError
from llm_runner_svc.runtime import FinishReason, InferenceRuntime, StepEvent
from llm_runner_svc.stage.decode_thread import DecodeThread, Result
from llm_runner_svc.stage.slots import Slot

log = logging.getLogger(__name__)

MAX_PENDING_REFUSALS = 1024
# Results of the decode thread not yet delivered and published: with two, a cancel lands
# within two steps of the last one delivered and a blocking subscriber still holds decoding.
MAX_IN_FLIGHT = 2


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
            self._wake()  # the refusal spent a credit

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
    """Drives the decode thread for every cohort of the stage and delivers what it steps."""

    def __init__(self, runtime: InferenceRuntime, resolve: Callable[[str], Slot | None],
                 on_orphan_end: Callable[[Slot], None],
                 publish: Callable[[list[tuple[Slot, StepEvent]]], Awaitable[None]]) -> None:
        self.runtime = runtime
        self.cohorts: set[Cohort] = set()
        self.num_steps = 0
        self._resolve = resolve
        self._on_orphan_end = on_orphan_end
        self._publish = publish  # hidden states; may hold the loop (a blocking subscriber)
        self._thread: DecodeThread | None = None
        self._task: asyncio.Task[None] | None = None
        self._dispatched = 0  # results of the decode thread routed to their cohorts
        self._handled = 0  # ... and published

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[Result] = asyncio.Queue()
        self._dispatched = self._handled = 0
        self._thread = DecodeThread(
            self.runtime, lambda result: loop.call_soon_threadsafe(results.put_nowait, result))
        self._permit()
        self._thread.start()
        self._task = loop.create_task(self._deliver(results), name="step-loop")

    async def close(self) -> None:
        """Stop the decode thread (a step in progress ends first), then the delivery."""
        if self._thread is not None:
            self._thread.stop()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        """Work, credits or members changed (event loop thread): recompute the permission;
        after a failed step, let the decode thread try again."""
        self._permit(resume=True)

    def _permit(self, resume: bool = False) -> None:
        """At most MAX_IN_FLIGHT results not yet handled; a step only while every cohort with
        live members holds more credits than the results not yet dispatched."""
        if self._thread is None:
            return
        job_limit = self._handled + MAX_IN_FLIGHT
        credits = [c.credits for c in self.cohorts if c.members and not c.is_closed]
        step_limit = min(job_limit, self._dispatched + min(credits)) if credits else job_limit
        self._thread.permit(step_limit, job_limit, resume)

    async def _deliver(self, results: asyncio.Queue[Result]) -> None:
        """The decode thread's results in order: dispatch, then publish, then permit more."""
        while True:
            result = await results.get()
            pairs: list[tuple[Slot, StepEvent]] | None = None
            if isinstance(result, Exception):
                for cohort in list(self.cohorts):
                    cohort.fail(Internal(f"decode loop failed: {result}"))
            else:
                pairs = self._dispatch(result)
            self._dispatched += 1
            self._permit()
            try:
                if pairs is not None:
                    await self._publish(pairs)
            except Exception:
                log.exception("publishing a step failed")
            self._handled += 1
            self._permit()

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
