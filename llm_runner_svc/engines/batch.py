"""What one step asks of an engine: a batch of variable-length rows, and what comes back.

A row is one request's part of a step: a prefill chunk (several prompt tokens), a decode
(one token), or the tokens a preempted request recomputes. A row with a `sample` spec ends
with its last position's logits in the engine's logits row of the same index and a pick from
them; with `Batch.keep_logits`, every row's last logits are left there. A verify row
(`Row.verify` = K > 0, speculative decoding) also needs the target's pick after each of the
K positions before its last: its tokens are the last accepted token and K proposed ones, and
the engine returns K + 1 picks so the runtime can accept the longest prefix of the proposal
they match, then the first pick that differs. Greedy rows pick the argmax at each position;
sampled ones (`Row.verify_samples`) keep the proposed token with probability p(token) and
otherwise draw from p without it (speculative sampling, engines/numpy_sampling.py
`verify_picks`), so the tokens a row yields are distributed as plain sampling's.
Pure Python: the runtime builds batches without a tensor library.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

GREEDY_TEMPERATURE = 1e-3
MAX_VERIFY = 16  # proposed tokens one verify row may hold
MAX_LOGPROBS = 20  # top alternatives a log-probability may list


class TokenMask(ABC):
    """Which tokens one pick may take (structured output). The engine asks for the bits when
    it samples, after it has started the step's forward, so a device engine computes them on
    the host while the device runs."""

    @staticmethod
    @abstractmethod
    def fill(masks: Sequence[TokenMask], out: Any) -> None:
        """Write the allowed tokens of masks[i] into out[i]: out is an int32 array
        [len(masks), ceil(vocab / 32)], bit j of word w set when token 32 * w + j is allowed
        (words past the vocabulary and tokens past the tokenizer's are zero: not allowed).
        All masks are of the class `fill` is called on."""


@dataclass(frozen=True)
class Penalties:
    """The repetition penalties of one pick (vLLM's and OpenAI's rules): `presence` is taken
    off the logit of every token in `counts`, `frequency` times its count; a token in
    `counts` or `seen` has a positive logit divided by `repetition`, a negative one
    multiplied by it. `counts` (the output's tokens and how often each came) and `seen` (the
    prompt's tokens) are the request's live collections: read while the step is launched."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    counts: Mapping[int, int] = field(default_factory=dict)
    seen: Collection[int] = ()


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability where it was produced (log-softmax of the model's logits
    there, before any processing) and the `top` likeliest tokens there, likeliest first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampleSpec:
    """How to pick one row's next token. `uniform` is the row's random draw in [0, 1);
    `accept_uniform` a second one, for the acceptance test of a proposed token there
    (speculative sampling)."""

    temperature: float
    top_k: int  # 0 = whole vocabulary
    top_p: float
    uniform: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    accept_uniform: float = 0.0
    min_p: float = 0.0  # drop tokens below min_p times the likeliest one's probability
    penalties: Penalties | None = None
    mask: TokenMask | None = None  # the tokens the pick may take (None: any)
    logprobs: int = -1  # -1: none; 0: the pick's log-probability; k: and the top k
    is_greedy: bool = field(init=False, repr=False, compare=False)  # read on every step

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_greedy",
                           self.temperature < GREEDY_TEMPERATURE or self.top_k == 1)

    @property
    def is_plain(self) -> bool:
        """Nothing but the logits decides the pick (no bias, penalty, mask or min_p) and no
        log-probability is asked for."""
        return not (self.logit_bias or self.penalties or self.mask or self.min_p
                    or self.logprobs >= 0)


@dataclass(frozen=True)
class HiddenStates:
    """Captured states for a window of positions; arrays are the engine's host tensors."""

    embeddings: Any  # [num_positions, hidden] layer-0 (token embedding) output
    states: Any  # [num_positions, hidden] at the plan's hidden_layer
    start_position: int


@dataclass(frozen=True)
class EmbedSpan:
    """Input embeddings of consecutive positions start .. start+len-1 of a request (an
    image's encoder output at its placeholder tokens): they replace those positions' token
    embeddings wherever a row covers them."""

    start: int
    values: Any  # [num_positions, hidden] float32, an engine's host array
    key: bytes = b""  # names the content (the prefix cache keys pages holding it by this)

    @property
    def end(self) -> int:
        return self.start + len(self.values)


@dataclass(frozen=True)
class Row:
    """Tokens fed at positions start .. end-1 of one request, their KV written into `pages`.

    `from_pick` names a row of the engine's previous forward: this row feeds that row's pick
    (one token, still on the engine when the runtime builds this batch) and `tokens` is
    empty. Otherwise `tokens` holds the tokens to feed. Positions below `prompt_end` hold
    the request's prompt, the rest tokens it generated (an engine may compute the two
    differently; None, as in the single-request calls: not known, all taken as generated).
    """

    tokens: tuple[int, ...]
    start: int
    pages: Sequence[int]  # page ids holding positions 0 .. end-1 (read at launch)
    sample: SampleSpec | None = None  # pick a token after the last position
    capture_hidden: bool = False
    from_pick: int | None = None
    prompt_end: int | None = None
    verify: int = 0  # trailing proposed tokens: picks after each of the K positions
    # before the last too (StepOutput.verified); such a row is never cut across passes
    adapter: int = 0  # the engine's LoRA adapter this row runs with; 0 = the base model
    embeds: Sequence[EmbedSpan] = ()  # input embeddings replacing the tokens' own
    verify_samples: tuple[SampleSpec, ...] = ()  # sampled verify rows: the spec of each of
    # those K picks (the one after the last position is `sample`); empty = greedy
    score: tuple[int, ...] = ()  # prompt log-probabilities: score[i] is the token that
    # follows position start + i; the engine returns its log-probability there
    score_top: int = 0  # and the top alternatives at each scored position

    @property
    def length(self) -> int:
        return 1 if self.from_pick is not None else len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Batch:
    """The rows of one forward, at most one per request."""

    rows: Sequence[Row]
    keep_logits: bool = False  # logits for rows without a pick too (single-request calls)

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.rows)


