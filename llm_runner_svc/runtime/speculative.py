"""Speculative decoding on the host: the config, the ngram proposer and the acceptance rule.

A speculative request's decode row is a *verify* row (engines/batch.py `Row.verify`): the
last accepted token followed by K proposed tokens, run in one target forward that returns
the target's pick after each of the K + 1 positions (greedy: the argmax; sampled: the
proposed token or a draw by the rejection rule, engines/numpy_sampling.py). The runtime
accepts the longest prefix of the proposal the picks agree with plus the first pick that
differs (so a step yields 1 .. K + 1 tokens: exactly plain greedy decoding's, or tokens
distributed as plain sampling's), and rolls the rejected positions back in the page table:
they no longer count as computed, pages past them go back to the pool, nothing is copied.

`ngram` (prompt lookup) proposes in pure Python over the request's known tokens: it copies
the tokens that followed the latest earlier occurrence of the context's last n-gram. The
`self` and `draft` methods propose with a draft engine (drafting.py). Both proposers share
one interface (`propose_batch`, `roll_back`, `release`, `preallocate`, `close`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llm_runner_svc.engines.batch import MAX_VERIFY
from llm_runner_svc.errors import InvalidArgument

METHODS = ("ngram", "self", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """How speculative requests propose (`spec_decode` of the runner config): `ngram`
    (prompt lookup), `self` (the target's first `draft_layers` layers and its head) or
    `draft` (the model at `draft_checkpoint`, same tokenizer)."""

    method: str = "ngram"
    proposal_tokens: int = 4  # K: proposed tokens per verify row
    ngram_max: int = 3  # the longest context suffix looked up (ngram)
    ngram_min: int = 2  # the shortest one tried before giving up (ngram): a one-token match
    # proposes mostly what chance put there (docs/benchmarks.md)
    min_proposal: int = 1  # a shorter proposal is not verified (a plain decode row instead)
    draft_layers: int = 0  # self: decoder layers the draft keeps
    draft_checkpoint: str = ""  # draft: the draft model (a path or a built-in name)
    confidence_threshold: float = 0.0  # a draft stops proposing when its top probability
    # falls below this (dspark_scheduler "threshold"); 0 = always K tokens
    max_batch: int = 0  # no proposals in a step where more requests decode (0: no limit): at
    # load a verify row's K + 1 positions cost more than a decode row's one, which low
    # acceptance does not return
    max_verify_tokens: int = 256  # the tokens of a step's verify rows together (0: no
    # limit): past it every speculating request's K is cut alike (`verify_shares`). A verify
    # step costs about what a decode step does while its products stay bound by reading the
    # weights: measured at the 7B shape with K = 4 on an H100, verify / decode is 1.06x at
    # 1 request (5 rows), 1.08x at 8 (40 rows), 1.27x at 32 (160 rows), where replaying
    # accepted proposals still decodes 3.3x plain's tokens/s. Products of a few hundred
    # rows turn compute-bound (bf16 tensor-core rate over memory bandwidth is about 300
    # flops per byte there), so 256 keeps K = 4 up to 51 requests and cuts it past that
    min_accepted_per_step: float = 0.25  # a request whose verify steps accept fewer
    # proposed tokens than this on average, once it has run `acceptance_warmup_steps` of
    # them, stops proposing and decodes plainly (0: never). A verify step yields 1 + a
    # tokens (a accepted) where a decode step yields 1, and costs c decode steps: 1.06x to
    # 1.27x at the 7B shape on an H100 (above), plus the draft's forwards with `self` or
    # `draft`; so it pays while a > c - 1, and 0.25 is break-even for verify steps of up
    # to 1.25x a decode step
    acceptance_warmup_steps: int = 8  # verify steps a request runs before the rule applies:
    # a prompt-lookup proposer often misses at first and matches once the text repeats

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgument(f"spec_decode.method must be one of {', '.join(METHODS)}, "
                                  f"got {self.method!r}")
        if (self.method == "self") != (self.draft_layers > 0):
            raise InvalidArgument("spec_decode.draft_layers: method 'self' needs the number "
                                  f"of layers its draft keeps (>= 1), got {self.draft_layers} "
                                  f"with method {self.method!r}")
        if (self.method == "draft") != bool(self.draft_checkpoint):
            raise InvalidArgument("draft_checkpoint: method 'draft' needs one and the other "
                                  f"methods take none (method {self.method!r})")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise InvalidArgument(f"spec_decode.dspark_confidence_threshold must be in [0, 1), "
                                  f"got {self.confidence_threshold}")
        if self.confidence_threshold and self.method == "ngram":
            raise InvalidArgument("spec_decode.dspark_scheduler 'threshold': method 'ngram' "
                                  "has no draft probabilities to threshold (use self or draft)")
        if not 1 <= self.proposal_tokens <= MAX_VERIFY:
            raise InvalidArgument(f"spec_decode.proposal_tokens must be in 1..{MAX_VERIFY}, "
                                  f"got {self.proposal_tokens}")
        if not 1 <= self.min_proposal <= self.proposal_tokens:
            raise InvalidArgument(f"spec_decode.dspark_min_proposal_len must be in "
                                  f"1..{self.proposal_tokens}, got {self.min_proposal}")
        if self.max_batch < 0:
            raise InvalidArgument(f"spec_decode.disable_by_batch_size must be 0 or more, got "
                                  f"{self.max_batch}")
        if self.max_verify_tokens < 0:
            raise InvalidArgument(f"spec_decode.max_verify_tokens must be 0 or more, got "
                                  f"{self.max_verify_tokens}")
        if not 0.0 <= self.min_accepted_per_step <= self.proposal_tokens:
            raise InvalidArgument(f"spec_decode.min_accepted_per_step must be in "
                                  f"[0, {self.proposal_tokens}] (proposal_tokens), got "
                                  f"{self.min_accepted_per_step}")
        if self.acceptance_warmup_steps < 1:
            raise InvalidArgument(f"spec_decode.acceptance_warmup_steps must be 1 or more, "
                                  f"got {self.acceptance_warmup_steps}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidArgument(f"spec_decode ngram sizes need 1 <= ngram_min <= ngram_max, "
                                  f"got {self.ngram_min}..{self.ngram_max}")


class StatelessProposer:
    """A proposer that holds no memory or per-request state: the lifecycle calls of
    drafting.DraftProposer's interface do nothing."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def preallocate(self, plan: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def release(self, seq: Any) -> None:
        pass

    def roll_back(self, seq: Any, end: int) -> None:
        pass


class NgramProposer(StatelessProposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from
    `ngram_max` down to `ngram_min`) and propose the tokens that followed it."""

    def propose_batch(self, seqs: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow seqs[i].known."""
        return [self.propose(s.known, k) if k > 0 else [] for s, k in zip(seqs, ks, strict=True)]

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `tokens`; empty when no suffix recurs."""
        n_tokens = len(tokens)
        for n in range(min(self.config.ngram_max, n_tokens - 1), self.config.ngram_min - 1, -1):
            suffix = list(tokens[n_tokens - n:])
            first = suffix[0]
            for i in range(n_tokens - n - 1, -1, -1):  # latest match first
                if tokens[i] == first and list(tokens[i:i + n]) == suffix:
                    return list(tokens[i + n:i + n + k])
        return []


def verify_shares(ks: Sequence[int], min_proposal: int, max_tokens: int) -> list[int]:
    """The proposal lengths of one step's speculating requests (oldest first, each wanting
    ks[i] tokens) such that their verify rows (ks[i] + 1 tokens each) hold at most
    `max_tokens` tokens together (0: no limit). Over it, the budget is split evenly (shares
    differ by one at most, the oldest requests taking the remainder) between as many requests
    as can verify `min_proposal` tokens; the others get 0 and decode plainly."""
    if not max_tokens or sum(k + 1 for k in ks) <= max_tokens:
        return list(ks)
    num = min(len(ks), max_tokens // (min_proposal + 1))
    if not num:
        return [0] * len(ks)
    share, extra = divmod(max_tokens, num)
    return [min(k, share - (i >= extra)) if i < num else 0 for i, k in enumerate(ks)]


def losing_reason(config: SpecConfig, verify_steps: int, accepted_tokens: int) -> str:
    """Why a request that ran `verify_steps` verify steps accepting `accepted_tokens`
    proposed tokens should stop speculating; "" while it should go on."""
    if not config.min_accepted_per_step or verify_steps < config.acceptance_warmup_steps:
        return ""
    per_step = accepted_tokens / verify_steps
    if per_step >= config.min_accepted_per_step:
        return ""
    return (f"{per_step:.3g} accepted tokens per verify step over {verify_steps} steps, below "
            f"min_accepted_per_step {config.min_accepted_per_step:g}")


def accept_greedy(proposal: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a verify row yields: the longest prefix of `proposal` equal to the
    target's greedy picks, then the target's pick after it. `target` holds
    len(proposal) + 1 picks, pick j following the row's position j."""
    n = 0
    while n < len(proposal) and proposal[n] == target[n]:
        n += 1
    return [*proposal[:n], target[n]]
