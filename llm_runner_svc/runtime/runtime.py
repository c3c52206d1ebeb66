"""The inference runtime: continuous batching over one engine, steps built by a scheduler.

Requests are submitted from any thread; one thread calls `step()`. A step applies
cancellations first (a cancel lands at the top of the next step), then asks the scheduler
(scheduler.py) for the next batch (decode rows, prefill chunks, joins under the token
budget), launches it on the engine, and only then reads the batch launched by the step
before and turns it into events: the engine works on step n+1 while the host handles step
n. A step that finds nothing in flight launches two batches and reads the first, so every
step returns the tokens of one forward. A forward holding a speculative request's row is
read before the next launch (its verify row needs the accepted tokens), and so is one
holding a row whose pick the host must see first (a structured output's mask, the counts of
a repetition penalty). Nothing else is
special-cased: a join, a leave, a cancel or a preemption only changes which rows the next
batch holds, and rows of a request that ended meanwhile are dropped when their batch is
read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from llm_runner_svc.engines.base import Engine, EnginePlan
from llm_runner_svc.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RunnerError,
    Unimplemented,
)
from llm_runner_svc.models.tokenizer import StreamDecoder, Tokenizer
from llm_runner_svc.runtime.advance import Flight, SequenceAdvance
from llm_runner_svc.runtime.config import RuntimeConfig
from llm_runner_svc.runtime.constraint import Constraint
from llm_runner_svc.runtime.drafting import DraftProposer
from llm_runner_svc.runtime.grammar import Grammars
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.prefix_cache import PrefixCache, packed
from llm_runner_svc.runtime.request import (
    FinishReason,
    GenerationRequest,
    RequestMetrics,
    SequenceState,
    StepEvent,
)
from llm_runner_svc.runtime.sampling import SamplingParams, has_penalties
from llm_runner_svc.runtime.scheduler import Scheduler
from llm_runner_svc.runtime.speculative import NgramProposer
from llm_runner_svc.runtime.stops import StopMatcher

if TYPE_CHECKING:  # host arrays (numpy), which the runtime never touches
    from llm_runner_svc.models.lora import LoraAdapter


class InferenceRuntime(SequenceAdvance):
    """Admission, cancellation and each step's choice of who prefills and who decodes; the
    sequences themselves advance in `SequenceAdvance` (advance.py)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, config: RuntimeConfig,
                 draft: Engine | None = None) -> None:
        """`draft`: the draft engine of spec_decode methods `self` and `draft` (with the
        target's tokenizer; engines/drafts.py builds it)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.max_seq = config.resolved_max_seq(engine.config.max_position)
        self.step_tokens = config.step_tokens(engine.default_step_tokens)
        self.plan = EnginePlan(
            max_batch=config.max_batch, max_seq=self.max_seq, page_size=config.page_size,
            num_pages=self._pool_pages(), prefill_chunk=config.prefill_chunk,
            hidden_layer=config.hidden_layer, step_tokens=self.step_tokens,
            verify_tokens=config.spec.proposal_tokens if config.spec is not None else 0)
        if config.spec is not None and not engine.supports_verify:
            raise InvalidArgument(f"spec_decode: engine {engine.name} does not verify "
                                  "proposals (engines that do: numpy, torch)")
        if config.spec is not None and config.hidden_layer is not None:
            raise InvalidArgument("spec_decode and a hidden port (accept_hidden_layer) "
                                  "exclude each other: a speculative build emits no hidden "
                                  "states")
        if config.spec is not None and config.spec.proposal_tokens >= min(
                config.prefill_chunk, self.step_tokens):
            raise InvalidArgument("spec_decode.proposal_tokens must be below prefillChunk "
                                  "and the step's token budget")
        self.proposer = self._create_proposer(draft)
        self.pages = PagePool(self.plan.num_pages, config.page_size)
        self.prefix_cache = PrefixCache(
            self.pages, f"{engine.name}|{engine.config!r}|{config.page_size}",
            config.prefix_cache_records, config.prefix_cache_snapshots) \
            if config.prefix_cache else None
        self.scheduler = Scheduler(self.pages, config.max_batch, self.step_tokens, self.max_seq,
                                   self.prefix_cache)
        self._eos = frozenset(engine.config.eos_ids) | frozenset(tokenizer.eos_ids)
        self.grammars = Grammars(tokenizer, engine.config.vocab_size, self._eos)
        self.spec_totals = RequestMetrics()
        self._lock = threading.Lock()
        self._seqs: dict[str, SequenceState] = {}
        self._cancels: set[str] = set()
        self._adapter_changes: list[tuple[int, LoraAdapter | None]] = []
        self._flight: Flight | None = None
        self._is_ready = False

    def _create_proposer(self, draft: Engine | None) -> NgramProposer | DraftProposer | None:
        spec = self.config.spec
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        if draft is None:
            raise InvalidArgument(f"spec_decode method {spec.method!r} needs a draft engine")
        if draft.config.vocab_size != self.engine.config.vocab_size:
            raise InvalidArgument(f"the draft's vocabulary ({draft.config.vocab_size} tokens) "
                                  f"is not the target's ({self.engine.config.vocab_size})")
        return DraftProposer(draft, spec)

    def _pool_pages(self) -> int:
        """Pages in the KV pool: a share of the device's free memory, a byte budget, or
        (neither set) room for max_batch requests of max_seq positions."""
        cfg = self.config
        page_bytes = self.engine.kv_bytes_per_token() * cfg.page_size
        if cfg.kv_memory_fraction > 0:
            free = self.engine.free_device_bytes()
            if free is None:
                raise InvalidArgument(f"kvMemoryFraction needs an engine on a device; engine "
                                      f"{self.engine.name} runs on the host (use a byte budget)")
            num = int(free * cfg.kv_memory_fraction) // page_bytes
        elif cfg.kv_memory_bytes > 0:
            num = cfg.kv_memory_bytes // page_bytes
        else:
            num = cfg.max_batch * -(-self.max_seq // cfg.page_size)
        if num <= 0:
            raise InvalidArgument(f"the KV memory budget holds no page of {page_bytes} bytes")
        return num

    # ---- lifecycle -------------------------------------------------------------------
    def preallocate(self) -> None:
        """Claim the engine's buffers (KV pool, activations, logits, staging). Idempotent."""
        self.engine.preallocate(self.plan)
        if self.proposer is not None:
            self.proposer.preallocate(self.plan)
        self._is_ready = True

    def close(self) -> None:
        """Release the engine's buffers; requests still in flight are dropped. Idempotent."""
        with self._lock:
            self.scheduler.clear()
            self._seqs.clear()
            self._flight = None
        if self.proposer is not None:
            self.proposer.close()
        self.engine.close()
        self._is_ready = False

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix: idle pages are free again. Same thread as `step()`."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # ---- admission -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._seqs or self._cancels)

    def admission_error(self, req: GenerationRequest) -> RunnerError | None:
        """Why `req` cannot be served, or None. Cheap; claims no pages."""
        try:
            self._admissible(req)
        except RunnerError as err:
            return err
        return None

    def check_constraint(self, constraint: Constraint) -> None:
        """Whether this runtime can serve `constraint`: Unimplemented when its engine cannot
        mask tokens, GrammarError (InvalidArgument) when it does not compile. The first time
        a constraint is seen it is compiled (milliseconds to a second for a large schema);
        then it is a cache lookup."""
        if not self.engine.supports_masks:
            raise Unimplemented(f"engine {self.engine.name} cannot restrict its picks to a "
                                "token mask: structured output needs engine numpy or torch")
        self.grammars.compile(constraint)

    def check_sampling(self, sp: SamplingParams) -> None:
        """Unimplemented, naming the field, for what `sp` asks and the engine cannot do (its
        supports_* flags); a value that leaves a control off asks nothing."""
        eng = self.engine
        for name, asked, able, does in (
                ("logprobs", sp.logprobs is not None, eng.supports_logprobs,
                 "gives no log-probabilities"),
                ("prompt_logprobs", sp.prompt_logprobs is not None, eng.supports_scores,
                 "gives no prompt log-probabilities"),
                ("penalties, min_p", has_penalties(sp) or sp.min_p > 0,
                 eng.supports_penalties, "applies no penalties or min_p")):
            if asked and not able:
                raise Unimplemented(f"{name}: engine {eng.name} {does} (engines that do: "
                                    "numpy, torch)")

    def _check_features(self, req: GenerationRequest) -> None:
        self.check_sampling(req.sampling)
        if req.constraint is not None:
            self.check_constraint(req.constraint)

    def _admissible(self, req: GenerationRequest) -> bytes:
        """The prompt's ids `packed` (which the prefix lookup reads), once `req` is found
        servable; raises the error `admission_error` returns."""
        n = len(req.prompt_ids)
        if n >= self.max_seq:
            raise InvalidArgument(
                f"prompt has {n} tokens; maxSeq is {self.max_seq}, which leaves no room to "
                "generate")
        vocab = self.engine.config.vocab_size
        try:  # packing refuses a negative id (or one that is no int)
            ids = packed(req.prompt_ids)
        except (OverflowError, TypeError):
            ids = b""
        if not ids or max(req.prompt_ids) >= vocab:
            raise InvalidArgument(f"prompt holds a token id outside 0..{vocab - 1}")
        bad = [t for t in req.sampling.logit_bias if t >= vocab]
        if bad:
            raise InvalidArgument(f"logit_bias names token {bad[0]}, outside 0..{vocab - 1}")
        if not 0 <= req.adapter <= self.engine.num_adapters:
            raise NotFound(f"LoRA adapter {req.adapter}: the engine holds "
                           f"{self.engine.num_adapters}")
        if req.capture_hidden and self.config.hidden_layer is None:
            raise FailedPrecondition("hidden states were requested but this deployment "
                                     "declares no hidden port (accept_hidden_layer unset)")
        if req.request_id in self._seqs:
            raise FailedPrecondition(f"request id {req.request_id!r} is already in flight")
        self._check_features(req)
        need = self.pages.pages_for(min(n + req.sampling.max_new_tokens, self.max_seq))
        if need > self.pages.num_pages:
            raise ResourceExhausted(
                f"prompt of {n} tokens and max_tokens {req.sampling.max_new_tokens} need "
                f"{need} KV pages; the pool holds {self.pages.num_pages}")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(
                f"waiting queue is full ({self.config.max_waiting} requests)")
        return ids

    def submit(self, req: GenerationRequest) -> None:
        """Queue `req`; it joins the batch at the next step with a free row."""
        if not self._is_ready:
            raise FailedPrecondition("runtime used before preallocate()")
        with self._lock:
            ids = self._admissible(req)
            after_bos = self.tokenizer.bos_id is not None and \
                req.prompt_ids[-1] == self.tokenizer.bos_id
            matcher = None if req.constraint is None else self.grammars.matcher(req.constraint)
            seq = SequenceState(req, StreamDecoder(self.tokenizer, after_bos),
                                StopMatcher(req.stop), ids, matcher)
            if self._speculates(req):
                seq.proposer = self.proposer
            self._seqs[req.request_id] = seq
            self.scheduler.add(seq)

    def _speculates(self, req: GenerationRequest) -> bool:
        """Speculative decoding serves requests whose picks depend on the logits alone
        or on a constraint as well (proposals cut to what it allows, each verified position
        under the constraint's mask there): greedy ones yield exactly plain greedy decoding's
        tokens, sampled ones tokens distributed as plain sampling's (rejection sampling).
        Requests with logit bias, penalties, min_p or log-probabilities, and those that opt
        out, decode plainly."""
        sp = req.sampling
        return self.config.spec is not None and not req.disable_spec_decode and \
            not (sp.logit_bias or has_penalties(sp) or sp.min_p or sp.logprobs is not None)


    def cancel(self, request_id: str) -> bool:
        """Ask for `request_id` to end as cancelled at the top of the next step."""
        with self._lock:
            if request_id not in self._seqs:
                return False
            self._cancels.add(request_id)
            return True

    def set_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put a LoRA adapter into the engine's adapter slot `slot` (None: empty it) at the
        top of the next step, on the stepping thread; the caller sees to it that no request
        on the slot is in flight. Checked now (slot, rank): raises InvalidArgument."""
        self.engine.check_adapter(slot, adapter)
        with self._lock:
            self._adapter_changes.append((slot, adapter))

    # ---- the loop --------------------------------------------------------------------
    @property
    def has_cancels(self) -> bool:
        return bool(self._cancels)

    def apply_cancels(self) -> list[StepEvent]:
        """End the requests whose cancel is pending, without stepping anyone else.

        For a caller that cannot step now (its readers are out of credit) but must still let
        cancels land. Same thread as `step()`.
        """
        events: dict[str, StepEvent] = {}
        self._end_cancelled(events)
        return list(events.values())

    def can_step(self, held: frozenset[str] = frozenset()) -> bool:
        """Whether `step(held)` would do anything: a cancel to apply, or a request not held."""
        return bool(self._cancels) or any(rid not in held for rid in self._seqs)

    def step(self, held: frozenset[str] = frozenset()) -> list[StepEvent]:
        """Run one step; return an event for every request that changed. Requests in `held`
        take no part (no prefill chunk, no decode row; their pages stay), and what their
        rows already in flight produce waits until they step again."""
        events: dict[str, StepEvent] = {}
        self._apply_adapter_changes()
        self._end_cancelled(events)
        self._deliver_stashed(held, events)
        flight, self._flight = self._flight, None
        if flight is not None and not flight.is_live():
            flight = None  # every row's request has ended: nothing there to read
        if flight is None:
            flight = self._launch(held, events)
        if flight is not None and flight.reads_first():
            self._take(flight, held, events)  # no run-ahead: its next rows need these picks
        elif flight is not None:
            self._flight = self._launch(held, events)
            self._take(flight, held, events)
        return list(events.values())

    def generate(self, req: GenerationRequest) -> Iterator[StepEvent]:
        """Run `req` alone to its end, yielding its events. The runtime must be idle."""
        if self.has_work:
            raise FailedPrecondition("generate() needs an idle runtime; use submit()/step()")
        self.submit(req)
        while True:
            for ev in self.step():
                yield ev
                if ev.finish_reason is not None:
                    return

    # ---- internals -------------------------------------------------------------------
    def _apply_adapter_changes(self) -> None:
        with self._lock:
            changes, self._adapter_changes = self._adapter_changes, []
        for slot, adapter in changes:
            self.engine.set_adapter(slot, adapter)
            if self.prefix_cache is not None:
                self.prefix_cache.retire_adapter(slot)

    def _end_cancelled(self, events: dict[str, StepEvent]) -> None:
        """Requests whose cancel is pending end now, as cancelled."""
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            ended = [self._seqs[rid] for rid in cancels if rid in self._seqs]
        for seq in ended:
            seq.latch(FinishReason.CANCELLED)
            self._finish(seq, self._event(events, seq))