@dataclass(frozen=True)
class StepOutput:
    """What `Engine.read` gives back for a batch: per row, its pick (None for a row without
    a sample spec) and its captured states (None for a row that did not ask)."""

    picks: Sequence[int | None]
    hidden: Sequence[HiddenStates | None]
    verified: Sequence[Sequence[int] | None] = ()  # per row with `verify` = K: the picks
    # after positions end-1-K .. end-2 (K of them; the pick after end-1 is in `picks`)
    logprobs: Sequence[TokenLogprob | None] = ()  # per row whose spec asked: its pick's
    scores: Sequence[Sequence[TokenLogprob] | None] = ()  # per row with `score`: one each


@dataclass
class Segment:
    """A stretch of one batch row inside one engine pass (a long row spans passes)."""

    row: int  # the batch row
    offset: int  # first token of the stretch within the pass
    tokens: list[int]
    start: int  # position of the first token
    pages: Sequence[int]
    is_last: bool  # the row ends here
    wants_logits: bool  # its last token's logits go to logits row `row`
    prompt_end: int | None = None  # the row's: positions below it are prompt tokens
    verify: int = 0  # the row's `verify`: greedy picks after the K positions before the last
    embeds: Sequence[EmbedSpan] = ()  # the row's

    def overrides(self) -> list[tuple[int, Any]]:
        """(offset in the segment, embeddings [k, hidden]) for each stretch of it that an
        embed span covers."""
        out = []
        end = self.start + len(self.tokens)
        for span in self.embeds:
            lo, hi = max(span.start, self.start), min(span.end, end)
            if lo < hi:
                out.append((lo - self.start, span.values[lo - span.start:hi - span.start]))
        return out


@dataclass
class Pass:
    """Up to the engine's tokens-per-forward of a batch, run in one go."""

    segments: list[Segment]
    capture: bool  # some row asked for hidden states

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)


def split_passes(batch: Batch, tokens: list[list[int]], max_tokens: int,
                 max_segment: int) -> list[Pass]:
    """Cut the rows (their resolved `tokens`) into passes of at most `max_tokens` tokens,
    no stretch longer than `max_segment`. A row's stretches keep their order across passes,
    so a later stretch attends to the KV an earlier pass wrote."""
    passes: list[Pass] = []
    current: list[Segment] = []
    used = 0
    capture = False
    for i, (row, toks) in enumerate(zip(batch.rows, tokens, strict=True)):
        lo = 0
        while lo < len(toks):
            if used == max_tokens or (row.verify and used + len(toks) > max_tokens):
                passes.append(Pass(current, capture))
                current, used, capture = [], 0, False
            n = min(len(toks) - lo, max_tokens - used, max_segment)
            is_last = lo + n == len(toks)
            current.append(Segment(i, used, toks[lo:lo + n], row.start + lo, row.pages,
                                   is_last, is_last and (batch.keep_logits or bool(row.sample)),
                                   row.prompt_end, row.verify, row.embeds))
            capture = capture or row.capture_hidden
            used += n
            lo += n
    if current:
        passes.append(Pass(current, capture))
    return passes



def split_prompt(s: Segment) -> tuple[Segment | None, Segment | None]:
    """`s` cut where its prompt tokens end: (prompt part, generated part), None for a part
    without tokens. Only the last part keeps `wants_logits`."""
    end = s.start if s.prompt_end is None else s.prompt_end
    k = min(max(end - s.start, 0), len(s.tokens))
    if k == len(s.tokens):
        return s, None
    if k == 0:
        return None, s
    head = Segment(s.row, s.offset, s.tokens[:k], s.start, s.pages, False, False, s.prompt_end,
                   embeds=s.embeds)
    tail = Segment(s.row, s.offset + k, s.tokens[k:], s.start + k, s.pages, s.is_last,
                   s.wants_logits, s.prompt_end, s.verify, s.embeds)
    return head, tail


def aligned_pieces(s: Segment | None, block: int) -> list[Segment]:
    """`s` cut at the positions that are multiples of `block`; only the last piece keeps
    `is_last` and `wants_logits`."""
    if s is None:
        return []
    pieces = []
    lo, n = 0, len(s.tokens)
    while lo < n:
        k = min(n - lo, block - (s.start + lo) % block)
        end = lo + k == n
        pieces.append(Segment(s.row, s.offset + lo, s.tokens[lo:lo + k], s.start + lo, s.pages,
                              s.is_last and end, s.wants_logits and end, s.prompt_end,
                              embeds=s.embeds))
        lo += k
    return pieces
