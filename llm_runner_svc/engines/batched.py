"""The common frame of an engine that computes on the host (numpy, the graph engines).

`launch` checks the batch, resolves rows that feed the previous forward's picks, cuts the
rows into passes of at most `plan.max_tokens` tokens (`batch.split_passes`), gathers each
row's captured states across passes and samples the rows that ask for a pick. A subclass
implements only `_run(pass)` (a segment with `verify` also leaves the logits of its K
positions before the last in `_verified`, which `launch` turns into picks). Everything runs
inside `launch`, so `read` has nothing left to wait for. The single-request calls
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
    resolve_tokens,
)
from llm_runner_svc.engines.batch import Batch, Pass, Row, StepOutput, split_passes
from llm_runner_svc.engines.numpy_sampling import apply_logit_bias, sample_rows, verify_picks
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


class BatchedEngine(Engine):
    """Set by the subclass in `preallocate`: `_plan` and `_logits` [max_batch, vocab]."""

    _plan: EnginePlan | None
    _logits: np.ndarray
    _last_picks: Sequence[int | None] | None = None
    supports_verify = True
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
        tokens = resolve_tokens(batch, self._last_picks)
        rows = batch.rows
        self._row_adapters = [r.adapter for r in rows]
        caps = CapturedStates(rows)
        self._verified = {}
        for p in split_passes(batch, tokens, plan.max_tokens, plan.prefill_chunk):
            states = self._run(p)
            if states is not None:
                caps.add(p, *states)
        hidden = caps.joined()
        picks: list[int | None] = [None] * len(rows)
        chosen = [i for i, r in enumerate(rows) if r.sample is not None]
        if chosen:
            specs = [rows[i].sample for i in chosen]
            logits = self._logits[chosen]
            apply_logit_bias(logits, specs)  # type: ignore[arg-type]
            for i, tok in zip(chosen, sample_rows(logits, specs), strict=True):  # type: ignore[arg-type]
                picks[i] = tok
        self._last_picks = picks
        verified = [verify_picks(self._verified[i], r.verify_samples or (r.sample,) * r.verify,
                                 r.tokens[1:]) if r.verify and r.sample is not None else None
                    for i, r in enumerate(rows)]
        return StepOutput(picks, hidden, verified)

    def read(self, handle: StepOutput) -> StepOutput:
        return handle

    # ---- single-request calls (`prefill` and `decode` come from Engine) ------------------
    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        self._checked_plan()
        logits = self._logits[:len(specs)]
        apply_logit_bias(logits, specs)
        return sample_rows(logits, specs)

    def logits(self, num_rows: int) -> np.ndarray:
        self._checked_plan()
        return self._logits[:num_rows]

    def top_probabilities(self, num_rows: int) -> list[float]:
        logits = self.logits(num_rows).astype(np.float64)  # [rows, vocab]
        return (1.0 / np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)).tolist()

    def close(self) -> None:
        self._last_picks = None
