"""StageCore: the slot lifecycle of the Stage contract over the kit, for any stepper.

A stage subclasses it and supplies what is its own: what Admit derives and Prepare builds,
how a prepared slot's run is submitted to the stepper, what a run that never started must
tell others when it ends, and the keys of a finished slot's Diagnostics. Every slot state
change goes through `SlotMachine.move`, and every place a slot is freed ends in `_forget`.
Every method runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from services.errors import DeadlineExceeded, InvalidArgument, ServiceError, Unavailable
from services.stage.cohort import Cohort, JoinRefusal
from services.stage.ending import FinishReason
from services.stage.slot import Slot, SlotState
from services.stage.slot_machine import Move, SlotMachine, check_slot_id
from services.stage.snapshot import CoreSnapshot, core_diagnostics
from services.stage.step_loop import Pairs, StepLoop
from services.stage.stepper import Stepper

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 16
MAX_WINDOW = 1024
_UNSTARTED = (SlotState.ADMITTED, SlotState.PREPARED)
_RUN_LIVE = (SlotState.RUNNING, SlotState.FINISHING, SlotState.ORPHANED)


class StageCore:
    """Call `start()` before use and `close()` after."""

    def __init__(self, stepper: Stepper, slot_ttl_s: float = 600.0,
                 credit_idle_timeout_s: float = 60.0) -> None:
        self.stepper = stepper
        self.slots = SlotMachine()
        self.slot_ttl_s = slot_ttl_s
        self.credit_idle_timeout_s = credit_idle_timeout_s
        self.is_draining = False
        self._runs: dict[str, Slot] = {}  # runtime id -> slot, from join until forgotten
        self.loop = StepLoop(stepper, self._runs.get, self._run_ended, self._after_step)
        self._reaper: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None

    # ---- what a stage supplies ---------------------------------------------------------
    def _prepare(self, slot: Slot) -> None:
        """Build `slot.prepared` (Prepare); raise a typed error to refuse."""
        raise NotImplementedError

    def _submit(self, slot: Slot) -> None:
        """Hand the prepared run to the stepper (it joins a step soon after)."""
        raise NotImplementedError

    def _unstarted_ended(self, slot: Slot) -> None:
        """A run that never joined a stream ended (cancel, Finish or Reset before Step)."""

    def _finished_diagnostics(self, slot: Slot) -> dict[str, Any]:
        """The keys Diagnostics reports for a finished slot."""
        return {}

    async def _after_step(self, pairs: Pairs) -> None:
        """After each step's delivery (e.g. publish hidden states); may hold the loop."""

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.loop.start()
        loop = asyncio.get_running_loop()
        self._reaper = loop.create_task(self._reap_idle())
        self._watcher = loop.create_task(self._end_starved_streams())

    async def close(self) -> None:
        """Stop the reaper, the credit watcher and the loop. Idempotent."""
        for task in (self._reaper, self._watcher):
            if task is not None:
                task.cancel()
        self._reaper = self._watcher = None
        await self.loop.close()

    def begin_drain(self) -> None:
        """Refuse new admissions (UNAVAILABLE); running requests go on."""
        self.is_draining = True

    async def drain(self, grace_s: float) -> None:
        """Refuse new work, wait up to `grace_s` for started requests to run to their end
        (through Finish and Reset), then cancel whatever still runs."""
        self.begin_drain()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(
                s.state in (*_RUN_LIVE, SlotState.ENDED, SlotState.FINISHED)
                for s in self.slots):
            await asyncio.sleep(0.02)
        live = [s for s in self.slots if s.state in _RUN_LIVE]
        for slot in live:
            self.stepper.cancel(slot.runtime_id)
        self.loop.wake()
        for slot in live:
            try:
                await asyncio.wait_for(slot.run.ended_signal.wait(), 5.0)
            except TimeoutError:
                log.warning("slot %d did not end while draining", slot.slot_id)

    # ---- the contract --------------------------------------------------------------------
    def check_admit(self, slot_id: int) -> None:
        """Admit's preconditions: a free slot id on a stage that is not draining."""
        check_slot_id(slot_id)
        if self.is_draining:
            raise Unavailable("the stage is draining; send new requests elsewhere")
        self.slots.check_free(slot_id)

    def prepare(self, slot_id: int, call_ctx: Any = None) -> Slot:
        """Build the slot's run; it becomes PREPARED. `call_ctx`: the call's trace context."""
        slot = self.slots.require(slot_id, "Prepare")
        t0 = time.perf_counter()
        self._prepare(slot)
        self.slots.move(slot, Move.PREPARE)
        slot.telemetry.prepare_ms = (time.perf_counter() - t0) * 1000.0
        return slot

    def open_cohort(self, join: Sequence[int], credits: int,
                    member_credits: Mapping[int, int] | None = None) -> Cohort:
        """A new Step stream. Every slot in `join` must be PREPARED, or nothing happens."""
        if len(set(join)) != len(join):
            raise InvalidArgument("join names a slot twice")
        slots = [self.slots.require(sid, "Step") for sid in join]
        cohort = Cohort(MAX_WINDOW, self.loop.wake)
        cohort.grant(credits or DEFAULT_WINDOW)
        self.loop.cohorts.add(cohort)
        for slot in slots:
            self._enter(cohort, slot)
        self.grant(cohort, 0, member_credits)
        return cohort

    def join(self, cohort: Cohort, join: Sequence[int]) -> None:
        """Join more slots to a running stream; a slot that may not join is refused in-band."""
        for sid in join:
            try:
                self._enter(cohort, self.slots.require(sid, "Step"))
            except ServiceError as exc:
                cohort.refuse(JoinRefusal(sid, exc.code, exc.message))

    def grant(self, cohort: Cohort, credits: int,
              member_credits: Mapping[int, int] | None = None) -> None:
        """More credits for the stream and for members' own windows."""
        if credits:
            cohort.grant(credits)
        if member_credits:
            for sid, n in member_credits.items():
                cohort.grant_member(sid, n)
            self.loop.wake()

    def close_cohort(self, cohort: Cohort, is_broken: bool) -> None:
        """The stream ended. Members whose run ended (ENDED) await Finish however it ended:
        a client may break its stream once it has read every end and still call Finish. After
        a break (disconnect, deadline, error) members still running are cancelled and freed
        when their run ends (ORPHANED); an ended member nobody finishes is the slot TTL's."""
        if not cohort.is_closed:
            cohort.is_closed = True
            self.loop.cohorts.discard(cohort)
        if is_broken:
            for slot in list(cohort.joined.values()):
                if self.slots.get(slot.slot_id) is slot and slot.state is SlotState.RUNNING:
                    self.slots.move(slot, Move.ORPHAN)
                    self.stepper.cancel(slot.runtime_id)
        self.loop.wake()

    def cancel(self, slot_id: int) -> tuple[str, bool]:
        """Ask the slot's run to stop; returns its contract state and whether it still ran."""
        slot = self.slots.require(slot_id, "Cancel")
        if not slot.state.is_live:
            return slot.state.wire, False
        tel = slot.telemetry
        tel.t_cancel_ns = tel.t_cancel_ns or time.time_ns()
        if slot.state in _RUN_LIVE:
            self.stepper.cancel(slot.runtime_id)
            self.loop.wake()
        else:
            self._end_unstarted(slot, FinishReason.CANCELLED)
            self.slots.move(slot, Move.CANCEL_UNSTARTED)
        return slot.state.wire, True

    async def finish(self, slot_id: int, reason: FinishReason | None,
                     call_ctx: Any = None) -> Slot:
        """End the slot's run (stopping it if needed); the slot becomes FINISHED."""
        slot = self.slots.require(slot_id, "Finish")
        if slot.state in (SlotState.RUNNING, SlotState.ORPHANED):
            self.slots.move(slot, Move.FINISH)  # FINISHING until the run's end arrives
            self.stepper.cancel(slot.runtime_id)
            self.loop.wake()
            await slot.run.ended_signal.wait()  # _run_ended moves it to FINISHED
            if reason is not None and slot.run.ended is FinishReason.CANCELLED:
                slot.run.ended = reason
        else:
            if slot.state in _UNSTARTED:
                self._end_unstarted(slot, reason or FinishReason.CANCELLED)
            self.slots.move(slot, Move.FINISH)
        self._forget(slot)
        slot.diagnostics = self._finished_diagnostics(slot)
        return slot

    def slot_diagnostics(self, slot_id: int) -> dict[str, Any]:
        return dict(self.slots.require(slot_id, "Diagnostics").diagnostics)

    def reset(self, slot_id: int) -> bool:
        """Drop the slot; False when it did not exist. Not allowed while its run runs."""
        check_slot_id(slot_id)
        if self.slots.get(slot_id) is None:
            return False
        slot = self.slots.require(slot_id, "Reset")
        if slot.state in _UNSTARTED:
            self._end_unstarted(slot, FinishReason.CANCELLED)
        self.slots.move(slot, Move.RESET)
        self._forget(slot)
        return True

    def stage_diagnostics(self) -> dict[str, Any]:
        """Stage-wide Diagnostics (no slot): the state accounting."""
        return core_diagnostics(self.core_snapshot())

    def core_snapshot(self) -> CoreSnapshot:
        return CoreSnapshot(
            num_slots=len(self.slots), slots_by_state=self.slots.count(),
            num_cohorts=len(self.loop.cohorts),
            num_cohort_slots=sum(len(c.joined) for c in self.loop.cohorts),
            num_runs_indexed=len(self._runs), num_steps=self.loop.num_steps,
            is_draining=self.is_draining)

    # ---- internals -----------------------------------------------------------------------
    def _enter(self, cohort: Cohort, slot: Slot) -> None:
        self._submit(slot)
        self.slots.move(slot, Move.JOIN)
        slot.telemetry.t_join_ns = time.time_ns()
        slot.run.cohort = cohort
        cohort.add(slot)
        self._runs[slot.runtime_id] = slot
        self.loop.wake()

    def _end_unstarted(self, slot: Slot, reason: FinishReason) -> None:
        if slot.run.end(reason):
            self._unstarted_ended(slot)

    def _run_ended(self, slot: Slot) -> None:
        """The step loop saw the run's end (its record is written)."""
        if not self.slots.can_move(slot, Move.RUN_END):
            log.error("run of slot %d ended in state %s", slot.slot_id, slot.state.value)
            return
        if self.slots.move(slot, Move.RUN_END) is None:
            self._forget(slot)
            log.info("slot %d (request %s) freed after its Step stream broke (%s)",
                     slot.slot_id, slot.request.request_id, slot.run.ended)

    def _forget(self, slot: Slot) -> None:
        """The run is over for good: drop every index that points at the slot. A shared Step
        stream lives for many requests, so its cohort must not keep the slots it served."""
        self._runs.pop(slot.runtime_id, None)
        if isinstance(slot.run.cohort, Cohort):
            slot.run.cohort.forget(slot)

    async def _end_starved_streams(self) -> None:
        """End every Step stream whose members wait on credit its client has not granted for
        credit_idle_timeout_s: its members are held meanwhile, and a client that never reads
        must not hold their slots and KV pages for ever."""
        limit = self.credit_idle_timeout_s
        while True:
            await asyncio.sleep(max(0.02, limit / 8))
            now = time.monotonic()
            for cohort in list(self.loop.cohorts):
                since = cohort.starved_since
                if since is not None and now - since > limit and not cohort.is_closed:
                    log.warning("a Step stream granted no credit for %.1f s; ending it", limit)
                    cohort.fail(DeadlineExceeded(
                        f"the Step stream granted no credit for {limit:g} s "
                        "(creditIdleTimeoutS) while its members waited; it is ended and its "
                        "members cancelled"))

    async def _reap_idle(self) -> None:
        """Free slots nobody touched for slot_ttl_s (a caller that vanished between calls)."""
        while True:
            await asyncio.sleep(max(0.05, self.slot_ttl_s / 4))
            for slot in self.slots.idle_since(time.monotonic() - self.slot_ttl_s):
                log.warning("slot %d idle for %.0f s in %s; dropped", slot.slot_id,
                            self.slot_ttl_s, slot.state.value)
                if slot.state in _UNSTARTED:
                    self._end_unstarted(slot, FinishReason.CANCELLED)
                self.slots.move(slot, Move.EXPIRE)
                self._forget(slot)
