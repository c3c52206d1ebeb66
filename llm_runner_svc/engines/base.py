"""The engine interface: the tensor math behind the runtime.

An engine owns the weights on its device, the paged KV pool, activation, logits and
hidden-state staging buffers, and the sampler. The runtime owns everything else (which pages
a request holds, which rows are in a step, when a request ends) and talks to the engine in
plain Python values, so it never imports a tensor library.

Call order: `preallocate(plan)` once, then steps, then `close()`. A step is
`launch(batch)`, which starts the batch (`batch.py`) and returns a handle, and later
`read(handle)`, which gives its picks and captured states; the runtime launches step n+1
before it reads step n, so a row of step n+1 may feed a pick of step n (`Row.from_pick`)
that never left the device. The host engines implement `launch` once over flat passes
(`batched.py`); the torch engine runs a batch of one-token rows from a captured graph and
any other batch as one prefill forward (torch_engine.py). `prefill` and `decode`, one
request's window or one token per row, are one-batch steps kept for tools and engine-level
tests. Engines are not thread-safe: one runtime drives one engine from one thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llm_runner_svc.engines.batch import (
    GREEDY_TEMPERATURE,
    MAX_LOGPROBS,
    MAX_VERIFY,
    Batch,
    HiddenStates,
    Row,
    SampleSpec,
    StepOutput,
)
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument, Unimplemented
from llm_runner_svc.models.spec import ModelConfig

if TYPE_CHECKING:  # models/lora.py holds numpy arrays; this module imports no tensor library
    from llm_runner_svc.models.lora import LoraAdapter

__all__ = ["GREEDY_TEMPERATURE", "Batch", "DecodeRow", "Engine", "EnginePlan",
           "HiddenStates", "SampleSpec", "StepOutput"]

@dataclass(frozen=True)
class EnginePlan:
    """What `preallocate` sizes every buffer for."""

    max_batch: int  # rows in one decode step
    max_seq: int  # positions per request, prompt included
    page_size: int  # tokens per KV page
    num_pages: int  # pages in the pool (page ids 0 .. num_pages-1)
    prefill_chunk: int = 256  # the longest stretch of one row in one engine pass
    hidden_layer: int | None = None  # accept_hidden_layer; None = hidden capture disabled
    step_tokens: int = 0  # the runtime's tokens per step; an engine may size one pass to it
    verify_tokens: int = 0  # spec_decode's K: the most proposed tokens of a verify row

    @property
    def max_tokens(self) -> int:
        """Tokens in one engine pass: a step's decode rows, or a prefill chunk."""
        return max(self.max_batch, self.prefill_chunk)

    @property
    def max_decode_rows(self) -> int:
        """Positions in a step of decode and verify rows: K + 1 for each verify row (an
        engine may run each position as a row of its decode step)."""
        return self.max_batch * (1 + self.verify_tokens)


@dataclass(frozen=True)
class DecodeRow:
    """One request's input to a decode step."""

    token_id: int  # the token fed at `position`
    position: int
    page_table: Sequence[int]  # page ids holding positions 0 .. position
    capture_hidden: bool = False
    adapter: int = 0  # the LoRA adapter slot (0: the base model)


