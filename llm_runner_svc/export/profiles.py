"""Optimization profiles of a step plan: one for prefill, one for decode.

A prefill runs one request's chunk (batch 1, up to `prefill_chunk` new positions); a decode
step runs up to `max_batch` rows of one position each. Both read up to `max_seq - 1` cached
positions. The shapes follow `signature`'s symbolic axes.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.export.signature import TensorDesc

PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True)
class PlanLimits:
    """The largest step a plan accepts."""

    max_batch: int = 8
    max_seq: int = 2048
    prefill_chunk: int = 256

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_seq, self.prefill_chunk) <= 0:
            raise InvalidArgument("max_batch, max_seq and prefill_chunk must be positive")


@dataclass(frozen=True)
class Profile:
    """min / opt / max of each dynamic axis for one kind of step."""

    name: str
    batch: tuple[int, int, int]
    seq: tuple[int, int, int]
    past: tuple[int, int, int]

    def shapes(self, t: TensorDesc) -> tuple[tuple[int, ...], ...]:
        """(min, opt, max) concrete shapes of an input tensor."""
        out = []
        for k in range(3):
            axes = {"batch": self.batch[k], "seq": self.seq[k], "past": self.past[k],
                    "total": self.seq[k] + self.past[k]}
            out.append(tuple(d if isinstance(d, int) else axes[d] for d in t.dims))
        return tuple(out)

    def as_dict(self, inputs: list[TensorDesc]) -> dict[str, object]:
        return {"name": self.name, "batch": list(self.batch), "seq": list(self.seq),
                "past": list(self.past),
                "shapes": {t.name: [list(s) for s in self.shapes(t)] for t in inputs}}


def plan_profiles(limits: PlanLimits) -> list[Profile]:
    """Prefill first (profile 0), then decode (profile 1)."""
    chunk = min(limits.prefill_chunk, limits.max_seq)
    past = (0, limits.max_seq // 2, limits.max_seq - 1)
    return [Profile(PREFILL, (1, 1, 1), (1, chunk, chunk), past),
            Profile(DECODE, (1, limits.max_batch, limits.max_batch), (1, 1, 1), past)]
