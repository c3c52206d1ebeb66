"""Typed reads of a request body's fields: each raises BadField naming the field when its
value is not what OpenAI's API (or vLLM's extension) defines."""

from __future__ import annotations

import math
from typing import Any

from services.gateway.errors import BadField

MAX_TOKEN_ID = (1 << 31) - 1


def stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise BadField("stop", "stop must be a string or a list of strings")


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BadField("logit_bias", "logit_bias must be an object of token id -> bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadField("logit_bias", f"logit_bias key {key!r} is not a token id") from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise BadField("logit_bias", f"logit_bias key {key!r} is out of range")
        if not (is_number(bias) and -100 <= bias <= 100):
            raise BadField("logit_bias", f"logit_bias[{key}] must be a number in [-100, 100]")
        out.append((token, float(bias)))
    return tuple(out)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def opt_bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadField(key, f"{key} must be true or false")
    return value


def opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_int(value) or value < minimum:
        raise BadField(key, f"{key} must be an integer >= {minimum}")
    return int(value)


def ranged(body: dict[str, Any], key: str, low: float, high: float,
            is_low_open: bool = False) -> float | None:
    """An optional number in [low, high] ((low, high] when `is_low_open`)."""
    value = opt_float(body, key)
    if value is not None and (value < low or value > high or (is_low_open and value == low)):
        span = f"{'(' if is_low_open else '['}{low:g}, {high:g}]".replace("inf]", "inf)")
        raise BadField(key, f"{key} must be in {span}, got {value:g}")
    return value


def opt_float(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_number(value):
        raise BadField(key, f"{key} must be a finite number")
    return float(value)
