"""What a generation may ask beyond its prompt and basic sampling: structured output (the output
constrained to a JSON schema, any JSON object, a regex, a grammar or one of a few strings) and
log-probabilities, with their conversions to and from the contract's messages."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llm_stage_client._contract.llmstage.v1 import stage_pb2 as pb

# A JSON schema: its JSON text, or the schema itself (a dict, or True / False).
JsonSchema = str | Mapping[str, Any] | bool


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability where it was produced: the log-softmax of the model's raw
    logits there (before temperature, penalties, bias and constraints), and the likeliest
    tokens there with theirs, likeliest first (`top`: (token id, log-probability) pairs, as
    many as asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def as_dict(self, digits: int | None = None) -> dict[str, Any]:
        """{"token_id", "logprob", "top": [{"token_id", "logprob"}, ...]} ("top" only when
        alternatives were asked), the log-probabilities rounded to `digits` decimals when
        given (they travel as float32: -0.6 reads -0.6000000238 otherwise)."""
        def r(x: float) -> float:
            return x if digits is None else round(x, digits)
        out: dict[str, Any] = {"token_id": self.token_id, "logprob": r(self.logprob)}
        if self.top:
            out["top"] = [{"token_id": t, "logprob": r(lp)} for t, lp in self.top]
        return out


def logprobs_from_pb(scores: Sequence[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    if not scores:  # none asked: every delta of most requests
        return ()
    return tuple(TokenLogprob(s.token_id, s.logprob, tuple(zip(s.top_ids, s.top_logprobs,
                                                               strict=False)))
                 for s in scores)


def reject_str(name: str, value: Sequence[str]) -> None:
    # A bare string is a Sequence[str] too; taking it letter by letter is never what was meant.
    if isinstance(value, str):
        raise TypeError(f"{name} takes a sequence of strings, not a string: use [{value!r}]")


def structured_output(*, json_schema: JsonSchema | None = None, json_object: bool = False,
                      regex: str | None = None, grammar: str | None = None,
                      choice: Sequence[str] | None = None) -> pb.StructuredOutput | None:
    """The StructuredOutput for at most one constraint; None for none. `json_schema` as text
    is sent as it is (the stage says what is wrong with it), as a dict it is written as JSON.
    Raises ValueError for two constraints at once, TypeError for `choice` as a bare string."""
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex),
                                      ("grammar", grammar), ("choice", choice))
             if value is not None] + (["json_object"] if json_object else [])
    if len(given) > 1:
        raise ValueError(f"give at most one structured output (got {', '.join(given)})")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return pb.StructuredOutput(json_schema=text)
    if json_object:
        return pb.StructuredOutput(json_object=True)
    if regex is not None:
        return pb.StructuredOutput(regex=regex)
    if grammar is not None:
        return pb.StructuredOutput(grammar=grammar)
    if choice is not None:
        reject_str("choice", choice)
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(choice)))
    return None
