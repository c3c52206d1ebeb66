"""Structured output: the one constraint a body asks for, from OpenAI's `response_format` or
vLLM's `guided_json` / `guided_regex` / `guided_grammar` / `guided_choice` or its newer
`structured_outputs` object. Two fields that each constrain the output are refused, naming
both: which one should win is the caller's to say. The stage compiles the constraint; one it
cannot compile is refused there (REFUSAL_STRUCTURED_OUTPUT), and reaches the caller as a 400
naming the field that asked for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import BadField

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# structured_outputs' keys -> our kinds ("json" is a schema); its other keys that change the
# output are refused by name.
_STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                    "grammar": "grammar", "choice": "choice"}
# vLLM's keys that tune how a constraint compiles; the stage's compiler has no such knobs.
_STRUCTURED_REFUSED = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
                       "disable_additional_properties", "disable_fallback")


@dataclass(frozen=True)
class Constraint:
    """The language the output is constrained to: `value` is JSON Schema text (json_schema),
    True (json_object), a regex or grammar source, or the choices (choice). `source` names
    the field that asked for it (errors name it)."""

    kind: str
    value: str | bool | tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")


def constraint_of(body: dict[str, Any]) -> Constraint | None:
    """The body's one constraint, or None; BadField for a malformed one or two of them."""
    found: Constraint | None = None
    for constraint in (*_response_format(body.get("response_format")), *_guided(body),
                       *_structured_outputs(body.get("structured_outputs"))):
        found = exclusive(found, constraint)
    return found


def exclusive(first: Constraint | None, second: Constraint | None) -> Constraint | None:
    """The one of two constraints that is set; BadField naming both when both are."""
    if first is not None and second is not None:
        raise BadField(second.source, f"{first.source} and {second.source} both constrain "
                       "the output: send one of them")
    return first or second


def schema_text(value: Any, where: str) -> str:
    """A JSON Schema given as an object or as JSON text, as compact JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadField(where, f"{where} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BadField(where, f"{where} must be a JSON Schema object")
    return json.dumps(value, separators=(",", ":"))


def _response_format(value: Any) -> list[Constraint]:
    if value is None:
        return []
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return [Constraint("json_object", True, "response_format")]
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise BadField("response_format", "response_format.json_schema must be an object "
                           "{name, schema, strict?}")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise BadField("response_format", "response_format.json_schema.name must be a "
                           "string")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise BadField("response_format", "response_format.json_schema.schema is required")
        return [Constraint("json_schema",
                           schema_text(schema, "response_format.json_schema.schema"),
                           "response_format")]
    raise BadField("response_format", "response_format.type must be text, json_object or "
                   f"json_schema, got {kind!r}")


def _guided(body: dict[str, Any]) -> list[Constraint]:
    out = []
    if body.get("guided_json") is not None:
        out.append(Constraint("json_schema", schema_text(body["guided_json"], "guided_json"),
                              "guided_json"))
    for key, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if body.get(key) is not None:
            out.append(Constraint(kind, _text(body[key], key), key))
    if body.get("guided_choice") is not None:
        out.append(Constraint("choice", _choices(body["guided_choice"], "guided_choice"),
                              "guided_choice"))
    return out


def _structured_outputs(value: Any) -> list[Constraint]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise BadField("structured_outputs", "structured_outputs must be an object "
                       "{json | regex | grammar | choice | json_object}")
    for key in _STRUCTURED_REFUSED:
        if value.get(key) not in (None, False):
            raise BadField("structured_outputs", f"structured_outputs.{key} is not supported "
                           "by this server")
    out = []
    for key, kind in _STRUCTURED_KEYS.items():
        item = value.get(key)
        if item is None or (kind == "json_object" and item is False):
            continue
        where = f"structured_outputs.{key}"
        if kind == "json_schema":
            out.append(Constraint(kind, schema_text(item, where), "structured_outputs"))
        elif kind == "json_object":
            if item is not True:
                raise BadField("structured_outputs", f"{where} must be true or false")
            out.append(Constraint(kind, True, "structured_outputs"))
        elif kind == "choice":
            out.append(Constraint(kind, _choices(item, where), "structured_outputs"))
        else:
            out.append(Constraint(kind, _text(item, where), "structured_outputs"))
    if len(out) > 1:
        raise BadField("structured_outputs", "structured_outputs holds several constraints "
                       "(" + ", ".join(k for k in _STRUCTURED_KEYS if value.get(k) not in
                                       (None, False)) + "): send one")
    return out


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadField(where.split(".")[0], f"{where} must be a non-empty string")
    return value


def _choices(value: Any, where: str) -> tuple[str, ...]:
    if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
        raise BadField(where.split(".")[0], f"{where} must be a non-empty list of strings")
    return tuple(value)
