"""A generation request, its finish reasons and metrics, and the runtime's per-request state."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from llm_runner_svc.engines.base import HiddenStates, SampleSpec
from llm_runner_svc.engines.batch import EmbedSpan, Penalties, TokenLogprob
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.tokenizer import StreamDecoder
from llm_runner_svc.runtime.constraint import Constraint
from llm_runner_svc.runtime.prefix_cache import Key
from llm_runner_svc.runtime.sampling import (
    SamplingParams,
    accept_draw,
    has_penalties,
    uniform_draw,
)
from llm_runner_svc.runtime.stops import StopMatcher
from services.stage.ending import FinishReason  # the contract's reasons, shared with stages

__all__ = ["FinishReason", "GenerationRequest", "RequestMetrics", "SeqStatus", "SequenceState",
           "StepEvent"]


@dataclass(frozen=True)
class GenerationRequest:
    """What a caller asks of the runtime. Tokenization happened before (see `prompt_ids`)."""

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    stop: Sequence[str] = ()
    capture_hidden: bool = False
    ignore_eos: bool = False
    label: str = ""  # the caller's own name for the request (a stage: its client's id)
    cache_lookup: bool = True  # reuse a cached prefix (when the runtime caches prefixes)
    cache_generated: bool = True  # name the pages of generated tokens too, not only the prompt
    disable_spec_decode: bool = False  # decode plainly on a speculative deployment
    adapter: int = 0  # the engine's LoRA adapter to run with; 0 = the base model
    embeds: Sequence[EmbedSpan] = ()  # image embeddings at their placeholder positions
    constraint: Constraint | None = None  # structured output (None: free text)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidArgument("request_id must not be empty")
        if len(self.prompt_ids) == 0:
            raise InvalidArgument("prompt is empty: at least one token is required")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")
        if any(e.start < 0 or e.end > len(self.prompt_ids) for e in self.embeds):
            raise InvalidArgument("an embedding span lies outside the prompt")


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    cached_tokens: int = 0  # prompt positions reused from the prefix cache
    prefilled_tokens: int = 0  # positions computed by prefill rows (recomputes included)
    proposed_tokens: int = 0  # speculative: tokens proposed to verify rows
    accepted_tokens: int = 0  # speculative: proposed tokens the target agreed with
    target_steps: int = 0  # speculative: decode rows read (each a target forward)
    verified_tokens: int = 0  # speculative: tokens those rows yielded
    verify_steps: int = 0  # speculative: verify rows read (decode rows that held proposals)
    spec_disabled_at_token: int = -1  # speculative: the output index from which the request
    # decoded plainly, its speculation below break-even (-1: it never stopped)
    spec_disabled_reason: str = ""  # and why

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        return self.verified_tokens / self.target_steps if self.target_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generation rate: every generated token over the time from the request's first
        launched step to its last token (prefill_ms + decode_ms); 0 before any token. Not
        decode_ms alone: the runtime launches the next step before it reads the current one,
        so the first token is read after the second was computed, and decode_ms of a short run
        holds almost nothing (2 tokens read as thousands a second). Over a long run this is
        the decode rate, the prefill's share shrinking."""
        elapsed_ms = self.prefill_ms + self.decode_ms
        if self.generated_tokens == 0 or elapsed_ms <= 0:
            return 0.0
        return self.generated_tokens / (elapsed_ms / 1000.0)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "queue_ms": round(self.queue_ms, 3), "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3), "ttft_ms": round(self.ttft_ms, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "cached_tokens": self.cached_tokens, "prefilled_tokens": self.prefilled_tokens,
            "proposed_tokens": self.proposed_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_step": round(self.tokens_per_target_step, 4),
            # where speculation below break-even stopped (spec_disabled_reason says why)
            **({"spec_disabled_at_token": self.spec_disabled_at_token}
               if self.spec_disabled_at_token >= 0 else {}),
        }


