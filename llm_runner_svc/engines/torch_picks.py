"""The torch engine's picks: a step's tokens chosen where its logits are, and handed to the
host without holding up the next step.

Every step writes its picks into `RunState.next_ids`; the next step's rows that feed a pick
(`Row.from_pick`, staged as the token id -1-j) take it from there on the device
(`Picks.feed`), before that step's own picks overwrite it. On CUDA the picks are copied to
one of two pinned host buffers behind an event: step n+1 is launched (its copy going to the
other buffer) before the host waits for step n's, so the device never idles while the host
turns picks into events. On the CPU the picks are sampled on the host at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llm_runner_svc.engines.batch import MAX_VERIFY, SampleSpec
from llm_runner_svc.engines.numpy_sampling import apply_logit_bias as host_logit_bias
from llm_runner_svc.engines.numpy_sampling import sample_rows
from llm_runner_svc.engines.torch_sampling import apply_logit_bias, sample_on_device


@dataclass(frozen=True)
class Started:
    """Picks on their way to the host: the pinned buffer they land in, or (CPU) the picks."""

    turn: int
    count: int
    host: tuple[int, ...] = ()


class Picks:
    def __init__(self, logits: torch.Tensor, next_ids: torch.Tensor, max_tokens: int) -> None:
        """`logits` [max_batch, vocab] float32 and `next_ids` [max_batch] int64 of the run
        state; forwards of up to `max_tokens` tokens."""
        self._logits, self._next = logits, next_ids
        # a verify row's logits at its last K + 1 positions, and each row's greedy picks at
        # its K proposed ones
        self.verify_logits = torch.zeros((MAX_VERIFY + 1, logits.shape[1]),
                                         dtype=torch.float32,
                                         device=logits.device)  # [MAX_VERIFY + 1, vocab]
        self.verify_ids = torch.zeros((next_ids.shape[0], MAX_VERIFY), dtype=torch.int64,
                                      device=logits.device)  # [max_batch, MAX_VERIFY]
        self._scratch = torch.zeros((3, max_tokens), dtype=torch.int64, device=logits.device)
        self._mask = torch.zeros(max_tokens, dtype=torch.bool, device=logits.device)
        self._is_cuda = logits.is_cuda
        self._turn = 0
        if self._is_cuda:
            self._done = (torch.cuda.Event(), torch.cuda.Event())
            self._host = torch.zeros((2, next_ids.shape[0]), dtype=torch.int64, pin_memory=True)

    @property
    def nbytes(self) -> int:
        return int(self._scratch.nbytes + self._mask.nbytes + self.verify_logits.nbytes
                   + self.verify_ids.nbytes)

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
        """Pick for logits rows 0 .. len(specs)-1 (logit bias applied in place) into
        `next_ids`, and start their copy to the host. `has_argmax`: the forward already left
        each row's argmax in `next_ids`, which is every pick when all rows are plainly
        greedy."""
        n = len(specs)
        logits = self._logits[:n]
        if not self._is_cuda:
            host = logits.numpy()
            host_logit_bias(host, specs)
            picks = sample_rows(host, specs)
            self._next[:n].numpy()[:] = picks
            return Started(0, n, tuple(picks))
        is_plain = all(sp.is_greedy and not sp.logit_bias for sp in specs)
        if not (is_plain and has_argmax):
            apply_logit_bias(logits, specs)
            sample_on_device(logits, specs, self._next[:n])
        turn = self._turn = 1 - self._turn
        self._host[turn, :n].copy_(self._next[:n], non_blocking=True)
        self._done[turn].record()
        return Started(turn, n)

    def wait(self, started: Started) -> list[int]:
        """The picks `start` started, once they are on the host (the step's one wait)."""
        if not self._is_cuda:
            return list(started.host)
        self._done[started.turn].synchronize()
        picks: list[int] = self._host[started.turn, :started.count].tolist()
        return picks
