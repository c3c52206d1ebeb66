"""Sampling parameters: the seed's defaults, per-request overrides, validation, and the
counter-based random draw that makes a seeded request independent of its batch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from llm_runner_svc.engines.batch import MAX_LOGPROBS
from llm_runner_svc.errors import InvalidArgument

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingDefaults:
    """Deployment-wide values (LlmRunner config keys); a request may override each."""

    max_generate_length: int = 256
    temperature: float = 1.0
    top_p: float = 0.8
    top_k: int = 50

    def __post_init__(self) -> None:
        validate(self.temperature, self.top_k, self.top_p, self.max_generate_length, "config")


@dataclass(frozen=True)
class SamplingParams:
    """One request's resolved sampling settings; validated on construction."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    seed: int = 0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    min_p: float = 0.0
    logprobs: int | None = None  # None: none; 0: each generated token's; k: and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens

    def __post_init__(self) -> None:
        validate(self.temperature, self.top_k, self.top_p, self.max_new_tokens, "request")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidArgument(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidArgument("repetition_penalty must be a finite number > 0, got "
                                  f"{self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidArgument(f"{name} must be in 0..{MAX_LOGPROBS} (the top "
                                      f"alternatives to list), got {value}")
        if not 0 <= self.seed <= _MASK64:
            raise InvalidArgument(f"seed must be in 0..2^64-1, got {self.seed}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise InvalidArgument(f"logit_bias key {tok!r} is not a token id")
            if not math.isfinite(bias) and bias != -math.inf:
                raise InvalidArgument(f"logit_bias for token {tok} must be finite or -inf")


def resolve(defaults: SamplingDefaults, *, temperature: float | None = None,
            top_k: int | None = None, top_p: float | None = None,
            max_new_tokens: int | None = None, seed: int = 0,
            logit_bias: Mapping[int, float] | None = None,
            **extra: float | int | None) -> SamplingParams:
    """The request's values where given, the deployment's otherwise. `extra`: SamplingParams'
    other fields (penalties, min_p, logprobs, prompt_logprobs); None leaves one at its
    default."""
    return SamplingParams(
        temperature=defaults.temperature if temperature is None else temperature,
        top_k=defaults.top_k if top_k is None else top_k,
        top_p=defaults.top_p if top_p is None else top_p,
        max_new_tokens=defaults.max_generate_length if max_new_tokens is None else max_new_tokens,
        seed=seed, logit_bias=dict(logit_bias or {}),
        **{k: v for k, v in extra.items() if v is not None},  # type: ignore[arg-type]
    )


def has_penalties(sp: SamplingParams) -> bool:
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0)


def validate(temperature: float, top_k: int, top_p: float, max_len: int, where: str) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidArgument(
            f"{where}: temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise InvalidArgument(f"{where}: top_k must be >= 0 (0 = whole vocabulary), got {top_k}")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidArgument(f"{where}: top_p must be in (0, 1], got {top_p}")
    if max_len <= 0:
        name = "max_generate_length" if where == "config" else "max_tokens"
        raise InvalidArgument(f"{where}: {name} must be positive, got {max_len}")


def uniform_draw(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step): splitmix64 of the pair.

    Counter-based rather than a stateful generator, so a request's draws do not depend on
    which rows shared its steps, and any engine reproduces them.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


ACCEPT_STREAM = 1 << 48  # counters of the acceptance draws start here, apart from the picks'


def accept_draw(seed: int, step: int) -> float:
    """The uniform that decides whether a proposed output token `step` is accepted
    (speculative sampling): a draw of its own, independent of the pick's `uniform_draw`."""
    return uniform_draw(seed, ACCEPT_STREAM + step)
