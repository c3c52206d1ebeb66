"""The stage's own decode loop over a `Stepper`, and the delivery of each step to its cohorts.

A decode thread (`decode_thread.py`) steps on its own while the stepper has work and fewer
than MAX_IN_FLIGHT of its results wait to be delivered and handled. It hands each result to
the event loop without waiting; there, in step order, the runs' events become one
`CohortEvent` per cohort, then `after_step` runs (the hidden port), then the thread may start
more. So an accelerator is not left idle while Python turns a step into messages.

Readers' credits hold runs, not the loop: a member whose stream or own window is out of
credit is left out of the next steps until credits arrive, while every other run goes on. A
slow `after_step` (a blocking hidden-port subscriber) holds the whole loop, through
MAX_IN_FLIGHT. Cancels still land: a cancel pending is a job of its own. Everything here runs
on the event loop thread, which recomputes the thread's permission on every delivered
result, grant, join, refused join, closed cohort and `wake()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from services.errors import Internal
from services.stage.cohort import LOW_WINDOW, Cohort, CohortEvent, MemberUpdate
from services.stage.decode_thread import DecodeThread, Result
from services.stage.slot import Slot
from services.stage.stepper import RunEvent, Stepper

log = logging.getLogger(__name__)

# Results of the decode thread not yet delivered and handled: with two, a cancel lands
# within two steps of the last one delivered and a blocking subscriber still holds decoding.
MAX_IN_FLIGHT = 2
assert MAX_IN_FLIGHT <= LOW_WINDOW

Pairs = list[tuple[Slot, RunEvent]]


class StepLoop:
    """Drives the decode thread for every cohort of the stage and delivers what it steps."""

    def __init__(self, stepper: Stepper, resolve: Callable[[str], Slot | None],
                 on_run_end: Callable[[Slot], None],
                 after_step: Callable[[Pairs], Awaitable[None]]) -> None:
        self.stepper = stepper
        self.cohorts: set[Cohort] = set()
        self.num_steps = 0
        self._resolve = resolve
        self._on_run_end = on_run_end  # a run ended (its slot's record is already written)
        self._after_step = after_step  # may hold the loop (a blocking subscriber)
        self._thread: DecodeThread | None = None
        self._task: asyncio.Task[None] | None = None
        self._dispatched = 0  # results of the decode thread routed to their cohorts
        self._handled = 0  # ... and handled by after_step

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[Result] = asyncio.Queue()
        self._dispatched = self._handled = 0
        self._thread = DecodeThread(
            self.stepper, lambda result: loop.call_soon_threadsafe(results.put_nowait, result))
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
        """At most MAX_IN_FLIGHT results not yet handled; a member only in steps its
        credits cover beyond the results not yet dispatched."""
        if self._thread is None:
            return
        # Results not yet dispatched are fewer than MAX_IN_FLIGHT, so only a member with at
        # most that many events available can be at its limit: the rest need no entry.
        limits = {slot.runtime_id: self._dispatched + available
                  for cohort in self.cohorts if not cohort.is_closed
                  for slot, available in cohort.low_members()}
        self._thread.permit(self._handled + MAX_IN_FLIGHT, limits, resume)

    async def _deliver(self, results: asyncio.Queue[Result]) -> None:
        """The decode thread's results in order: dispatch, then handle, then permit more."""
        while True:
            result = await results.get()
            pairs: Pairs | None = None
            if isinstance(result, Exception):
                for cohort in list(self.cohorts):
                    cohort.fail(Internal(f"decode loop failed: {result}"))
            else:
                pairs = self._dispatch(result)
            self._dispatched += 1
            self._permit()
            try:
                if pairs is not None:
                    await self._after_step(pairs)
            except Exception:
                log.exception("handling a step failed")
            self._handled += 1
            self._permit()

    def _dispatch(self, events: Sequence[RunEvent]) -> Pairs:
        """Route the runs' events to their slots and cohorts; return (slot, event)."""
        self.num_steps += 1
        pairs: Pairs = []
        batch_size = sum(1 for ev in events if ev.token_ids)
        updates: dict[Cohort, list[MemberUpdate]] = {}
        scored: set[Cohort] = set()  # cohorts with a member whose update has log-probabilities
        ended: list[Slot] = []
        for ev in events:
            slot = self._resolve(ev.request_id)
            if slot is None:
                log.error("step event for unknown run %s", ev.request_id)
                continue
            pairs.append((slot, ev))
            run, tel = slot.run, slot.telemetry
            run.output_ids.extend(ev.token_ids)
            if ev.text:
                run.output_text.append(ev.text)
            if ev.token_ids:
                tel.num_steps += 1
                tel.batch_size_sum += batch_size
                tel.max_batch_size = max(tel.max_batch_size, batch_size)
            is_ended = ev.finish_reason is not None
            if ev.finish_reason is not None and run.end(ev.finish_reason, ev.error, ev.metrics):
                ended.append(slot)
            cohort = run.cohort
            if isinstance(cohort, Cohort) and not cohort.is_closed:
                update = MemberUpdate(slot.slot_id, is_ended, list(ev.token_ids), ev.text,
                                      ev.finish_reason, ev.error)
                if ev.logprobs or ev.prompt_logprobs:  # asked for: rare
                    update.logprobs, update.prompt_logprobs = ev.logprobs, ev.prompt_logprobs
                    scored.add(cohort)
                updates.setdefault(cohort, []).append(update)
                if is_ended:
                    cohort.drop(slot.slot_id)
        for cohort, members in updates.items():
            cohort.deliver(CohortEvent(self.num_steps, members, has_scores=cohort in scored))
            cohort.maybe_end()
        for slot in ended:
            self._on_run_end(slot)
        return pairs
