"""Prompt scores (`Row.score`) in the torch engine: the head over a scored row's positions,
right after the prefill pass that ran them, and each position's raw log-probabilities.

The head runs `chunk` positions at a time into one logits buffer claimed up front. On the
device path (CUDA, or the CPU when asked) each chunk's log-probabilities stay on the device
in a `LogprobRows` of a pass's positions and reach the host with the step's picks
(torch_picks.py); a step that scores more positions than that holds (several passes) copies
what it has so far to the host at once, waiting for the device. On the host path each chunk's
logits go to the host and numpy_processors scores them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from llm_runner_svc.engines.batch import TokenLogprob
from llm_runner_svc.engines.numpy_processors import token_logprobs
from llm_runner_svc.engines.torch_logprobs import LogprobRows, to_token_logprobs
from llm_runner_svc.engines.torch_sampling import on_device

Head = Callable[[torch.Tensor, torch.Tensor], None]  # (residuals [m, hidden], out [m, vocab])


@dataclass(frozen=True)
class Span:
    """Entries at .. at+len(tokens)-1 of the device rows: scores of batch row `row`."""

    row: int
    at: int
    tokens: Sequence[int]
    top: int


@dataclass
class StepScores:
    """A step's scores: those already on the host, by batch row, then device entries in
    host copy `turn`."""

    turn: int = 0
    done: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    count: int = 0  # device entries used


class ScoreHeads:
    def __init__(self, vocab: int, capacity: int, chunk: int, device: torch.device,
                 on_device: bool) -> None:
        """Up to `capacity` scored positions on the device per step, the head run over
        `chunk` positions at a time."""
        self.chunk = chunk
        self.logits = torch.zeros((chunk, vocab), dtype=torch.float32,
                                  device=device)  # [chunk, vocab] the head's output
        self.entries = LogprobRows(capacity, device) if on_device else None
        self._step = StepScores()

    @property
    def nbytes(self) -> int:
        return int(self.logits.nbytes) + (self.entries.nbytes if self.entries else 0)

    def begin(self) -> None:
        """Forget any scores of a step that did not reach `start`."""
        self._step = StepScores()

    def add(self, head: Head, x: torch.Tensor, tokens: Sequence[int], top: int,
            row: int) -> None:
        """Score `tokens` at the positions of residual rows x [m, hidden] float32 (the
        pass's, before the next pass overwrites them), for batch row `row`."""
        step = self._step
        for lo in range(0, len(tokens), self.chunk):
            part = tokens[lo:lo + self.chunk]
            out = self.logits[:len(part)]
            head(x[lo:lo + len(part)], out)
            if self.entries is None:
                step.done.setdefault(row, []).extend(token_logprobs(
                    np.array(out.to("cpu").numpy(), copy=True), part, [top] * len(part)))
                continue
            if step.count + len(part) > self.entries.rows:
                self._flush()
            ids = on_device(part, torch.int64, out.device)
            self.entries.write(out, ids, top, step.count)
            step.spans.append(Span(row, step.count, part, top))
            step.count += len(part)

    def _flush(self) -> None:
        """The device entries so far to the host now (the step holds more than fit)."""
        assert self.entries is not None
        step = self._step
        values, ids = self.entries.now(step.count)
        _collect(step, values, ids)
        step.spans, step.count = [], 0

    def start(self, turn: int) -> StepScores:
        """The step's scores, their device entries' copy to host copy `turn` queued; the
        next step starts afresh."""
        step, self._step = self._step, StepScores()
        step.turn = turn
        if self.entries is not None:
            self.entries.start(turn, step.count)
        return step

    def finish(self, step: StepScores) -> dict[int, list[TokenLogprob]]:
        """Each scored batch row's TokenLogprobs, in position order, once the copy `start`
        queued has completed."""
        if self.entries is not None and step.count:
            _collect(step, *self.entries.host(step.turn, step.count))
        return step.done


def _collect(step: StepScores, values: np.ndarray, ids: np.ndarray) -> None:
    """The entries of `step.spans` (host copies `values`, `ids`) into `step.done`."""
    for span in step.spans:
        end = span.at + len(span.tokens)
        step.done.setdefault(span.row, []).extend(to_token_logprobs(
            values[span.at:end], ids[span.at:end], span.tokens, [span.top] * len(span.tokens)))
