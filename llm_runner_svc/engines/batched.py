"""The common frame of an engine that computes on the host (numpy, the graph engines).

`launch` checks the batch, resolves rows that feed the previous forward's picks, cuts the
rows into passes of at most `plan.max_tokens` tokens (`batch.split_passes`), gathers each
row's captured states across passes and picks for the rows that ask (numpy_processors.py:
bias, penalties, masks, then the draw, and the picks' log-probabilities). A subclass
implements only `_run(pass)` (a segment with `verify` also leaves the logits of its K
positions before the last in `_verified`, which `launch` turns into picks). A row's prompt
scores (`Row.score`) come the same way: each of its segments that holds scored positions
runs as a verify segment over all its tokens (`PromptScores`), so the engine leaves the
logits at each of them. Everything runs inside `launch`, so `read` has nothing left to wait
for. The single-request calls
(`prefill`, `decode`, `sample`, `logits`) are one-row or one-token batches (Engine), kept
for tools and engine-level tests.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np

from llm_runner_svc.engines.base import (
    Engine,
    EnginePlan,
    HiddenStates,
    SampleSpec,
    check_batch,
    check_features,
    resolve_tokens,
)
from llm_runner_svc.engines.batch import (
    Batch,
    Pass,
    Row,
    StepOutput,
    TokenLogprob,
    split_passes,
)
from llm_runner_svc.engines.numpy_processors import pick_rows, token_logprobs, verify_row_picks
from llm_runner_svc.errors import FailedPrecondition


class CapturedStates:
    """Each row's captured states, gathered pass by pass (a row may span passes)."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = rows
        self._parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in rows]

    def add(self, p: Pass, embeddings: np.ndarray, states: np.ndarray) -> None:
        """The states [pass tokens, hidden] of pass `p`, in pass order (copied)."""
        for seg in p.segments:
            if self.rows[seg.row].capture_hidden:
                span = slice(seg.offset, seg.offset + len(seg.tokens))
                self._parts[seg.row].append((embeddings[span].copy(), states[span].copy()))

    def joined(self) -> list[HiddenStates | None]:
        return [HiddenStates(np.concatenate([e for e, _ in parts]),
                             np.concatenate([s for _, s in parts]), row.start)
                if row.capture_hidden else None
                for row, parts in zip(self.rows, self._parts, strict=True)]


class PromptScores:
    """Each scored row's prompt log-probabilities (`Row.score`), gathered pass by pass."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = rows
        self.scores: list[list[TokenLogprob] | None] = [[] if r.score else None for r in rows]

    def mark(self, p: Pass) -> None:
        """Make each segment of `p` that holds scored positions leave the logits at every
        position (a verify segment over all its tokens, logits of its last one in its logits
        row), and run it as generated tokens (the path that heads such segments)."""
        for seg in p.segments:
            row = self.rows[seg.row]
            if seg.start - row.start < len(row.score):
                seg.verify = len(seg.tokens) - 1
                seg.wants_logits = True
                seg.prompt_end = None

    def take(self, p: Pass, logits: np.ndarray, verified: dict[int, np.ndarray]) -> None:
        """The scores of `p`'s marked segments, once it has run: `logits` the engine's logits
        rows, `verified` its verify logits by batch row."""
        for seg in p.segments:
            row = self.rows[seg.row]
            lo = seg.start - row.start
            if lo >= len(row.score):
                continue
            last = logits[seg.row:seg.row + 1]  # [1, vocab]
            every = np.concatenate([verified.pop(seg.row), last]) if seg.verify else last
            hi = min(len(row.score), lo + len(seg.tokens))
            found = self.scores[seg.row]
            assert found is not None
            found += token_logprobs(every[:hi - lo], row.score[lo:hi], [row.score_top] * (hi - lo))


class BatchedEngine(Engine):
    """Set by the subclass in `preallocate`: `_plan` and `_logits` [max_batch, vocab]."""

    _plan: EnginePlan | None
    _logits: np.ndarray
    _last_picks: Sequence[int | None] | None = None
    supports_verify = True
    supports_penalties = True
    supports_masks = True
    supports_logprobs = True
    supports_scores = True
    _verified: dict[int, np.ndarray]  # batch row -> [K, vocab] logits of its verify positions
    _row_adapters: Sequence[int] = ()  # the launching batch's, per row
    # Held while a launch computes. The vision tower (numpy_vision.py), which runs on Admit's
    # worker thread, takes it layer by layer: two threads in OpenBLAS at once on a small CPU
    # run many times slower than the same work taken in turns (docs/benchmarks.md).
    compute_lock: threading.Lock | None = None

    @abstractmethod
    def _run(self, p: Pass) -> tuple[np.ndarray, np.ndarray] | None:
        """Run the pass: write every token's KV into its row's pages, leave the last token's
        logits of each segment with `wants_logits` in logits row `segment.row`. When
        `p.capture`, return the layer-0 and hidden-layer states [pass tokens, hidden], in pass order
        (valid until the next pass)."""

    def _checked_plan(self) -> EnginePlan:
        if self._plan is None:
            raise FailedPrecondition("engine used before preallocate()")
        return self._plan

    def launch(self, batch: Batch) -> StepOutput:
        with self.compute_lock or nullcontext():
            return self._launch(batch)

    def _launch(self, batch: Batch) -> StepOutput:
        plan = self._checked_plan()
        check_batch(self.config, plan, batch, self.num_adapters, self.supports_embeds)
        check_features(self, batch)
        tokens = resolve_tokens(batch, self._last_picks)
        rows = batch.rows
        self._row_adapters = [r.adapter for r in rows]
        caps = CapturedStates(rows)
        scores = PromptScores(rows) if any(r.score for r in rows) else None
        self._verified = {}
        for p in split_passes(batch, tokens, plan.max_tokens, plan.prefill_chunk):
            if scores is not None:
                scores.mark(p)
            states = self._run(p)
            if states is not None:
                caps.add(p, *states)
            if scores is not None:
                scores.take(p, self._logits, self._verified)
        hidden = caps.joined()
        picks: list[int | None] = [None] * len(rows)
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        chosen = [i for i, r in enumerate(rows) if r.sample is not None]
        if chosen:
            specs = [r.sample for r in rows if r.sample is not None]
            found, found_lp = pick_rows(self._logits[chosen], specs)  # (a copy of the rows)
            for i, tok, lp in zip(chosen, found, found_lp, strict=True):
                picks[i], logprobs[i] = tok, lp
        self._last_picks = picks
        verified = [verify_row_picks(self._verified[i],
                                     r.verify_samples or (r.sample,) * r.verify, r.tokens[1:])
                    if r.verify and r.sample is not None else None
                    for i, r in enumerate(rows)]
        return StepOutput(picks, hidden, verified, logprobs,
                          scores.scores if scores is not None else [None] * len(rows))

    def read(self, handle: StepOutput) -> StepOutput:
        return handle

    # ---- single-request calls (`prefill` and `decode` come from Engine) ------------------
    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        self._checked_plan()
        return pick_rows(self._logits[:len(specs)], specs)[0]

    def logits(self, num_rows: int) -> np.ndarray:
        self._checked_plan()
        return self._logits[:num_rows]

    def top_probabilities(self, num_rows: int) -> list[float]:
        logits = self.logits(num_rows).astype(np.float64)  # [rows, vocab]
        return (1.0 / np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)).tolist()

    def close(self) -> None:
        self._last_picks = None
