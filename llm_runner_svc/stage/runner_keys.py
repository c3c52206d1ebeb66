"""The LlmRunner config keys (a stage's `config` object) as a table of rules, checked at load.

`check_runner_keys(cfg)` first checks the shape of every key and sub-key against `RUNNER_KEYS`
(type, range, unknown sub-keys), raising ConfigError (INVALID_ARGUMENT) with the full key path:

    config.context_cache.max_records: must be an integer >= 0, got 'abc'

Only when the whole object has a valid shape does it refuse the keys this build cannot honour
(Unimplemented, naming the key and why), so a typo is reported before a missing feature.
Sub-key names and meanings follow llm_inference's flags of the same meaning (seed LlmRunner).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llm_runner_svc.errors import InvalidArgument, Unimplemented


class ConfigError(InvalidArgument):
    """The deployment file breaks a rule."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path: str, must: str, value: Any) -> None:
    raise ConfigError(f"{path}: must be {must}, got {_show(value)}")


@dataclass(frozen=True)
class Integer:
    """An int (never a bool) in [minimum, maximum]; `also` lists values allowed outside it."""

    minimum: int | None = None
    maximum: int | None = None
    also: tuple[int, ...] = ()
    meaning: str = ""  # replaces the generated description in messages

    def describe(self) -> str:
        if self.meaning:
            return self.meaning
        if self.maximum is None:
            return "an integer" + ("" if self.minimum is None else f" >= {self.minimum}")
        return f"an integer in [{self.minimum}, {self.maximum}]"

    def __call__(self, value: Any, path: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(path, self.describe(), value)
        in_range = ((self.minimum is None or value >= self.minimum)
                    and (self.maximum is None or value <= self.maximum))
        if not in_range and value not in self.also:
            _fail(path, self.describe(), value)


@dataclass(frozen=True)
class Number:
    """A finite int or float (never a bool) between `low` and `high`; `open_*` excludes them."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def describe(self) -> str:
        if self.high is None:
            return "a number" + ("" if self.low is None else
                                 f" {'>' if self.open_low else '>='} {self.low:g}")
        return (f"a number in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.open_high else ']'}")

    def __call__(self, value: Any, path: str) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool) \
                or not math.isfinite(value):
            _fail(path, self.describe(), value)
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            _fail(path, self.describe(), value)
        if self.high is not None and (value >= self.high if self.open_high
                                      else value > self.high):
            _fail(path, self.describe(), value)


@dataclass(frozen=True)
class Boolean:
    def __call__(self, value: Any, path: str) -> None:
        if not isinstance(value, bool):
            _fail(path, "true or false", value)


@dataclass(frozen=True)
class Text:
    """A non-empty string, one of `choices` when they are given."""

    choices: tuple[str, ...] = ()

    def __call__(self, value: Any, path: str) -> None:
        if not isinstance(value, str) or not value:
            _fail(path, "a non-empty string", value)
        if self.choices and value not in self.choices:
            _fail(path, f"one of {list(self.choices)}", value)


# A rule checks one value found at `path` ("config.ple.file") and raises ConfigError.
Rule = Callable[[Any, str], None]


@dataclass(frozen=True)
class Obj:
    """An object whose keys are all in `fields`, each value checked by its rule."""

    fields: Mapping[str, Rule]
    noun: str = "key"

    def __call__(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            _fail(path, f"an object with keys from {sorted(self.fields)}", value)
        unknown = sorted(str(k) for k in value if k not in self.fields)
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown {self.noun} (valid: "
                              f"{sorted(self.fields)})")
        for key, sub in value.items():
            self.fields[key](sub, f"{path}.{key}")


@dataclass(frozen=True)
class Named:
    """An object {name: value}: every name a non-empty string, every value checked by `value`."""

    value: Rule
    shape: str = "{name: value}"

    def __call__(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            _fail(path, f"an object {self.shape}", value)
        for name, sub in value.items():
            if not name:
                raise ConfigError(f"{path}: names must be non-empty strings, got ''")
            self.value(sub, f"{path}.{name}")


PATH = Text()  # relative to the stage's artifact
COUNT = Integer(minimum=0)
POSITIVE = Integer(minimum=1)

RUNNER_KEYS = Obj(noun="LlmRunner key", fields={
    "multimodal_artifact": PATH,
    "checkpoint": PATH,
    "draft_checkpoint": PATH,
    "accept_hidden_layer": Integer(minimum=1, also=(-1,), meaning=(
        "-1 (post-norm output) or k >= 1 (output of decoder layer k-1)")),
    "max_generate_length": POSITIVE,
    "temperature": Number(low=0),
    "top_p": Number(low=0, high=1, open_low=True),
    "top_k": COUNT,  # 0 = the whole vocabulary
    "spec_decode": Obj({
        "method": Text(("ngram", "self", "draft")),  # ours: the proposer
        "draft_layers": POSITIVE,  # ours: layers the `self` draft keeps
        "disable_by_batch_size": COUNT,  # ours: no proposals while more requests decode
        "max_verify_tokens": COUNT,  # ours: a step's verify rows' tokens, K cut to fit (0: any)
        "min_accepted_per_step": Number(low=0),  # ours: below it a request stops proposing
        "acceptance_warmup_steps": POSITIVE,  # ours: verify steps before that rule applies
        "draft_top_k": POSITIVE,
        "draft_step": POSITIVE,
        "proposal_tokens": COUNT,  # 0 = from the draft engine's config
        "verify_tokens": POSITIVE,
        "dspark_w2_backend": Text(),
        "dspark_scheduler": Text(("off", "threshold", "sps")),
        "dspark_confidence_threshold": Number(low=0, high=1),
        "dspark_min_proposal_len": POSITIVE,
        "dspark_max_proposal_len": COUNT,  # 0 = the full block
    }),
    "lora_adapters": Named(PATH, shape="{name: path}"),
    "context_cache": Obj({
        "enable_reuse": Boolean(),
        "max_records": COUNT,
        "max_snapshots": COUNT,
        "encoder_cache_budget_bytes": COUNT,  # 0 = no encoder cache
    }),
    "visual_pruning": Obj({
        "algorithm": Text(),
        "reduction_ratio": Number(low=0, high=1, open_low=True, open_high=True),
        "min_visual_tokens": COUNT,
        "pivot_image_tokens": POSITIVE,
        "pivot_text_tokens": COUNT,
    }),
    "ple": Obj({
        "file": PATH,
        "residency": Text(("device", "host")),  # where the per-layer table lives
        "cache_slots": COUNT,  # device rows caching a host-resident table
    }),
    "runtime_cache": PATH,
    "offload_embedding": Boolean(),
})


@dataclass(frozen=True)
class _Unhonoured:
    reason: str
    asks: Callable[[Any], bool] = field(default=lambda value: True)  # the value needs it


# Keys this build cannot honour: a value that asks for the feature is refused, an "off" value
# (an empty adapter table, reuse disabled, false) is accepted.
UNHONOURED: Mapping[str, _Unhonoured] = {
    "spec_decode": _Unhonoured(
        "linear proposal chains only: no tree drafting (draft_top_k > 1), no "
        "dspark_w2_backend, no dspark_scheduler 'sps'", lambda v: not is_linear_chain(v)),
    "ple": _Unhonoured("per-layer embeddings are not in this build"),
    "offload_embedding": _Unhonoured("only false is supported", bool),
}


def is_linear_chain(spec: Any) -> bool:
    """A `spec_decode` value this build serves: a linear chain (draft_top_k 1), without
    the settings that mean something only for tree drafts on the seed's runtime."""
    return spec.get("draft_top_k", 1) == 1 and "dspark_w2_backend" not in spec and \
        spec.get("dspark_scheduler", "off") != "sps"


def check_runner_keys(cfg: Any, path: str = "config") -> None:
    """Raise ConfigError for the first key or sub-key of `cfg` that breaks its rule, else
    Unimplemented for the first key whose value asks for what this build lacks."""
    RUNNER_KEYS(cfg, path)
    for key, value in cfg.items():
        unhonoured = UNHONOURED.get(key)
        if unhonoured is not None and unhonoured.asks(value):
            raise Unimplemented(f"{path}.{key}: cannot be honoured: {unhonoured.reason}")
