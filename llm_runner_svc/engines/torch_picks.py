"""The torch engine's picks: a step's tokens chosen where its logits are, and handed to the
host without holding up the next step.

Every step writes its picks into `RunState.next_ids`; the next step's rows that feed a pick
(`Row.from_pick`, staged as the token id -1-j) take it from there on the device
(`Picks.feed`), before that step's own picks overwrite it. On CUDA the picks are copied to
one of two pinned host buffers behind an event: step n+1 is launched (its copy going to the
other buffer) before the host waits for step n's, so the device never idles while the host
turns picks into events. On the CPU the picks are sampled on the host at once
(numpy_processors.py), unless the engine asks for the device path there (tests of it).

A step whose rows are all plainly greedy (`SampleSpec.is_plain`) takes the argmax the forward
left. Otherwise, on the device: a copy of the raw logits when a row asks for
log-probabilities, then bias, penalties and token masks in place (the masks computed on the
host while the device runs the forward, uploaded from a pinned buffer per turn), the picks,
and the raw log-probabilities of the picks (torch_logprobs.py), copied to the host with them,
as are the step's prompt scores (torch_scores.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llm_runner_svc.engines.batch import MAX_VERIFY, SampleSpec, TokenLogprob
from llm_runner_svc.engines.numpy_processors import fill_masks, mask_words, pick_rows
from llm_runner_svc.engines.torch_logprobs import LogprobRows, to_token_logprobs
from llm_runner_svc.engines.torch_sampling import (
    apply_logit_bias,
    apply_mask_words,
    apply_penalties,
    sample_on_device,
)
from llm_runner_svc.engines.torch_scores import ScoreHeads, StepScores


@dataclass(frozen=True)
class Started:
    """Picks on their way to the host: the host buffer they land in, or (host path) the
    picks and their log-probabilities."""

    turn: int
    count: int
    scores: StepScores
    host: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    tops: tuple[int, ...] = ()  # device path, a row asking for log-probabilities: each spec's


@dataclass(frozen=True)
class Picked:
    """A step's picks, per row its pick's log-probabilities (None: not asked), and its prompt
    scores by batch row."""

    picks: list[int]
    logprobs: list[TokenLogprob | None]
    scores: dict[int, list[TokenLogprob]]


class Picks:
    def __init__(self, logits: torch.Tensor, next_ids: torch.Tensor, max_tokens: int,
                 max_batch: int, score_chunk: int, on_device: bool | None = None) -> None:
        """`logits` [decode_rows, vocab] float32 and `next_ids` [decode_rows] int64 of the run
        state; forwards of up to `max_tokens` tokens, steps of up to `max_batch` rows, the
        prompt-score head over `score_chunk` positions at a time. `on_device`: on the CPU,
        pick by the device path too (on CUDA it always does)."""
        dev = logits.device
        self._logits, self._next = logits, next_ids
        # a verify row's logits at its last K + 1 positions, and each row's greedy picks at
        # its K proposed ones
        self.verify_logits = torch.zeros((MAX_VERIFY + 1, logits.shape[1]),
                                         dtype=torch.float32,
                                         device=dev)  # [MAX_VERIFY + 1, vocab]
        self.verify_ids = torch.zeros((next_ids.shape[0], MAX_VERIFY), dtype=torch.int64,
                                      device=dev)  # [max_batch, MAX_VERIFY]
        self._scratch = torch.zeros((3, max_tokens), dtype=torch.int64, device=dev)
        self._mask = torch.zeros(max_tokens, dtype=torch.bool, device=dev)
        self._is_cuda = logits.is_cuda
        self._on_device = self._is_cuda or bool(on_device)
        self._turn = 0
        self._done = (torch.cuda.Event(), torch.cuda.Event()) if self._is_cuda else None
        self.scores = ScoreHeads(logits.shape[1], max_tokens, score_chunk, dev, self._on_device)
        self._extra = 0
        if self._on_device:
            vocab, words = logits.shape[1], mask_words(logits.shape[1])
            self._host = torch.zeros((2, next_ids.shape[0]), dtype=torch.int64,
                                     pin_memory=self._is_cuda)
            self._raw = torch.zeros((max_batch, vocab), dtype=torch.float32,
                                    device=dev)  # [max_batch, vocab] logits before processing
            self.logprobs = LogprobRows(max_batch, dev)
            # token masks: filled on the host, each turn's rows uploaded from its own pinned
            # buffer (the other turn's upload may still be queued)
            self._mask_fill = np.zeros((max_batch, words), np.int32)  # [max_batch, words]
            self._mask_host = torch.zeros((2, max_batch, words), dtype=torch.int32,
                                          pin_memory=self._is_cuda)
            self._mask_words = torch.zeros((max_batch, words), dtype=torch.int32, device=dev)
            self._extra = int(self._raw.nbytes + self.logprobs.nbytes + self._mask_words.nbytes)

    @property
    def nbytes(self) -> int:
        return int(self._scratch.nbytes + self._mask.nbytes + self.verify_logits.nbytes
                   + self.verify_ids.nbytes + self.scores.nbytes + self._extra)

    def feed(self, ids: torch.Tensor) -> None:
        """Replace each negative entry -1-j of the staged token ids `ids` by pick j of the
        last step, on the device and in stream order (after the staging copy, before the
        forward reads them), into buffers claimed up front (no allocation)."""
        n = ids.numel()
        x, src, picked = self._scratch[:, :n]
        mask = self._mask[:n]
        x.copy_(ids)
        torch.lt(x, 0, out=mask)
        torch.neg(x, out=src)
        src.sub_(1).clamp_(min=0)
        torch.index_select(self._next, 0, src, out=picked)
        torch.where(mask, picked, x, out=src)
        ids.copy_(src)

    def start(self, specs: Sequence[SampleSpec], has_argmax: bool) -> Started:
        """Pick for logits rows 0 .. len(specs)-1 (processed in place) into `next_ids`, and
        start their copy to the host with their log-probabilities and the step's prompt
        scores. `has_argmax`: the forward already left each row's argmax in `next_ids`,
        which is every pick when all rows are plainly greedy."""
        n = len(specs)
        logits = self._logits[:n]
        if not self._on_device:
            picks, logprobs = pick_rows(logits.numpy(), specs)
            self._next[:n].numpy()[:] = picks
            return Started(0, n, self.scores.start(0), tuple(picks), tuple(logprobs))
        turn = self._turn = 1 - self._turn
        top = max(sp.logprobs for sp in specs)
        modifies = any(sp.logit_bias or sp.penalties or sp.mask is not None for sp in specs)
        raw = logits
        if top >= 0 and modifies:
            raw = self._raw[:n]
            raw.copy_(logits)
        if modifies:
            apply_logit_bias(logits, specs)
            apply_penalties(logits, specs)
            self._apply_masks(logits, specs, turn)
        if modifies or not (has_argmax and all(sp.is_greedy for sp in specs)):
            sample_on_device(logits, specs, self._next[:n])
        if top >= 0:
            self.logprobs.write(raw, self._next[:n], top, 0)
            self.logprobs.start(turn, n)
        self._host[turn, :n].copy_(self._next[:n], non_blocking=True)
        scores = self.scores.start(turn)
        if self._done is not None:
            self._done[turn].record()
        return Started(turn, n, scores,
                       tops=tuple(sp.logprobs for sp in specs) if top >= 0 else ())

    def _apply_masks(self, logits: torch.Tensor, specs: Sequence[SampleSpec],
                     turn: int) -> None:
        """The rows' token masks on logits [n, vocab], in place: their bits filled on the
        host now (the forward is already queued) and uploaded in stream order."""
        rows = [i for i, sp in enumerate(specs) if sp.mask is not None]
        if not rows:
            return
        n = len(specs)
        filled = self._mask_fill[:len(rows)]
        fill_masks([specs[i].mask for i in rows], filled)  # type: ignore[misc]
        host = self._mask_host[turn, :n]
        words = host.numpy()  # [n, words] int32
        words[:] = -1  # rows without a mask: every token
        words[rows] = filled
        self._mask_words[:n].copy_(host, non_blocking=True)
        apply_mask_words(logits, self._mask_words[:n])

    def wait(self, started: Started) -> Picked:
        """The picks `start` started, once they are on the host (the step's one wait)."""
        if not self._on_device:
            return Picked(list(started.host), list(started.logprobs),
                          self.scores.finish(started.scores))
        if self._done is not None:
            self._done[started.turn].synchronize()
        picks: list[int] = self._host[started.turn, :started.count].tolist()
        logprobs: list[TokenLogprob | None] = [None] * started.count
        if started.tops:
            values, ids = self.logprobs.host(started.turn, started.count)
            asked = [i for i, k in enumerate(started.tops) if k >= 0]
            found = to_token_logprobs(values[asked], ids[asked], [picks[i] for i in asked],
                                      [started.tops[i] for i in asked])
            for i, lp in zip(asked, found, strict=True):
                logprobs[i] = lp
        return Picked(picks, logprobs, self.scores.finish(started.scores))
