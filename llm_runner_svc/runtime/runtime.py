"""The inference runtime: continuous batching over one engine.

Requests are submitted from any thread; one thread calls `step()`. A step first applies
cancellations (so a cancel lands at the top of the next step), then prefills requests that
fit into free batch rows, then runs one decode step for every request that was already
decoding. Joining and leaving happen only at these boundaries.

On an engine that chains decodes (`Engine.supports_chaining`), a decode step also starts the
next one for the same rows before it reads its own picks: the next step's tokens are the
picks the engine still holds, so the device works on step n+1 while the host turns step n
into events. A step that finds the batch as that decode left it reads its picks and starts
the one after; any change (a join, a cancel, a request that ended) first reads the picks of
the decode in flight, and that step decodes nothing more. Requests capturing hidden states,
and rows about to reach their length limit, are not run ahead.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator

from llm_runner_svc.engines.base import Engine, EnginePlan
from llm_runner_svc.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    RunnerError,
)
from llm_runner_svc.models.tokenizer import StreamDecoder, Tokenizer
from llm_runner_svc.runtime.advance import SequenceAdvance
from llm_runner_svc.runtime.config import RuntimeConfig
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.request import (
    FinishReason,
    GenerationRequest,
    SequenceState,
    StepEvent,
)
from llm_runner_svc.runtime.stops import StopMatcher


class InferenceRuntime(SequenceAdvance):
    """Admission, cancellation and each step's choice of who prefills and who decodes; the
    sequences themselves advance in `SequenceAdvance` (advance.py)."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, config: RuntimeConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.max_seq = config.resolved_max_seq(engine.config.max_position)
        pages_per_seq = -(-self.max_seq // config.page_size)
        self.plan = EnginePlan(
            max_batch=config.max_batch, max_seq=self.max_seq, page_size=config.page_size,
            num_pages=config.max_batch * pages_per_seq, prefill_chunk=config.prefill_chunk,
            hidden_layer=config.hidden_layer)
        self.pages = PagePool(self.plan.num_pages, config.page_size)
        self._eos = frozenset(engine.config.eos_ids) | frozenset(tokenizer.eos_ids)
        self._lock = threading.Lock()
        self._waiting: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._seqs: dict[str, SequenceState] = {}
        self._cancels: set[str] = set()
        self._ahead = None
        self._is_ready = False

    # ---- lifecycle -------------------------------------------------------------------
    def preallocate(self) -> None:
        """Claim the engine's buffers (KV pool, activations, logits, staging). Idempotent."""
        self.engine.preallocate(self.plan)
        self._is_ready = True

    def close(self) -> None:
        """Release the engine's buffers; requests still in flight are dropped. Idempotent."""
        with self._lock:
            for seq in list(self._seqs.values()):
                self.pages.release(seq.pages)
            self._seqs.clear()
            self._waiting.clear()
            self._running.clear()
            self._ahead = None
        self.engine.close()
        self._is_ready = False

    # ---- admission -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._cancels)

    def admission_error(self, req: GenerationRequest) -> RunnerError | None:
        """Why `req` cannot be served, or None. Cheap; allocates nothing."""
        n = len(req.prompt_ids)
        if n >= self.max_seq:
            return InvalidArgument(
                f"prompt has {n} tokens; maxSeq is {self.max_seq}, which leaves no room to "
                "generate")
        vocab = self.engine.config.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            return InvalidArgument(f"prompt holds a token id outside 0..{vocab - 1}")
        bad = [t for t in req.sampling.logit_bias if t >= vocab]
        if bad:
            return InvalidArgument(f"logit_bias names token {bad[0]}, outside 0..{vocab - 1}")
        if req.capture_hidden and self.config.hidden_layer is None:
            return FailedPrecondition("hidden states were requested but this deployment "
                                      "declares no hidden port (accept_hidden_layer unset)")
        if req.request_id in self._seqs:
            return FailedPrecondition(f"request id {req.request_id!r} is already in flight")
        if len(self._waiting) >= self.config.max_waiting:
            return ResourceExhausted(
                f"waiting queue is full ({self.config.max_waiting} requests)")
        return None

    def submit(self, req: GenerationRequest) -> None:
        """Queue `req`; it joins the batch at the next step with a free row."""
        if not self._is_ready:
            raise FailedPrecondition("runtime used before preallocate()")
        with self._lock:
            err = self.admission_error(req)
            if err is not None:
                raise err
            after_bos = self.tokenizer.bos_id is not None and \
                req.prompt_ids[-1] == self.tokenizer.bos_id
            seq = SequenceState(req, StreamDecoder(self.tokenizer, after_bos),
                                StopMatcher(req.stop))
            self._seqs[req.request_id] = seq
            self._waiting.append(seq)

    def cancel(self, request_id: str) -> bool:
        """Ask for `request_id` to end as cancelled at the top of the next step."""
        with self._lock:
            if request_id not in self._seqs:
                return False
            self._cancels.add(request_id)
            return True

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
        with self._lock:
            self._take_cancels()
            ended = [s for s in (*self._running, *self._waiting) if s.finish_reason is not None]
            self._waiting = deque(s for s in self._waiting if s.finish_reason is None)
        for seq in ended:
            self._finish(seq, self._event(events, seq))
        self._running = [s for s in self._running if s.finish_reason is None]
        return list(events.values())

    def can_step(self, held: frozenset[str] = frozenset()) -> bool:
        """Whether `step(held)` would do anything: a cancel to apply, or a request not held."""
        return bool(self._cancels) or any(rid not in held for rid in self._seqs)

    def step(self, held: frozenset[str] = frozenset()) -> list[StepEvent]:
        """Run one step; return an event for every request that changed. Requests in `held`
        take no part (no prefill, no decode; their pages stay), though a decode of theirs
        already started ahead is still read."""
        with self._lock:
            cancels = self._take_cancels()
            ended = [s for s in (*self._running, *self._waiting) if s.finish_reason is not None]
            if cancels:
                self._waiting = deque(s for s in self._waiting if s.finish_reason is None)
            live = [s for s in self._running if s.finish_reason is None]
            decoding = [s for s in live if s.req.request_id not in held]
            num_joins = min(len(self._waiting), self.config.max_batch - len(live))
            joins = [seq for seq in self._waiting if seq.req.request_id not in held][:num_joins]
            if joins:
                taken = {id(seq) for seq in joins}
                self._waiting = deque(s for s in self._waiting if id(s) not in taken)
        events: dict[str, StepEvent] = {}
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if not ended and not joins and decoding == ahead.batch:
                self._step_chained(ahead, events)
                return list(events.values())
            self._read_ahead(ahead, events)  # this step's tokens; it decodes nothing more
            decoding = [s for s in decoding if s.finish_reason is None]
            live = [s for s in live if s.finish_reason is None]
        for seq in ended:
            self._finish(seq, self._event(events, seq))
        self._running = list(live)  # joins below must not enter this step's decode
        for seq in joins:
            ev = self._event(events, seq)
            if seq.finish_reason is None:
                self._prefill(seq, ev)
            if seq.finish_reason is None:
                self._running.append(seq)
            else:
                self._finish(seq, ev)
        if decoding and ahead is None:
            self._decode(decoding, events)
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
    def _take_cancels(self) -> set[str]:
        """Latch CANCELLED on every pending cancel; the caller holds the lock."""
        cancels, self._cancels = self._cancels, set()
        for rid in cancels:
            seq = self._seqs.get(rid)
            if seq is not None:
                seq.latch(FinishReason.CANCELLED)
        return cancels
