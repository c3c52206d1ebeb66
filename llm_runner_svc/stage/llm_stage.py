"""LlmStage: the LlmRunner adapter over the stage kit. The kit (`services/stage/core.py`) owns
the slot lifecycle, the cohorts and the decode loop; this class adds what is the LLM's own:
admission and tokenization (and compiling a structured output), the runtime request Prepare
builds, the hidden port, and what Diagnostics and metrics report. Every method runs on the
server's event loop thread; only tokenization and compiling a structured output run on a
worker thread (tokenize_worker.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

from opentelemetry.trace import Status, StatusCode

from llm_runner_svc.engines import create_engine, create_vision
from llm_runner_svc.engines.drafts import create_draft_engine
from llm_runner_svc.errors import FailedPrecondition, RunnerError, Unimplemented
from llm_runner_svc.models import Model, load_model
from llm_runner_svc.runtime import FinishReason, InferenceRuntime, StepEvent
from llm_runner_svc.runtime.encoder_cache import EncoderCache
from llm_runner_svc.stage.adapters import AdapterTable
from llm_runner_svc.stage.admission import (
    Admission,
    Refusal,
    Refused,
    build_runtime_request,
    check_constraint,
    check_counts,
    check_features,
    check_load,
    check_prompt,
    check_request,
    tokenize,
)
from llm_runner_svc.stage.config import StageConfig
from llm_runner_svc.stage.describe import StageDescription, describe
from llm_runner_svc.stage.diagnostics import (
    StageSnapshot,
    encoder_values,
    prefix_cache_values,
    slot_diagnostics,
    stage_diagnostics,
)
from llm_runner_svc.stage.faults import runtime_factory_from_env
from llm_runner_svc.stage.images import ImageEncoder, MediaRefused
from llm_runner_svc.stage.limits import RequestSizes
from llm_runner_svc.stage.load_checks import (
    check_multimodal_path,
    check_vision,
    load_adapters,
    read_adapter,
)
from llm_runner_svc.stage.metrics import StageMetrics
from llm_runner_svc.stage.publish import HiddenPublisher, Subscriber
from llm_runner_svc.stage.publish_step import PromptWindows, publish_step
from llm_runner_svc.stage.request import StageRequest
from llm_runner_svc.stage.shm_budget import ShmBudget, ring_bytes_for
from llm_runner_svc.stage.subscriber import check_subscribe
from llm_runner_svc.stage.tokenize_worker import TokenizeWorker
from llm_runner_svc.stage.tokenizing import Tokenized, detokenize, tokenize_alone
from llm_runner_svc.stage.tracing import call_span, run_spans
from services.stage.core import MAX_WINDOW, StageCore
from services.stage.slot import Slot
from services.stage.step_loop import Pairs

log = logging.getLogger(__name__)

# The seed's RuntimeFactory: builds the runtime a stage steps, from its engine and model
# (and the draft engine of a speculative stage, as keyword `draft`).
RuntimeFactory = Callable[..., InferenceRuntime]


class LlmStage(StageCore):
    """The stage behind the Stage service. Call `start()` before use and `close()` after."""

    def __init__(self, config: StageConfig, model: Model, runtime: InferenceRuntime,
                 slot_ttl_s: float = 600.0, max_message_bytes: int = 16 << 20) -> None:
        super().__init__(runtime, slot_ttl_s, config.credit_idle_timeout_s)
        self.config = config
        self.model = model
        self.runtime = runtime
        self.hidden = HiddenPublisher(
            config.hidden_policy, config.hidden_buffer, max_message_bytes,
            ShmBudget(config.shm_ring_bytes or ring_bytes_for(
                model.config.hidden_size, runtime.max_seq, max_message_bytes),
                config.max_shm_subscriptions, config.max_shm_bytes))
        self.prompt_windows = PromptWindows()  # prompts prefilled in part, held back
        self.tokenizer = TokenizeWorker()
        self.images: ImageEncoder | None = None  # a vision-language model's images path
        check_vision(config, model)
        if model.vision is not None and not runtime.engine.supports_embeds:
            raise Unimplemented(f"model {model.name} takes images; the {runtime.engine.name!r} "
                                "engine takes token ids only (the numpy and torch engines "
                                "take images)")
        if model.vision is not None:
            cache = EncoderCache(config.encoder_cache_bytes) \
                if config.encoder_cache_bytes else None
            self.images = ImageEncoder(model, create_vision(runtime.engine, model.vision),
                                       config.limits, cache, config.visual_pruning)
        self.adapters = AdapterTable(config.num_lora_slots,
                                     [name for name, _ in config.lora_adapters])
        self.metrics = StageMetrics(self.snapshot)
        self._tasks: set[asyncio.Task[None]] = set()  # port ends and closes sent on the side

    @classmethod
    def create(cls, config: StageConfig, slot_ttl_s: float = 600.0,
               max_message_bytes: int = 16 << 20,
               runtime_factory: RuntimeFactory | None = None) -> LlmStage:
        """Load the model and build the engine and the runtime (by `runtime_factory`; by
        default the plain runtime, or the faulty one when LLM_RUNNER_FAULTS asks for it)."""
        check_multimodal_path(config)
        model = load_model(config.artifact, config.multimodal_artifact or None)
        options: dict[str, Any] = config.engine_options()
        if config.lora_adapters:  # refused here, naming the file, when one does not fit
            options["adapters"] = load_adapters(config, model)
        engine = create_engine(config.engine, model.config, model.weights, **options)
        if config.num_lora_slots:  # maxLoras slots, claimed now (a draft engine takes none)
            engine.reserve_adapters(config.num_lora_slots, config.max_lora_rank or None)
        spec = config.spec
        draft = None if spec is None else create_draft_engine(
            spec.method, config.engine, model, engine, spec.draft_layers,
            spec.draft_checkpoint, **config.engine_options())
        factory = runtime_factory or runtime_factory_from_env()
        extra = {"draft": draft} if draft is not None else {}
        return cls(config, model, factory(engine, model.tokenizer, config.runtime_config(),
                                          **extra), slot_ttl_s, max_message_bytes)

    async def start(self) -> None:
        """Preallocate every buffer, then start the decode loop and the slot reaper."""
        await asyncio.get_running_loop().run_in_executor(None, self.runtime.preallocate)
        await super().start()

    async def close(self) -> None:
        """Stop the loop and release the runtime. Idempotent."""
        await super().close()
        self.tokenizer.close()
        await self.hidden.close()
        self.prompt_windows.clear()
        self.runtime.close()

    # ---- the contract ----------------------------------------------------------------
    def describe(self) -> StageDescription:
        return describe(self.config, self.model, self.runtime, MAX_WINDOW, self.adapters.names)

    async def load_adapter(self, name: str, path: str) -> list[str]:
        """Load the PEFT adapter at `path` (relative to the artifact) into a free slot as
        `name`; servable once this returns. The files are read on a worker thread; the
        weights enter the engine at the top of the next step. A bad file raises
        (INVALID_ARGUMENT / NOT_FOUND) and changes nothing."""
        slot = self.adapters.reserve(name)
        try:
            adapter = await asyncio.get_running_loop().run_in_executor(
                None, read_adapter, self.config, name, path, self.model)
            self.runtime.set_adapter(slot, adapter)
        except BaseException:
            self.adapters.release(slot)
            raise
        self.adapters.commit(slot)
        log.info("LoRA adapter %s loaded from %s into slot %d", name, path, slot)
        return self.adapters.names

    def unload_adapter(self, name: str) -> list[str]:
        """Stop serving `name` and empty its slot; FailedPrecondition while a request that
        names it has not finished."""
        slot = self.adapters.slot_of(name)
        users = [s.slot_id for s in self.slots
                 if s.request.lora == name and s.state.wire != "FINISHED"]
        if users:
            raise FailedPrecondition(f"LoRA adapter {name!r} is in use by {len(users)} "
                                     f"unfinished request(s) (slots {users[:8]})")
        self.adapters.remove(name)
        self.runtime.set_adapter(slot, None)
        log.info("LoRA adapter %s unloaded from slot %d", name, slot)
        return self.adapters.names

    async def admit(self, slot_id: int, request: StageRequest, call_ctx: Any = None,
                    request_ctx: Any = None) -> Admission:
        """Admit `request` into a new slot, or refuse it; a refusal allocates nothing.
        The prompt is tokenized on a worker thread; the slot exists only once it is admitted.
        `call_ctx` / `request_ctx`: trace contexts of the call and of the request."""
        span = call_span("admit", call_ctx or request_ctx, self.config.stage_id, slot_id,
                         request.request_id)
        try:
            adm = await self._admit(slot_id, request, request_ctx or call_ctx)
            span.set_attributes({"llmstage.admitted": adm.is_admitted,
                                 "gen_ai.usage.input_tokens": adm.prompt_tokens})
            if adm.refusal is not None:
                span.set_attributes({"llmstage.refusal": adm.refusal.value,
                                     "llmstage.refusal_reason": adm.reason})
                self.metrics.refused.labels(adm.refusal.value).inc()
            return adm
        except RunnerError as exc:
            span.set_status(Status(StatusCode.ERROR, f"{exc.code}: {exc.message}"))
            raise
        finally:
            span.end()

    def refuse_oversized(self, slot_id: int, sizes: RequestSizes) -> Admission | None:
        """Admit's first step, on counts read off the wire message before it is converted:
        the refusal of a request carrying more than this stage takes, else None (then
        `admit`). A taken slot id or a draining stage raises as Admit does."""
        self.check_admit(slot_id)
        try:
            check_counts(self.config.limits, self.runtime.max_seq, sizes)
        except Refused as refused:
            self.metrics.refused.labels(refused.refusal.value).inc()
            return Admission(False, refused.refusal, refused.reason)
        return None

    async def _admit(self, slot_id: int, request: StageRequest, request_ctx: Any) -> Admission:
        t0 = time.perf_counter()
        self.check_admit(slot_id)
        # Admits still tokenizing count against the capacity, which bounds the worker's queue.
        num_live = (sum(1 for s in self.slots if s.state.wire != "FINISHED")
                    + self.tokenizer.num_pending)
        self.tokenizer.claim(slot_id)
        try:
            check_request(self.config, self.model, self.runtime.max_seq, request, num_live,
                          self.adapters.names)
            check_features(self.runtime, request)
            if self.images is not None:
                self.images.check_types(request)
            prompt_ids = await self.tokenizer.run(lambda: self._tokenize(request))
            self.check_admit(slot_id)  # the stage may have begun to drain meanwhile
            check_prompt(self.model, self.runtime, prompt_ids)
            check_load(self.config, self.runtime.max_seq, self.slots, self.runtime.num_waiting,
                       request, len(prompt_ids))
            slot = Slot(slot_id, request, admitted=prompt_ids)
            slot.telemetry.request_ctx = request_ctx
            slot.telemetry.admit_ms = (time.perf_counter() - t0) * 1000.0
            self.slots.admit(slot)
            if request.wants_hidden:
                self.hidden.request_started(request.request_id)
        except Refused as refused:
            return Admission(False, refused.refusal, refused.reason)
        except MediaRefused as refused:
            return Admission(False, Refusal.MEDIA_INVALID, str(refused))
        finally:
            self.tokenizer.release(slot_id)
        return Admission(True, prompt_tokens=len(prompt_ids))

    def _tokenize(self, request: StageRequest) -> tuple[int, ...]:
        """The prompt's token ids; with a vision tower, its images encoded and placed
        (images.py). Its structured output is compiled first (Refused when it does not).
        Runs on the worker thread."""
        if request.constraint is not None:
            check_constraint(self.runtime, request.constraint)
        ids = tokenize(self.model, request)
        return self.images.admit(request, ids) if self.images is not None else ids

    async def tokenize(self, request: StageRequest | None, add_special_tokens: bool
                       ) -> Tokenized:
        """Tokenize: the prompt's ids as Admit would take them (None: the empty text), on a
        thread of its own; no slot, nothing changed (tokenizing.py)."""
        return await asyncio.to_thread(tokenize_alone, self.model, self.config.limits,
                                       self.runtime.max_seq, request, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        """Detokenize: the ids' text, special tokens included."""
        return detokenize(self.model, token_ids)

    def prepare(self, slot_id: int, call_ctx: Any = None) -> Slot:
        slot = super().prepare(slot_id, call_ctx)
        call_span("prepare", call_ctx or slot.telemetry.request_ctx, self.config.stage_id,
                  slot_id, slot.request.request_id).end()
        return slot

    async def finish(self, slot_id: int, reason: FinishReason | None,
                     call_ctx: Any = None) -> Slot:
        slot = self.slots.require(slot_id, "Finish")
        span = call_span("finish", call_ctx or slot.telemetry.request_ctx,
                         self.config.stage_id, slot_id, slot.request.request_id)
        try:
            return await super().finish(slot_id, reason)
        finally:
            ended = slot.run.ended
            span.add_event("finish", {"llmstage.finish_reason":
                                      ended.value if ended else "unknown"})
            span.end()

    def stage_diagnostics(self) -> dict[str, Any]:
        return stage_diagnostics(self.snapshot())

    def snapshot(self) -> StageSnapshot:
        """The stage-wide state Diagnostics and metrics report."""
        rt, pub = self.runtime, self.hidden
        return StageSnapshot.build(
            self.core_snapshot(), self.config, list(self.slots), max_seq=rt.max_seq,
            kv_pages_total=rt.pages.num_pages, kv_pages_free=rt.pages.num_free,
            **prefix_cache_values(rt.prefix_cache), **encoder_values(self.images),
            num_running=rt.num_running, num_waiting=rt.num_waiting,
            hidden_subscriptions=pub.num_subscriptions, hidden_shm_rings=pub.shm.num_rings,
            hidden_shm_bytes=pub.shm.num_bytes, admitting=self.tokenizer.num_pending,
            hidden_messages_published=pub.num_messages_published,
            hidden_bytes_published=pub.num_bytes_published, hidden_max_lag=pub.max_lag,
            hidden_prompt_held_bytes=self.prompt_windows.num_bytes,
            spec=rt.spec_totals if rt.config.spec is not None else None)

    async def subscribe(self, request_id: str | None, port: str, use_shm: bool
                        ) -> Subscriber:
        """A subscription to the hidden port of one request (it may not exist yet) or all."""
        check_subscribe(self.config.has_hidden_port, request_id, port)
        is_started = request_id is None or any(
            s.request.request_id == request_id for s in self.slots)
        return await self.hidden.subscribe(request_id, use_shm, is_started)

    def unsubscribe(self, sub: Subscriber) -> None:
        """The subscriber went. Closing it also releases a decode loop held on its full
        buffer (policy block), which would otherwise wait for a reader that never comes."""
        self.hidden.unsubscribe(sub)
        self._spawn(sub.close())

    # ---- the kit's hooks ---------------------------------------------------------------
    def _prepare(self, slot: Slot) -> None:
        slot.prepared = build_runtime_request(self.runtime, slot, self.adapters.by_slot())

    def _submit(self, slot: Slot) -> None:
        self.runtime.submit(slot.prepared.request)

    def _unstarted_ended(self, slot: Slot) -> None:
        """Its hidden-port subscribers still get their terminal message, or a subscriber
        that came early would wait forever."""
        if slot.request.wants_hidden and slot.run.ended is not None:
            self._spawn(self.hidden.end(slot.request.request_id, slot.run.ended.value, None))

    def _finished_diagnostics(self, slot: Slot) -> dict[str, Any]:
        return slot_diagnostics(slot, self.config)

    async def _after_step(self, pairs: Pairs) -> None:
        """After every step: spans and metrics of the runs that ended, then the hidden port."""
        for slot, ev in pairs:
            if ev.finish_reason is not None:
                run_spans(slot, self.config.stage_id)
                self.metrics.run_ended(slot)
        self.hidden.begin_step()
        try:
            # This stage's stepper is the LLM runtime: its events are StepEvents.
            await publish_step(self.hidden, self.prompt_windows,
                               cast(list[tuple[Slot, StepEvent]], pairs))
        finally:
            self.prompt_windows.retain(s.request.request_id for s in self.slots
                                       if s.run.ended is None)
            await self.hidden.flush_step()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
