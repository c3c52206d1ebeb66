"""The narrow protocol the stage kit steps: whatever produces a stage's output step by step
(the LLM runtime, a talker's codec loop) implements it. All methods but `cancel` are called
from one thread, the decode thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from services.stage.ending import FinishReason


class TokenScore(Protocol):
    """A token's log-probability where it was produced, and the likeliest tokens there."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> Sequence[tuple[int, float]]: ...


class RunEvent(Protocol):
    """What one step did for one run. `logprobs` (one per token id) and `prompt_logprobs`
    (once, on the run's first event with tokens) only when the run asked for them: empty and
    None otherwise."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> FinishReason | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def metrics(self) -> Any: ...
    @property
    def logprobs(self) -> Sequence[TokenScore]: ...
    @property
    def prompt_logprobs(self) -> Sequence[TokenScore] | None: ...


class Stepper(Protocol):
    def can_step(self, held: frozenset[str]) -> bool:
        """Whether a step would do anything with the runs in `held` left out (pending
        cancels count)."""

    @property
    def has_cancels(self) -> bool:
        """A cancel waits to be applied."""

    def step(self, held: frozenset[str] = frozenset()) -> Sequence[RunEvent]:
        """One step for every run not in `held`; an event for every run that changed."""

    def apply_cancels(self) -> Sequence[RunEvent]:
        """End the runs whose cancel is pending, stepping nobody else."""

    def cancel(self, request_id: str) -> bool:
        """Ask a run to end as cancelled at the next step (any thread)."""
