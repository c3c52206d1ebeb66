"""The engine interface: the tensor math behind the runtime.

An engine owns the weights on its device, the paged KV pool, activation, logits and
hidden-state staging buffers, and the sampler. The runtime owns everything else (which pages
a request holds, which rows are in a step, when a request ends) and talks to the engine in
plain Python values, so it never imports a tensor library.

Call order: `preallocate(plan)` once, then any number of `prefill` / `decode`, each followed
by `sample` (and optionally `logits`), then `close()`. Engines are not thread-safe: one
runtime drives one engine from one thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_runner_svc.errors import FailedPrecondition, InvalidArgument
from llm_runner_svc.models.spec import ModelConfig

GREEDY_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class EnginePlan:
    """What `preallocate` sizes every buffer for."""

    max_batch: int  # rows in one decode step
    max_seq: int  # positions per request, prompt included
    page_size: int  # tokens per KV page
    num_pages: int  # pages in the pool (page ids 0 .. num_pages-1)
    prefill_chunk: int = 256  # prompt tokens per forward inside one prefill
    hidden_layer: int | None = None  # accept_hidden_layer; None = hidden capture disabled


@dataclass(frozen=True)
class SampleSpec:
    """How to pick one row's next token. `uniform` is the row's random draw in [0, 1)."""

    temperature: float
    top_k: int  # 0 = whole vocabulary
    top_p: float
    uniform: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    is_greedy: bool = field(init=False, repr=False, compare=False)  # read on every step

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_greedy",
                           self.temperature < GREEDY_TEMPERATURE or self.top_k == 1)


@dataclass(frozen=True)
class DecodeRow:
    """One request's input to a decode step."""

    token_id: int  # the token fed at `position`
    position: int
    page_table: Sequence[int]  # page ids holding positions 0 .. position
    capture_hidden: bool = False


CHAINED = -1  # a DecodeRow token: the one the engine's previous decode picked for this row


@dataclass(frozen=True)
class HiddenStates:
    """Captured states for a window of positions; arrays are the engine's host tensors."""

    embeddings: Any  # [num_positions, hidden] layer-0 (token embedding) output
    states: Any  # [num_positions, hidden] at the plan's hidden_layer
    start_position: int


class Engine(ABC):
    """A decoder on one device. See the module docstring for the call order."""

    name: str
    config: ModelConfig
    # Whether decode() takes rows whose token is CHAINED: the pick of the engine's previous
    # decode for the row at the same index (the same rows in the same order), read where the
    # engine keeps it, so the next step can start before the host has read the picks.
    supports_chaining = False

    @abstractmethod
    def preallocate(self, plan: EnginePlan) -> None:
        """Claim every buffer for `plan`. Nothing on the step path allocates afterwards.
        Calling it again with the same plan is a no-op; with another plan, an error."""

    @abstractmethod
    def prefill(self, token_ids: Sequence[int], start_pos: int, page_table: Sequence[int],
                capture_hidden: bool = False) -> HiddenStates | None:
        """Run positions start_pos .. start_pos+len-1 of one request, writing their KV into
        the pages of `page_table`; leave the last position's logits in logits row 0.
        Returns the captured states of the window when asked."""

    @abstractmethod
    def decode(self, rows: Sequence[DecodeRow]) -> list[HiddenStates | None]:
        """One token per row; row i's logits land in logits row i. Returns, per row, its
        captured states (None for rows that did not ask)."""

    @abstractmethod
    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        """Pick a token for logits rows 0 .. len(specs)-1. Applies logit bias in place."""

    def start_sample(self, specs: Sequence[SampleSpec]) -> Any:
        """`sample` in two halves: start the picks (an engine on a device queues them and
        their copy to the host without waiting) and return what `finish_sample` takes. A
        decode may run between the halves."""
        return self.sample(specs)

    def finish_sample(self, started: Any) -> list[int]:
        """The picks `start_sample` started, once they are on the host."""
        picks: list[int] = started
        return picks

    @abstractmethod
    def logits(self, num_rows: int) -> Any:
        """The float32 logits [num_rows, vocab] of the last forward; valid until the next one."""

    @abstractmethod
    def close(self) -> None:
        """Release every buffer. Idempotent."""

    def memory_bytes(self) -> int:
        """Bytes held by preallocated buffers (weights excluded); 0 before preallocate."""
        return 0


# ---- argument checks every engine makes the same way ---------------------------------------

def is_same_plan(current: EnginePlan | None, plan: EnginePlan) -> bool:
    """True when `preallocate(plan)` has already run (a no-op); an error for another plan."""
    if current is None:
        return False
    if plan != current:
        raise FailedPrecondition("engine already preallocated for another plan")
    return True


def check_hidden_layer(config: ModelConfig, plan: EnginePlan) -> None:
    layer = plan.hidden_layer
    if layer is not None and not (layer == -1 or 1 <= layer <= config.num_layers):
        raise InvalidArgument(
            f"accept_hidden_layer must be -1 or in 1..{config.num_layers}, got {layer}")


def check_prefill_fits(plan: EnginePlan, num_tokens: int, start_pos: int) -> None:
    if num_tokens == 0 or start_pos + num_tokens > plan.max_seq:
        raise InvalidArgument(
            f"prefill of {num_tokens} tokens at {start_pos} does not fit maxSeq {plan.max_seq}")


def check_token_ids(config: ModelConfig, token_ids: Sequence[int]) -> None:
    if min(token_ids) < 0 or max(token_ids) >= config.vocab_size:
        raise InvalidArgument(f"token id outside the vocabulary 0..{config.vocab_size - 1}")
