"""Log-probabilities the torch engine computes on the device (torch_sampling.raw_logprobs),
on their way to the host with a step's picks.

`LogprobRows` holds up to `rows` entries on the device, each a token's log-probability and
up to MAX_LOGPROBS alternatives, and one host copy per turn of the picks' double buffer
(torch_picks.py): a step's `start` queues the copy of its entries behind its forward, and
the host reads them once the step's event has passed. On CUDA the host copies are pinned, so
the copy does not wait for the host; on the CPU (the device path run there, for tests) the
copy is a plain one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llm_runner_svc.engines.batch import MAX_LOGPROBS, TokenLogprob
from llm_runner_svc.engines.torch_sampling import raw_logprobs


class LogprobRows:
    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        width = 1 + MAX_LOGPROBS
        # [rows, 1 + MAX_LOGPROBS] float32: the token's, then the alternatives'
        self.values = torch.zeros((rows, width), dtype=torch.float32, device=device)
        self.ids = torch.zeros((rows, MAX_LOGPROBS), dtype=torch.int64,
                               device=device)  # [rows, MAX_LOGPROBS] the alternatives
        pin = device.type == "cuda"
        self._host_values = torch.zeros((2, rows, width), dtype=torch.float32, pin_memory=pin)
        self._host_ids = torch.zeros((2, rows, MAX_LOGPROBS), dtype=torch.int64,
                                     pin_memory=pin)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.ids.nbytes)

    def write(self, logits: torch.Tensor, tokens: torch.Tensor, top: int, at: int) -> None:
        """Entries at .. at+m-1 from logits [m, vocab] float32 (raw) and tokens [m] int64,
        with `top` alternatives each."""
        m = logits.shape[0]
        raw_logprobs(logits, tokens, top, self.values[at:at + m], self.ids[at:at + m])

    def start(self, turn: int, count: int) -> None:
        """Queue the copy of entries 0 .. count-1 to host copy `turn` (stream order)."""
        if count:
            self._host_values[turn, :count].copy_(self.values[:count], non_blocking=True)
            self._host_ids[turn, :count].copy_(self.ids[:count], non_blocking=True)

    def host(self, turn: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Entries 0 .. count-1 of host copy `turn`, once its copy has completed: values
        [count, 1 + MAX_LOGPROBS] float32, ids [count, MAX_LOGPROBS] int64 (copies)."""
        return (self._host_values[turn, :count].numpy().copy(),
                self._host_ids[turn, :count].numpy().copy())

    def now(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Entries 0 .. count-1 copied to the host at once (waits for the device)."""
        return (self.values[:count].to("cpu", copy=True).numpy(),
                self.ids[:count].to("cpu", copy=True).numpy())


def to_token_logprobs(values: np.ndarray, ids: np.ndarray, tokens: Sequence[int],
                      tops: Sequence[int]) -> list[TokenLogprob]:
    """TokenLogprobs of entries (`LogprobRows.host`) for `tokens`, tops[i] alternatives
    each."""
    out = []
    for i, (tok, k) in enumerate(zip(tokens, tops, strict=True)):
        top = tuple(zip(ids[i, :k].tolist(), values[i, 1:1 + k].tolist(), strict=True))
        out.append(TokenLogprob(int(tok), float(values[i, 0]), top))
    return out
