"""How the runtime's sequences advance: prefill, decode (plain or chained on the engine), and
taking each new token (end of sequence, stop strings, length, text), finishing a request.

`SequenceAdvance` is the half of `InferenceRuntime` that works on sequences already chosen for
a step; `InferenceRuntime` (runtime.py) holds admission, cancellation and the step's choice
of who prefills and who decodes. Everything here runs on the thread that calls `step()`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from llm_runner_svc.engines.base import (
    CHAINED,
    DecodeRow,
    Engine,
    HiddenStates,
    SampleSpec,
)
from llm_runner_svc.errors import RunnerError
from llm_runner_svc.runtime.config import RuntimeConfig
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.request import FinishReason, SequenceState, StepEvent
from llm_runner_svc.runtime.sampling import uniform_draw

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    """A decode started for `batch` at each one's next_position, its picks not yet read."""

    batch: list[SequenceState]
    started: Any  # what engine.finish_sample takes


class SequenceAdvance:
    """Set up by `InferenceRuntime.__init__`."""

    engine: Engine
    config: RuntimeConfig
    pages: PagePool
    max_seq: int
    _eos: frozenset[int]
    _lock: threading.Lock
    _running: list[SequenceState]
    _seqs: dict[str, SequenceState]
    _ahead: _Ahead | None

    @staticmethod
    def _event(events: dict[str, StepEvent], seq: SequenceState) -> StepEvent:
        rid = seq.req.request_id
        ev = events.get(rid)
        if ev is None:
            ev = events[rid] = StepEvent(rid)
        return ev

    def _spec(self, seq: SequenceState, ahead: int = 0) -> SampleSpec:
        """How to pick `seq`'s next token (`ahead` 1: the one after it). A greedy pick uses
        no draw, so a greedy request's spec is the same every step: built once."""
        if seq.greedy_spec is not None:
            return seq.greedy_spec
        sp = seq.req.sampling
        spec = SampleSpec(sp.temperature, sp.top_k, sp.top_p,
                          uniform_draw(sp.seed, len(seq.output_ids) + ahead),
                          sp.logit_bias or None)
        if spec.is_greedy:
            seq.greedy_spec = spec
        return spec

    def _prefill(self, seq: SequenceState, ev: StepEvent) -> None:
        t0 = time.perf_counter()
        seq.metrics.queue_ms = (t0 - seq.t_submit) * 1000.0
        prompt = list(seq.req.prompt_ids)
        try:
            seq.pages.extend(self.pages.allocate(self.pages.pages_for(len(prompt))))
            hidden = self.engine.prefill(prompt, 0, seq.pages, seq.req.capture_hidden)
            token = self.engine.sample([self._spec(seq)])[0]
        except RunnerError as exc:
            seq.latch(FinishReason.ERROR, exc.message)
            return
        except Exception as exc:  # an engine bug fails this request only
            log.exception("prefill failed for request %s", seq.req.request_id)
            seq.latch(FinishReason.ERROR, f"internal error in prefill: {exc}")
            return
        if hidden is not None:
            ev.hidden.append(hidden)
        seq.t_first_token = time.perf_counter()
        seq.metrics.prefill_ms = (seq.t_first_token - t0) * 1000.0
        seq.metrics.ttft_ms = (seq.t_first_token - seq.t_submit) * 1000.0
        seq.next_position = len(prompt)
        self._accept(seq, token, ev)

    def _decode(self, batch: list[SequenceState], events: dict[str, StepEvent]) -> None:
        for seq in self._short_of_pages(batch, 0):
            seq.pages.extend(self.pages.allocate(1))
        rows = [DecodeRow(s.last_token, s.next_position, s.pages, s.req.capture_hidden)
                for s in batch]
        try:
            hidden = self.engine.decode(rows)
            started = self.engine.start_sample([self._spec(s) for s in batch])
            self._ahead = self._start_ahead(batch)
            tokens = self.engine.finish_sample(started)
        except Exception as exc:
            self._fail_batch(batch, exc, events)
            return
        self._take_tokens(batch, tokens, hidden, events)

    def _step_chained(self, ahead: _Ahead, events: dict[str, StepEvent]) -> None:
        """The batch is as the decode in flight left it: start the next, then read it."""
        try:
            self._ahead = self._start_ahead(ahead.batch)
            tokens = self.engine.finish_sample(ahead.started)
        except Exception as exc:
            self._ahead = None
            self._fail_batch(ahead.batch, exc, events)
            return
        self._take_tokens(ahead.batch, tokens, [None] * len(tokens), events)

    def _read_ahead(self, ahead: _Ahead, events: dict[str, StepEvent]) -> None:
        """Take the picks of the decode in flight for the requests still running."""
        try:
            tokens = self.engine.finish_sample(ahead.started)
        except Exception as exc:
            self._fail_batch([s for s in ahead.batch if s.finish_reason is None], exc, events)
            return
        live = [(s, t) for s, t in zip(ahead.batch, tokens, strict=True)
                if s.finish_reason is None]
        self._take_tokens([s for s, _ in live], [t for _, t in live], [None] * len(live),
                          events)

    def _start_ahead(self, batch: list[SequenceState]) -> _Ahead | None:
        """Start the decode after the one just started for `batch` (rows at next_position
        + 1, tokens chained on the engine), when the engine chains and every row will still
        be running; None otherwise."""
        if not self.engine.supports_chaining:
            return None
        for seq in batch:
            if (seq.req.capture_hidden or seq.next_position + 1 >= self.max_seq
                    or len(seq.output_ids) + 1 >= seq.req.sampling.max_new_tokens):
                return None
        short = self._short_of_pages(batch, 1)
        if not self.pages.can_allocate(len(short)):
            return None
        for seq in short:
            seq.pages.extend(self.pages.allocate(1))
        self.engine.decode([DecodeRow(CHAINED, s.next_position + 1, s.pages) for s in batch])
        return _Ahead(list(batch), self.engine.start_sample([self._spec(s, 1) for s in batch]))

    def _short_of_pages(self, batch: list[SequenceState], ahead: int) -> list[SequenceState]:
        """The requests whose pages end before position next_position + `ahead`."""
        ps = self.config.page_size
        return [s for s in batch if (s.next_position + ahead) // ps >= len(s.pages)]

    def _fail_batch(self, batch: list[SequenceState], exc: Exception,
                    events: dict[str, StepEvent]) -> None:
        log.error("decode step failed for %d requests", len(batch), exc_info=exc)
        msg = exc.message if isinstance(exc, RunnerError) else f"internal error: {exc}"
        for seq in batch:
            seq.latch(FinishReason.ERROR, msg)
            self._finish(seq, self._event(events, seq))
        self._running = [s for s in self._running if s.finish_reason is None]

    def _take_tokens(self, batch: list[SequenceState], tokens: list[int],
                     hidden: list[HiddenStates | None], events: dict[str, StepEvent]) -> None:
        for seq, tok, hs in zip(batch, tokens, hidden, strict=True):
            ev = self._event(events, seq)
            if hs is not None:
                ev.hidden.append(hs)
            seq.next_position += 1
            self._accept(seq, tok, ev)
            if seq.finish_reason is not None:
                self._finish(seq, ev)
        self._running = [s for s in self._running if s.finish_reason is None]

    def _accept(self, seq: SequenceState, token: int, ev: StepEvent) -> None:
        """Take a sampled token: end on EOS, stop string or length, else stream it."""
        seq.last_token = token
        if token in self._eos and not seq.req.ignore_eos:
            seq.latch(FinishReason.END_OF_SEQUENCE)
            return
        seq.output_ids.append(token)
        seq.metrics.generated_tokens += 1
        ev.token_ids.append(token)
        text, is_stop = seq.stops.feed(seq.decoder.push([token]))
        ev.text += text
        if is_stop:
            seq.latch(FinishReason.STOP_WORDS)
        elif (len(seq.output_ids) >= seq.req.sampling.max_new_tokens
              or seq.next_position >= self.max_seq):
            seq.latch(FinishReason.MAX_LENGTH)

    def _finish(self, seq: SequenceState, ev: StepEvent) -> None:
        if seq.finish_reason is not FinishReason.STOP_WORDS:
            ev.text += seq.stops.feed(seq.decoder.flush())[0] + seq.stops.flush()
        if seq.t_first_token:
            seq.metrics.decode_ms = (time.perf_counter() - seq.t_first_token) * 1000.0
        self.pages.release(seq.pages)
        with self._lock:
            self._seqs.pop(seq.req.request_id, None)
        ev.finish_reason = seq.finish_reason
        ev.error = seq.error
        ev.metrics = seq.metrics
