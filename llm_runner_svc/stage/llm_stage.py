"""LlmStage: the LlmRunner adapter. It owns admission, the slot lifecycle and cancellation;
the runtime owns decoding. Every method runs on the server's event loop thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from opentelemetry.trace import Status, StatusCode

from llm_runner_svc.engines import create_engine
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, RunnerError, Unavailable
from llm_runner_svc.models import Model, load_model
from llm_runner_svc.runtime import FinishReason, InferenceRuntime, RuntimeConfig, StepEvent
from llm_runner_svc.stage.admission import (
    Admission,
    Refused,
    build_runtime_request,
    check_load,
    check_prompt,
    check_request,
    tokenize,
)
from llm_runner_svc.stage.config import StageConfig
from llm_runner_svc.stage.describe import StageDescription, describe
from llm_runner_svc.stage.diagnostics import slot_diagnostics, stage_diagnostics
from llm_runner_svc.stage.faults import FaultyRuntime, faults_from_env
from llm_runner_svc.stage.metrics import StageMetrics
from llm_runner_svc.stage.publish import HiddenPublisher, Subscriber
from llm_runner_svc.stage.publish_step import publish_step
from llm_runner_svc.stage.request import StageRequest
from llm_runner_svc.stage.slots import Slot, SlotState, SlotTable, check_slot_id
from llm_runner_svc.stage.stepping import Cohort, JoinRefusal, StepLoop
from llm_runner_svc.stage.tracing import call_span, run_spans

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 16
MAX_WINDOW = 1024


class LlmStage:
    """The stage behind the Stage service. Call `start()` before use and `close()` after."""

    def __init__(self, config: StageConfig, model: Model, runtime: InferenceRuntime,
                 slot_ttl_s: float = 600.0, max_message_bytes: int = 16 << 20) -> None:
        self.config = config
        self.model = model
        self.runtime = runtime
        self.slots = SlotTable()
        self.slot_ttl_s = slot_ttl_s
        self.is_draining = False
        self._by_runtime_id: dict[str, Slot] = {}
        self.hidden = HiddenPublisher(config.hidden_policy, config.hidden_buffer,
                                      max_message_bytes, config.shm_ring_bytes)
        self.loop = StepLoop(runtime, self._by_runtime_id.get, self._reap_orphan,
                             self._after_step)
        self.metrics = StageMetrics(self)
        self._reaper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # port ends and closes sent on the side

    @classmethod
    def create(cls, config: StageConfig, slot_ttl_s: float = 600.0,
               max_message_bytes: int = 16 << 20) -> LlmStage:
        """Load the model and build the engine and runtime the config names."""
        model = load_model(config.artifact)
        engine = create_engine(config.engine, model.config, model.weights,
                               **config.engine_options())
        hidden = config.accept_hidden_layer if config.has_hidden_port else None
        rt_config = RuntimeConfig(
            max_batch=config.max_batch, max_seq=config.max_seq, max_waiting=config.max_waiting,
            hidden_layer=hidden, sampling=config.sampling)
        faults = faults_from_env()
        runtime = InferenceRuntime(engine, model.tokenizer, rt_config) if faults is None \
            else FaultyRuntime(faults, engine, model.tokenizer, rt_config)
        return cls(config, model, runtime, slot_ttl_s, max_message_bytes)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Preallocate every buffer, then start the decode loop and the slot reaper."""
        await asyncio.get_running_loop().run_in_executor(None, self.runtime.preallocate)
        self.loop.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())

    async def close(self) -> None:
        """Stop the loop and release the runtime. Idempotent."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        await self.loop.close()
        await self.hidden.close()
        self.runtime.close()

    def begin_drain(self) -> None:
        """Refuse new admissions (UNAVAILABLE); running requests go on."""
        self.is_draining = True

    async def drain(self, grace_s: float) -> None:
        """Refuse new work, wait up to `grace_s` for started requests to run to their end
        (through Finish and Reset), then cancel whatever still decodes."""
        self.begin_drain()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(
                s.state in (SlotState.RUNNING, SlotState.FINISHED) for s in self.slots):
            await asyncio.sleep(0.02)
        for slot in self._live_runs():
            self.runtime.cancel(slot.runtime_id)
        self.loop.wake()
        for slot in self._live_runs():
            try:
                await asyncio.wait_for(slot.ended_signal.wait(), 5.0)
            except TimeoutError:
                log.warning("slot %d did not end while draining", slot.slot_id)

    # ---- the contract ----------------------------------------------------------------
    def describe(self) -> StageDescription:
        return describe(self.config, self.model, self.runtime, MAX_WINDOW)

    def admit(self, slot_id: int, request: StageRequest, call_ctx: Any = None,
              request_ctx: Any = None) -> Admission:
        """Admit `request` into a new slot, or refuse it; a refusal allocates nothing.
        `call_ctx` / `request_ctx`: trace contexts of the call and of the request."""
        span = call_span("admit", call_ctx or request_ctx, self.config.stage_id, slot_id,
                         request.request_id)
        try:
            adm = self._admit(slot_id, request)
            span.set_attributes({"llmstage.admitted": adm.is_admitted,
                                 "gen_ai.usage.input_tokens": adm.prompt_tokens})
            if adm.refusal is not None:
                span.set_attributes({"llmstage.refusal": adm.refusal.value,
                                     "llmstage.refusal_reason": adm.reason})
                self.metrics.refused.labels(adm.refusal.value).inc()
            else:
                slot = self.slots.get(slot_id)
                if slot is not None:
                    slot.request_ctx = request_ctx or call_ctx
            return adm
        except RunnerError as exc:
            span.set_status(Status(StatusCode.ERROR, f"{exc.code}: {exc.message}"))
            raise
        finally:
            span.end()

    def _admit(self, slot_id: int, request: StageRequest) -> Admission:
        t0 = time.perf_counter()
        check_slot_id(slot_id)
        if self.is_draining:
            raise Unavailable("the stage is draining; send new requests elsewhere")
        if self.slots.get(slot_id) is not None:
            self.slots.add(Slot(slot_id, request, ()))  # raises FailedPrecondition
        num_live = sum(1 for s in self.slots if s.state is not SlotState.FINISHED)
        try:
            check_request(self.config, self.model, request, num_live)
            prompt_ids = tokenize(self.model, request)
            check_prompt(self.model, self.runtime, prompt_ids)
            check_load(self.config, self.runtime.max_seq, self.slots, self.runtime.num_waiting,
                       request, len(prompt_ids))
        except Refused as refused:
            return Admission(False, refused.refusal, refused.reason)
        slot = Slot(slot_id, request, prompt_ids)
        slot.admit_ms = (time.perf_counter() - t0) * 1000.0
        self.slots.add(slot)
        return Admission(True, prompt_tokens=len(prompt_ids))

    def prepare(self, slot_id: int, call_ctx: Any = None) -> Slot:
        """Resolve sampling and build the runtime request; the slot becomes PREPARED."""
        t0 = time.perf_counter()
        slot = self.slots.require(slot_id, "Prepare")
        call_span("prepare", call_ctx or slot.request_ctx, self.config.stage_id, slot_id,
                  slot.request.request_id).end()
        slot.runtime_request, slot.seed = build_runtime_request(self.runtime, slot)
        slot.state = SlotState.PREPARED
        slot.prepare_ms = (time.perf_counter() - t0) * 1000.0
        return slot

    def open_cohort(self, join: Sequence[int], credits: int) -> Cohort:
        """A new Step stream. Every slot in `join` must be PREPARED, or nothing happens."""
        if len(set(join)) != len(join):
            raise InvalidArgument("join names a slot twice")
        slots = [self.slots.require(sid, "Step") for sid in join]
        cohort = Cohort(MAX_WINDOW, self.loop.wake)
        cohort.grant(credits or DEFAULT_WINDOW)
        self.loop.cohorts.add(cohort)
        for slot in slots:
            self._enter(cohort, slot)
        return cohort

    def join(self, cohort: Cohort, join: Sequence[int]) -> None:
        """Join more slots to a running stream; a slot that may not join is refused in-band."""
        for sid in join:
            try:
                self._enter(cohort, self.slots.require(sid, "Step"))
            except RunnerError as exc:
                cohort.refuse(JoinRefusal(sid, exc.code, exc.message))

    def close_cohort(self, cohort: Cohort, is_broken: bool) -> None:
        """The stream ended. After a clean end its members await Finish as usual; after a
        break (disconnect, deadline, error) nobody will call Finish, so members still running
        are cancelled and every member is finished and freed here."""
        if cohort.is_closed:
            return
        cohort.is_closed = True
        self.loop.cohorts.discard(cohort)
        if not is_broken:
            self.loop.wake()  # a closed cohort no longer holds decoding
            return
        for slot in cohort.joined.values():
            if slot.state is not SlotState.RUNNING or self.slots.get(slot.slot_id) is not slot:
                continue
            if slot.ended is None:
                self.runtime.cancel(slot.runtime_id)
            else:
                self._reap_orphan(slot)
        self.loop.wake()

    def cancel(self, slot_id: int) -> tuple[SlotState, bool]:
        """Ask the slot's run to stop; returns its state and whether it was still running."""
        slot = self.slots.require(slot_id, "Cancel")
        if slot.ended is not None:
            return slot.state, False
        slot.t_cancel_ns = slot.t_cancel_ns or time.time_ns()
        if slot.state is SlotState.RUNNING:
            self.runtime.cancel(slot.runtime_id)
            self.loop.wake()
        else:
            self._end_unstarted(slot, FinishReason.CANCELLED)
        return slot.state, True

    async def finish(self, slot_id: int, reason: FinishReason | None,
                     call_ctx: Any = None) -> Slot:
        """End the slot's run (stopping it if needed); the slot becomes FINISHED."""
        slot = self.slots.require(slot_id, "Finish")
        span = call_span("finish", call_ctx or slot.request_ctx, self.config.stage_id, slot_id,
                         slot.request.request_id)
        try:
            return await self._finish(slot, reason)
        finally:
            span.add_event("finish", {"llmstage.finish_reason":
                                      slot.ended.value if slot.ended else "unknown"})
            span.end()

    async def _finish(self, slot: Slot, reason: FinishReason | None) -> Slot:
        slot_id = slot.slot_id
        if slot.is_finishing:
            raise FailedPrecondition(f"Finish is not allowed: slot {slot_id} is "
                                     f"{slot.state.value} and already being finished")
        slot.is_finishing = True
        if slot.ended is None:
            if slot.state is SlotState.RUNNING:
                self.runtime.cancel(slot.runtime_id)
                self.loop.wake()
                await slot.ended_signal.wait()
                if reason is not None and slot.ended is FinishReason.CANCELLED:
                    slot.ended = reason
            else:
                self._end_unstarted(slot, reason or FinishReason.CANCELLED)
        slot.state = SlotState.FINISHED
        self._forget_run(slot)
        slot.diagnostics = slot_diagnostics(slot, self.config)
        return slot

    def diagnostics(self, slot_id: int | None) -> dict[str, Any]:
        if slot_id is None:
            return stage_diagnostics(self)
        return dict(self.slots.require(slot_id, "Diagnostics").diagnostics)

    def reset(self, slot_id: int) -> bool:
        """Drop the slot; False when it did not exist. Not allowed while RUNNING."""
        check_slot_id(slot_id)
        if self.slots.get(slot_id) is None:
            return False
        slot = self.slots.require(slot_id, "Reset")
        self._end_unstarted(slot, FinishReason.CANCELLED)
        self.slots.remove(slot_id)
        return True

    async def subscribe(self, request_id: str | None, port: str, use_shm: bool
                        ) -> Subscriber:
        """A subscription to the hidden port of one request (it may not exist yet) or all."""
        if port != "hidden":
            raise InvalidArgument(f"port {port!r} cannot be subscribed to (only 'hidden')")
        if not self.config.has_hidden_port:
            raise FailedPrecondition("this deployment declares no hidden port (add 'hidden' to "
                                     "emits)")
        if request_id == "":
            raise InvalidArgument("Subscribe needs a request_id or all_requests")
        return await self.hidden.subscribe(request_id, use_shm)

    def unsubscribe(self, sub: Subscriber) -> None:
        """The subscriber went. Closing it also releases a decode loop held on its full
        buffer (policy block), which would otherwise wait for a reader that never comes."""
        self.hidden.unsubscribe(sub)
        self._spawn(sub.close())

    @property
    def num_runs_indexed(self) -> int:
        """Runs the step loop can still route events to (RUNNING slots not yet finished)."""
        return len(self._by_runtime_id)

    # ---- internals -------------------------------------------------------------------
    async def _after_step(self, pairs: list[tuple[Slot, StepEvent]]) -> None:
        """After every step: spans of the runs that ended, then the hidden port."""
        for slot, ev in pairs:
            if ev.finish_reason is not None:
                run_spans(slot, self.config.stage_id)
                self.metrics.run_ended(slot)
        self.hidden.begin_step()
        try:
            await publish_step(self.hidden, pairs)
        finally:
            await self.hidden.flush_step()

    def _enter(self, cohort: Cohort, slot: Slot) -> None:
        assert slot.runtime_request is not None
        self.runtime.submit(slot.runtime_request)
        slot.state = SlotState.RUNNING
        slot.t_join_ns = time.time_ns()
        slot.cohort = cohort
        cohort.add(slot)
        self._by_runtime_id[slot.runtime_id] = slot
        self.loop.wake()

    def _end_unstarted(self, slot: Slot, reason: FinishReason) -> None:
        """End a run that never joined a cohort. Its hidden-port subscribers still get their
        terminal message, or a subscriber that came early would wait forever."""
        if slot.ended is not None or slot.state is SlotState.RUNNING:
            return
        slot.end(reason)
        if slot.request.wants_hidden:
            self._spawn(self.hidden.end(slot.request.request_id, reason.value, None))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget_run(self, slot: Slot) -> None:
        """The run is over for good: drop every index that points at the slot. A shared Step
        stream lives for many requests, so its cohort must not keep the slots it served."""
        self._by_runtime_id.pop(slot.runtime_id, None)
        cohort = slot.cohort
        if cohort is not None and cohort.joined.get(slot.slot_id) is slot:
            del cohort.joined[slot.slot_id]

    def _live_runs(self) -> list[Slot]:
        return [s for s in self.slots if s.state is SlotState.RUNNING and s.ended is None]

    def _reap_orphan(self, slot: Slot) -> None:
        """A member whose stream is gone ended: finish it as the stage saw it and free it."""
        slot.state = SlotState.FINISHED
        self._forget_run(slot)
        if self.slots.get(slot.slot_id) is slot:
            self.slots.remove(slot.slot_id)
        log.info("slot %d (request %s) freed after its Step stream closed (%s)",
                 slot.slot_id, slot.request.request_id, slot.ended)

    async def _reap_idle(self) -> None:
        """Drop slots nobody touched for slot_ttl_s (a caller that vanished between calls)."""
        while True:
            await asyncio.sleep(max(0.05, self.slot_ttl_s / 4))
            cutoff = time.monotonic() - self.slot_ttl_s
            for slot in self.slots:
                is_idle = slot.state is not SlotState.RUNNING or (
                    slot.ended is not None and (slot.cohort is None or slot.cohort.is_closed))
                if is_idle and slot.touched_at < cutoff:
                    log.warning("slot %d idle for %.0f s in %s; dropped", slot.slot_id,
                                self.slot_ttl_s, slot.state.value)
                    self._end_unstarted(slot, FinishReason.CANCELLED)
                    self._reap_orphan(slot)
