"""What a request's output is constrained to (structured output); the grammar itself is
compiled and matched in grammar.py."""

from __future__ import annotations

from dataclasses import dataclass

from llm_runner_svc.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    """`kind` one of KINDS; `value` the schema (JSON text), regex or grammar text, the
    choices, or "" for json_object."""

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"structured output kind {self.kind!r} is not one of "
                                  f"{', '.join(KINDS)}")
        if self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value:
                raise InvalidArgument("structured output choice needs at least one string")
            if any(not c for c in self.value):
                raise InvalidArgument("structured output choices must not be empty strings")
        elif self.kind != "json_object" and not (isinstance(self.value, str) and self.value):
            raise InvalidArgument(f"structured output {self.kind} is empty")
