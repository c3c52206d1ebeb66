"""How the runtime's requests advance once a step has run: reading a forward's picks and
captured states, taking each new token (end of sequence, stop strings, length, text) and
finishing a request.

`SequenceAdvance` is the half of `InferenceRuntime` that works on what a forward returned;
`InferenceRuntime` (runtime.py) holds admission, cancellation and the loop, and the
scheduler (scheduler.py) chooses each step's rows. Everything here runs on the thread that
calls `step()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from llm_runner_svc.engines.base import Engine, HiddenStates
from llm_runner_svc.engines.batch import Batch, Row, TokenLogprob
from llm_runner_svc.errors import RunnerError
from llm_runner_svc.runtime.config import RuntimeConfig
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.request import (
    FinishReason,
    RequestMetrics,
    SeqStatus,
    SequenceState,
    StepEvent,
)
from llm_runner_svc.runtime.scheduler import Planned, Scheduler
from llm_runner_svc.runtime.speculative import accept_greedy, losing_reason

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """A launched forward, not yet read: its handle and the request behind each row."""

    handle: Any
    plan: Planned

    def is_live(self) -> bool:
        return any(s.status is not SeqStatus.FINISHED for s, _ in self.plan)

    def reads_first(self) -> bool:
        """A request's next row depends on this forward's picks read on the host (a
        speculative one's proposal, a structured output's mask, a penalty's counts): read it
        before the next launch."""
        return any(s.reads_first for s, _ in self.plan)


class SequenceAdvance:
    """Set up by `InferenceRuntime.__init__`."""

    engine: Engine
    config: RuntimeConfig
    pages: PagePool
    scheduler: Scheduler
    max_seq: int
    _eos: frozenset[int]
    _lock: threading.Lock
    _seqs: dict[str, SequenceState]
    spec_totals: RequestMetrics  # the speculative counts of every request since start

    @staticmethod
    def _event(events: dict[str, StepEvent], seq: SequenceState) -> StepEvent:
        rid = seq.req.request_id
        ev = events.get(rid)
        if ev is None:
            ev = events[rid] = StepEvent(rid)
        return ev

    def _launch(self, held: Set[str], events: dict[str, StepEvent]) -> Flight | None:
        """Schedule the next batch and start it on the engine; None when nothing runs."""
        plan = self.scheduler.schedule(held)
        if not plan:
            return None
        now = time.perf_counter()
        for seq, _ in plan:
            if not seq.t_scheduled:
                seq.t_scheduled = now
                seq.metrics.queue_ms = (now - seq.t_submit) * 1000.0
        try:
            handle = self.engine.launch(Batch([row for _, row in plan]))
        except Exception as exc:
            self._fail([s for s, _ in plan], exc, events)
            return None
        return Flight(handle, plan)

    def _take(self, flight: Flight, held: Set[str], events: dict[str, StepEvent]) -> None:
        """Turn a launched forward into events: picks accepted, states delivered; a held
        request's results wait in its stash."""
        try:
            out = self.engine.read(flight.handle)
        except Exception as exc:
            self._fail([s for s, _ in flight.plan if s.status is not SeqStatus.FINISHED],
                       exc, events)
            return
        verified = out.verified or [None] * len(flight.plan)
        logprobs = out.logprobs or [None] * len(flight.plan)
        scores = out.scores or [None] * len(flight.plan)
        for (seq, row), pick, hs, target, lp, score in zip(
                flight.plan, out.picks, out.hidden, verified, logprobs, scores, strict=True):
            if seq.status is SeqStatus.FINISHED:
                continue
            if score and seq.prompt_scores is not None:
                kept = len(seq.prompt_scores) - row.start  # positions scored before
                seq.prompt_scores.extend(score[max(kept, 0):])
            if row.sample is not None:
                seq.pending -= 1
            tokens, end = ([] if pick is None else [pick]), row.end
            if row.verify and pick is not None:
                tokens, end = self._verified(seq, row, [*(target or ()), pick])
            if seq.proposer is not None and tokens:
                seq.proposer.roll_back(seq, end)  # the draft's KV past the accepted tokens
            if seq.proposer is not None and tokens and row.start >= len(seq.req.prompt_ids):
                for m in (seq.metrics, self.spec_totals):
                    m.target_steps += 1  # a decode row: one target forward
                    m.verified_tokens += len(tokens)
                self.spec_totals.proposed_tokens += row.verify
                self.spec_totals.accepted_tokens += len(tokens) - 1
            lps = [lp] if lp is not None and len(tokens) == 1 else []
            if seq.req.request_id in held:
                seq.stash.append((tokens, hs, end, lps))
            else:
                self._deliver(seq, tokens, hs, end, events, lps)
            if row.verify and pick is not None:
                seq.metrics.verify_steps += 1
                self._stop_losing_speculation(seq)

    def _stop_losing_speculation(self, seq: SequenceState) -> None:
        """A request whose proposals stay below break-even (`losing_reason`) decodes plainly
        from its next row on: its verify rows cost more than the tokens they add."""
        if seq.proposer is None or seq.status is SeqStatus.FINISHED:
            return
        m = seq.metrics
        reason = losing_reason(seq.proposer.config, m.verify_steps, m.accepted_tokens)
        if not reason:
            return
        seq.proposer.release(seq)  # a draft's pages for it go back
        seq.proposer = None
        m.spec_disabled_reason = reason
        m.spec_disabled_at_token = len(seq.output_ids) + sum(len(e[0]) for e in seq.stash)
        log.info("request %s decodes plainly from token %d: %s", seq.req.request_id,
                 m.spec_disabled_at_token, reason)

    def _verified(self, seq: SequenceState, row: Row, target: list[int]) -> tuple[list[int], int]:
        """The tokens a verify row yields and the position after the last of them; the
        rejected positions are rolled back."""
        tokens = accept_greedy(row.tokens[1:], target)
        seq.metrics.accepted_tokens += len(tokens) - 1
        end = row.start + len(tokens)
        if seq.status is SeqStatus.DECODING:
            self.scheduler.roll_back(seq, end)
        return tokens, end

    def _deliver_stashed(self, held: Set[str], events: dict[str, StepEvent]) -> None:
        for seq in list(self._seqs.values()):
            if seq.stash and seq.req.request_id not in held:
                stash, seq.stash = seq.stash, []
                for tokens, hs, end, lps in stash:
                    if seq.status is not SeqStatus.FINISHED:
                        self._deliver(seq, tokens, hs, end, events, lps)

    def _deliver(self, seq: SequenceState, tokens: list[int], hs: HiddenStates | None,
                 end: int, events: dict[str, StepEvent],
                 logprobs: list[TokenLogprob] | None = None) -> None:
        """One row's results: states of positions not delivered before (a recompute after a
        preemption repeats some), then its tokens (a pick, or a verify row's), the last
        following position `end` - 1, with their log-probabilities when asked."""
        ev = self._event(events, seq)
        reused, seq.reused_hidden = seq.reused_hidden, []
        for piece in reused:  # states of a reused prefix, kept by the cache
            self._states(seq, piece, piece.start_position + len(piece.states), ev)
        if hs is not None:
            self._states(seq, hs, end, ev)
        if not tokens:
            return
        if not seq.t_first_token:
            seq.t_first_token = time.perf_counter()
            seq.metrics.prefill_ms = (seq.t_first_token - seq.t_scheduled) * 1000.0
            seq.metrics.ttft_ms = (seq.t_first_token - seq.t_submit) * 1000.0
        if seq.prompt_scores is not None and not seq.scores_sent:
            ev.prompt_logprobs = list(seq.prompt_scores)
            seq.scores_sent = True
        for i, token in enumerate(tokens):
            if logprobs and i < len(logprobs):  # (an ending EOS's too: the last entry)
                ev.logprobs.append(logprobs[i])
            self._accept(seq, token, ev, end - len(tokens) + 1 + i)
            if seq.finish_reason is not None:
                self._finish(seq, ev)
                return

    def _states(self, seq: SequenceState, hs: HiddenStates, end: int, ev: StepEvent) -> None:
        """Deliver the states of positions up to `end` not delivered before."""
        if end <= seq.hidden_upto:
            return
        skip = max(0, seq.hidden_upto - hs.start_position)
        if skip:
            hs = HiddenStates(hs.embeddings[skip:], hs.states[skip:], hs.start_position + skip)
        ev.hidden.append(hs)
        seq.hidden_upto = end
        self.scheduler.keep_hidden(seq, hs)

    def _fail(self, seqs: list[SequenceState], exc: Exception,
              events: dict[str, StepEvent]) -> None:
        """An engine call failed: its requests end with an error, the others run on."""
        log.error("engine step failed for %d requests", len(seqs), exc_info=exc)
        msg = exc.message if isinstance(exc, RunnerError) else f"internal error: {exc}"
        for seq in seqs:
            seq.latch(FinishReason.ERROR, msg)
            self._finish(seq, self._event(events, seq))
        if self.scheduler.cache is not None:
            self.scheduler.cache.clear()  # pages named for the failed forward may be unwritten

    def _accept(self, seq: SequenceState, token: int, ev: StepEvent, end: int) -> None:
        """Take a sampled token: end on EOS, stop string or length, else stream it."""
        if token in self._eos and not seq.req.ignore_eos:
            seq.latch(FinishReason.END_OF_SEQUENCE)
            return
        seq.known.append(token)
        seq.output_ids.append(token)
        seq.metrics.generated_tokens += 1
        ev.token_ids.append(token)
        if seq.counts is not None:
            seq.counts[token] = seq.counts.get(token, 0) + 1
        text, is_stop = seq.stops.feed(seq.decoder.push([token]))
        ev.text += text
        if is_stop:
            seq.latch(FinishReason.STOP_WORDS)
        elif seq.matcher is not None and not seq.matcher.accept(token):
            seq.latch(FinishReason.ERROR, f"token {token} breaks the structured output: "
                      f"{seq.matcher.error.splitlines()[0] if seq.matcher.error else ''}")
        elif seq.matcher is not None and seq.matcher.is_done:
            seq.latch(FinishReason.END_OF_SEQUENCE)  # the output is whole: nothing may follow
        elif len(seq.output_ids) >= seq.req.sampling.max_new_tokens or end >= self.max_seq:
            seq.latch(FinishReason.MAX_LENGTH)

    def _finish(self, seq: SequenceState, ev: StepEvent) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.finish_reason is not FinishReason.STOP_WORDS:
            ev.text += seq.stops.feed(seq.decoder.flush())[0] + seq.stops.flush()
        if seq.t_first_token:
            seq.metrics.decode_ms = (time.perf_counter() - seq.t_first_token) * 1000.0
        self.scheduler.drop(seq)
        with self._lock:
            self._seqs.pop(seq.req.request_id, None)
        ev.finish_reason = seq.finish_reason
        ev.error = seq.error
        ev.metrics = seq.metrics
