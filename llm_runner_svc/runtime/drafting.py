"""Proposals from a draft model: a second engine with its own KV pages (speculative methods
`self`, the target's first layers and its head, and `draft`, a separate small model).

`DraftProposer` is shared by every speculative request of a runtime. Once per step the
scheduler asks it for the proposals of all its requests together (`propose_batch`): one
draft forward feeds each request the known tokens its draft KV lacks (the prompt at first,
then the tokens the last verify accepted) and picks the first proposed token, then K - 1
one-token forwards pick the rest, every request in the same batch. The draft proposes
greedily, so its q is a point mass (what the engines' rejection rule expects); with a
confidence threshold a request's proposal stops where the draft's top probability falls
below it. After the verify row is read, `roll_back` forgets the draft KV past the accepted
tokens (its page table shrinks; nothing is copied).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_runner_svc.engines.base import Engine, EnginePlan
from llm_runner_svc.engines.batch import Batch, Row, SampleSpec
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.speculative import SpecConfig

log = logging.getLogger(__name__)
_GREEDY = SampleSpec(0.0, 0, 1.0)


@dataclass
class _DraftSeq:
    """One request's place in the draft's KV: its pages and how many positions hold the
    draft KV of its known tokens (or of proposed ones, until `roll_back`)."""

    pages: list[int] = field(default_factory=list)
    computed: int = 0


class DraftProposer:
    """Proposals from `engine`, a decoder with the target's tokenizer. Call `preallocate`
    before the first step and `close` after the last; `release` when a request ends."""

    def __init__(self, engine: Engine, config: SpecConfig) -> None:
        self.engine = engine
        self.config = config
        self.pool: PagePool | None = None
        self._seqs: dict[str, _DraftSeq] = {}

    def preallocate(self, plan: EnginePlan) -> None:
        """The draft's buffers, for the target's plan (as many pages, no hidden states; its
        K, so that a catch-up row of up to K + 1 tokens may run as decode rows)."""
        self.engine.preallocate(EnginePlan(
            plan.max_batch, plan.max_seq, plan.page_size, plan.num_pages, plan.prefill_chunk,
            None, plan.step_tokens, plan.verify_tokens))
        self.pool = PagePool(plan.num_pages, plan.page_size)

    def close(self) -> None:
        self._seqs.clear()
        self.pool = None
        self.engine.close()

    def release(self, seq: Any) -> None:
        """`seq` ended: its draft pages go back. Idempotent."""
        state = self._seqs.pop(seq.req.request_id, None)
        if state is not None and self.pool is not None:
            self.pool.release(state.pages)

    def roll_back(self, seq: Any, end: int) -> None:
        """Positions from `end` on no longer hold `seq`'s known tokens in the draft KV
        (rejected proposals); their pages go back."""
        state = self._seqs.get(seq.req.request_id)
        if state is None or self.pool is None:
            return
        state.computed = min(state.computed, end)
        keep = self.pool.pages_for(state.computed)
        if len(state.pages) > keep:
            tail = state.pages[keep:]
            del state.pages[keep:]
            self.pool.release(tail)

    def propose_batch(self, seqs: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow seqs[i].known, for every request in one batch per
        draft step; empty where the draft pool has no pages for it. A draft forward that
        fails costs its requests their proposals (they decode plainly this step, and their
        draft KV is recomputed), not their run."""
        out: list[list[int]] = [[] for _ in seqs]
        live = [i for i, (s, k) in enumerate(zip(seqs, ks, strict=True))
                if k > 0 and self._reserve(s, len(s.known) + k - 1)]
        if not live:
            return out
        try:
            self._draft(seqs, ks, live, out)
        except Exception:
            log.exception("draft forward failed for %d requests; they decode plainly",
                          len(live))
            for i in live:
                self.release(seqs[i])
            return [[] for _ in seqs]
        return out

    def _draft(self, seqs: Sequence[Any], ks: Sequence[int], live: list[int],
               out: list[list[int]]) -> None:
        """The draft forwards of `propose_batch`: its proposals into `out`."""
        rows = []
        for i in live:
            state = self._seqs[seqs[i].req.request_id]
            known = seqs[i].known
            # The last known token is fed again at least: a proposal the scheduler left
            # without a row (no budget, a preemption) was never verified or rolled back.
            state.computed = min(state.computed, len(known) - 1)
            rows.append(Row(tuple(known[state.computed:]), state.computed, tuple(state.pages),
                            _GREEDY))
            state.computed = len(known)
        for step in range(max(ks[i] for i in live)):
            if step:
                rows = []
                for i in live:
                    state = self._seqs[seqs[i].req.request_id]
                    rows.append(Row((out[i][-1],), state.computed, tuple(state.pages), _GREEDY))
                    state.computed += 1
            picks = self.engine.read(self.engine.launch(Batch(rows))).picks
            sure = self._confident(len(rows))
            for i, pick, is_sure in zip(live, picks, sure, strict=True):
                if is_sure and pick is not None:
                    out[i].append(pick)
            live = [i for i, is_sure in zip(live, sure, strict=True)
                    if is_sure and len(out[i]) < ks[i]]
            if not live:
                break

    def _confident(self, num_rows: int) -> list[bool]:
        """Per row of the last draft forward: its top probability reaches the threshold."""
        if not self.config.confidence_threshold:
            return [True] * num_rows
        top = self.engine.top_probabilities(num_rows)
        return [p >= self.config.confidence_threshold for p in top]

    def _reserve(self, seq: Any, end: int) -> bool:
        """Draft pages for positions up to `end` of `seq`; False when the pool is short."""
        assert self.pool is not None
        state = self._seqs.setdefault(seq.req.request_id, _DraftSeq())
        need = self.pool.pages_for(end) - len(state.pages)
        if need > self.pool.num_free:
            return False
        if need > 0:
            state.pages.extend(self.pool.allocate(need))
        return True