@dataclass
class StepEvent:
    """What one step did for one request: new tokens, new text, and whether it ended."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    hidden: list[HiddenStates] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids entry,
    # when the request asked (SamplingParams.logprobs), and on the event that ends it at an
    # end-of-sequence token one more, last: that token's (not among token_ids)
    prompt_logprobs: list[TokenLogprob] | None = None  # once, on the first event with
    # tokens, when asked: one per prompt token from the second on


class SeqStatus(StrEnum):
    WAITING = "waiting"  # admitted, no KV yet
    PREFILLING = "prefilling"  # holds a batch row, part of its tokens computed
    DECODING = "decoding"  # every known token computed; one token per step
    PREEMPTED = "preempted"  # pages taken back; waits to recompute its tokens
    FINISHED = "finished"


class SequenceState:
    """Mutable state of one admitted request inside the runtime.

    `known` is the prompt followed by every accepted token; `computed` counts the positions
    already handed to the engine (their KV written, or being written). A pick launched but
    not read yet is `pending`; the last launched forward's pick for this request sits in
    its row `pick_row` of launch `pick_launch`. Picks read while the request is held wait
    in `stash` until it steps again (each entry: the tokens a row yielded, its states, the
    position after the last of them and their log-probabilities when asked). A speculative
    request has a `proposer`.
    """

    def __init__(self, req: GenerationRequest, decoder: StreamDecoder, stops: StopMatcher,
                 packed_prompt: bytes = b"", matcher: Any = None) -> None:
        self.req = req
        self.packed_prompt = packed_prompt  # the prompt's ids as the prefix cache packs them
        self.decoder = decoder
        self.stops = stops
        self.pages: list[int] = []
        self.output_ids: list[int] = []
        self.status = SeqStatus.WAITING
        self.order = 0  # admission order into the batch (newest is preempted first)
        self.known: list[int] = list(req.prompt_ids)
        self.computed = 0
        self.pending = 0
        self.pick_launch = -1
        self.pick_row = 0
        self.hidden_upto = 0  # positions whose hidden states were delivered
        self.stash: list[tuple[list[int], HiddenStates | None, int, list[TokenLogprob]]] = []
        self.proposer: Any = None  # speculative.NgramProposer, or None: plain decode
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(req.prompt_ids))
        self.t_submit = time.perf_counter()
        self.t_first_token = 0.0
        self.t_scheduled = 0.0  # first time a row of it was launched
        self.greedy_spec: SampleSpec | None = None  # set by the first greedy pick
        self.page_keys: list[Key] = []  # prefix-cache keys of its leading full pages
        self.reused_hidden: list[HiddenStates] = []  # kept states of reused pages, to deliver
        self.kept_rows: list[HiddenStates] = []  # delivered states not yet kept by the cache
        self.kept_pages = 0  # leading pages whose states the cache was given
        self.matcher = matcher  # grammar.GrammarMatcher of a structured output, or None
        sp = req.sampling
        # the output's token counts, for the repetition penalties (None: none asked)
        self.counts: dict[int, int] | None = {} if has_penalties(sp) else None
        self._penalties = None if self.counts is None else Penalties(
            sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, self.counts,
            frozenset(req.prompt_ids) if sp.repetition_penalty != 1.0 else frozenset())
        self.prompt_scores: list[TokenLogprob] | None = \
            [] if sp.prompt_logprobs is not None else None  # prompt log-probabilities so far
        self.scores_sent = False

    @property
    def reads_first(self) -> bool:
        """Its next pick depends on the host's view of its last one (a proposal to verify,
        a grammar to advance, counts to penalise): no row of it runs ahead of the read."""
        return self.proposer is not None or self.matcher is not None or \
            self.counts is not None

    def latch(self, reason: FinishReason, error: str | None = None) -> bool:
        """Record why the request ends; only the first reason sticks."""
        if self.finish_reason is not None:
            return False
        self.finish_reason = reason
        self.error = error
        return True

    def spec(self, index: int, is_proposed: bool = False, mask: Any = None) -> SampleSpec:
        """How to pick output token `index`; `is_proposed`: a proposed token stands there
        (a verify row), whose acceptance takes a draw too; `mask`: the constraint's state
        there when it is not the request's own (a verify row's position past proposed
        tokens). A greedy pick uses no draw, so a greedy request's spec is the same every
        step: built once."""
        if self.greedy_spec is not None and mask is None:
            return self.greedy_spec
        sp = self.req.sampling
        spec = SampleSpec(sp.temperature, sp.top_k, sp.top_p, uniform_draw(sp.seed, index),
                          sp.logit_bias or None,
                          accept_draw(sp.seed, index) if is_proposed else 0.0,
                          sp.min_p, self._penalties, self.matcher if mask is None else mask,
                          -1 if sp.logprobs is None else sp.logprobs)
        if spec.is_greedy and mask is None:
            self.greedy_spec = spec
        return spec