class Engine(ABC):
    """A decoder on one device. See the module docstring for the call order."""

    name: str
    config: ModelConfig
    default_step_tokens = 512  # tokens per step unless the deployment says (maxTokensPerStep)
    supports_verify = False  # returns `StepOutput.verified` for rows with `verify`
    num_adapters = 0  # LoRA adapter slots a row may name (Row.adapter 1 .. num_adapters)
    supports_embeds = False  # takes rows with EmbedSpans (image embeddings)
    # What a pick may ask beyond temperature, top-k, top-p and logit bias (numpy_processors.py
    # states the rules); an engine refuses a batch that asks for what it does not do
    # (`check_features`), so the runtime refuses such a request at admission instead.
    supports_penalties = False  # SampleSpec.penalties and min_p
    supports_masks = False  # SampleSpec.mask
    supports_logprobs = False  # SampleSpec.logprobs: StepOutput.logprobs
    supports_scores = False  # Row.score: StepOutput.scores
    max_lora_rank: int | None = None  # the largest rank a slot holds (None: any)

    @abstractmethod
    def preallocate(self, plan: EnginePlan) -> None:
        """Claim every buffer for `plan`. Nothing on the step path allocates afterwards.
        Calling it again with the same plan is a no-op; with another plan, an error."""

    @abstractmethod
    def launch(self, batch: Batch) -> Any:
        """Launch one step: every row's tokens run, their KV is written into the row's pages,
        each row's last logits land in the logits row of its index, and rows with a sample
        spec get a pick. Returns the handle `read` takes; at most the last handle may still
        be unread when the next forward is launched."""

    @abstractmethod
    def read(self, handle: Any) -> StepOutput:
        """The picks and captured states of the step `handle` launched (once it is done)."""

    def prefill(self, token_ids: Sequence[int], start_pos: int, page_table: Sequence[int],
                capture_hidden: bool = False) -> HiddenStates | None:
        """One row of `token_ids` at start_pos .. start_pos+len-1, writing their KV into
        the pages of `page_table`; leaves the last position's logits in logits row 0.
        Returns the captured states of the window when asked."""
        row = Row(tuple(token_ids), start_pos, tuple(page_table), capture_hidden=capture_hidden)
        return self.read(self.launch(Batch((row,), keep_logits=True))).hidden[0]

    def decode(self, rows: Sequence[DecodeRow]) -> list[HiddenStates | None]:
        """One token per row; row i's logits land in logits row i. Returns, per row, its
        captured states (None for rows that did not ask)."""
        batch = Batch(tuple(Row((r.token_id,), r.position, tuple(r.page_table),
                                capture_hidden=r.capture_hidden) for r in rows), keep_logits=True)
        return list(self.read(self.launch(batch)).hidden)

    @abstractmethod
    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        """Pick a token for logits rows 0 .. len(specs)-1. Processes the logits in place
        (bias, penalties, masks: numpy_processors.py)."""

    @abstractmethod
    def logits(self, num_rows: int) -> Any:
        """The float32 logits [num_rows, vocab] of the last forward; valid until the next one."""

    def top_probabilities(self, num_rows: int) -> list[float]:
        """The largest softmax probability of logits rows 0 .. num_rows-1 of the last
        forward (a draft's confidence in its pick)."""
        raise FailedPrecondition(f"engine {self.name} gives no probabilities")

    @abstractmethod
    def close(self) -> None:
        """Release every buffer. Idempotent."""

    def set_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put a LoRA adapter (loaded for this model) into adapter slot `slot` (1 ..
        num_adapters), or empty the slot (None). Between steps, on the stepping thread: no
        row of a step still running may name the slot (the runtime's `set_adapter`)."""
        raise Unimplemented(f"the {self.name} engine serves no LoRA adapters")

    def reserve_adapters(self, num_slots: int, max_rank: int | None = None) -> None:
        """Hold `num_slots` LoRA adapter slots (maxLoras) of rank up to `max_rank` (None: the
        engine's default), the adapters it was built with keeping slots 1, 2, ...; before
        `preallocate`. An engine built with adapters holds as many slots as it has adapters
        until this is called."""
        raise Unimplemented(f"the {self.name} engine serves no LoRA adapters")

    def check_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        """What `set_adapter` checks, without changing anything: InvalidArgument for a slot
        outside 1 .. num_adapters or an adapter of a rank above `max_lora_rank`."""
        if not self.num_adapters:
            raise Unimplemented(f"the {self.name} engine holds no LoRA adapter slots")
        if not 1 <= slot <= self.num_adapters:
            raise InvalidArgument(f"adapter slot {slot}: the engine has slots 1.."
                                  f"{self.num_adapters}")
        rank = self.max_lora_rank
        if adapter is not None and rank is not None and adapter.rank > rank:
            raise InvalidArgument(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}; "
                                  f"this stage holds adapters of rank up to {rank} "
                                  "(maxLoraRank)")

    def memory_bytes(self) -> int:
        """Bytes held by preallocated buffers (weights excluded); 0 before preallocate."""
        return 0

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one position takes in the pool (keys and values of every layer)."""
        return 2 * self.config.num_layers * self.config.kv_dim * 4

    def free_device_bytes(self) -> int | None:
        """Free device memory now (weights loaded), for a pool sized as a fraction of it;
        None for an engine on the host."""
        return None


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


def check_reserve(engine: Engine, num_slots: int, is_preallocated: bool) -> None:
    if is_preallocated:
        raise FailedPrecondition("reserve_adapters comes before preallocate")
    if num_slots < engine.num_adapters:
        raise InvalidArgument(f"maxLoras {num_slots} is below the {engine.num_adapters} "
                              "adapters the engine holds")


def check_batch(config: ModelConfig, plan: EnginePlan, batch: Batch,
                num_adapters: int = 0, supports_embeds: bool = True) -> None:
    """The checks every engine makes on a batch before it runs anything; a row's adapter
    must be one of the engine's `num_adapters` (or 0), and a row with embeddings needs an
    engine that takes them."""
    rows = batch.rows
    if not supports_embeds and any(r.embeds for r in rows):
        raise InvalidArgument("a row carries input embeddings (an image's); this engine "
                              "takes token ids only")
    if not 0 < len(rows) <= plan.max_batch:
        raise InvalidArgument(f"batch of {len(rows)} rows; maxBatch is {plan.max_batch}")
    for row in rows:
        if not 0 <= row.adapter <= num_adapters:
            raise InvalidArgument(f"row adapter {row.adapter}: the engine holds "
                                  f"{num_adapters} LoRA adapters")
        if row.length == 0 or row.start < 0 or row.end > plan.max_seq:
            raise InvalidArgument(f"row of {row.length} tokens at {row.start} does not fit "
                                  f"maxSeq {plan.max_seq}")
        if not 0 <= row.verify <= min(MAX_VERIFY, row.length - 1):
            raise InvalidArgument(f"verify row of {row.length} tokens proposes {row.verify}; "
                                  f"at most {MAX_VERIFY} and fewer than its tokens")
        if len(row.pages) * plan.page_size < row.end:
            raise InvalidArgument(f"row up to position {row.end - 1} has only "
                                  f"{len(row.pages)} pages")
        if row.tokens:
            check_token_ids(config, row.tokens)


def check_features(engine: Engine, batch: Batch) -> None:
    """InvalidArgument for a row that asks for a feature the engine lacks (its `supports_*`
    attributes) or asks for it out of range: more than MAX_LOGPROBS alternatives, prompt
    scores past the row's tokens or on a verify row."""
    for row in batch.rows:
        spec = row.sample
        if spec is not None and not spec.is_plain:
            if (spec.penalties or spec.min_p) and not engine.supports_penalties:
                raise InvalidArgument(f"the {engine.name} engine applies no penalties or min_p")
            if spec.mask is not None and not engine.supports_masks:
                raise InvalidArgument(f"the {engine.name} engine applies no token masks")
            if spec.logprobs >= 0 and not engine.supports_logprobs:
                raise InvalidArgument(f"the {engine.name} engine gives no log-probabilities")
            if spec.logprobs > MAX_LOGPROBS:
                raise InvalidArgument(f"{spec.logprobs} top log-probabilities asked; at most "
                                      f"{MAX_LOGPROBS}")
        if not row.score:
            continue
        if not engine.supports_scores:
            raise InvalidArgument(f"the {engine.name} engine gives no prompt log-probabilities")
        if len(row.score) > row.length or row.verify or not 0 <= row.score_top <= MAX_LOGPROBS:
            raise InvalidArgument(f"prompt scores of {len(row.score)} tokens (top "
                                  f"{row.score_top}) on a row of {row.length} tokens, verify "
                                  f"{row.verify}: at most the row's tokens, top 0.."
                                  f"{MAX_LOGPROBS}, not on a verify row")
        check_token_ids(engine.config, row.score)


def resolve_tokens(batch: Batch, last_picks: Sequence[int | None] | None) -> list[list[int]]:
    """Each row's tokens, a `from_pick` row's taken from the previous forward's picks."""
    out: list[list[int]] = []
    for row in batch.rows:
        if row.from_pick is None:
            out.append(list(row.tokens))
            continue
        pick = None
        if last_picks is not None and 0 <= row.from_pick < len(last_picks):
            pick = last_picks[row.from_pick]
        if pick is None:
            raise FailedPrecondition(f"a row feeds the pick of row {row.from_pick} of the "
                                     "previous forward, which made none")
        out.append([pick])
    return out
