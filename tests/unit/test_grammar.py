"""Structured output's grammar side: constraints compile for each tokenizer format the project
reads, a matcher follows tokens and says when the output is whole, bad constraints are refused
with the reason, and compiled constraints are cached."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models import EMBEDDED_NAME, load_model, smollm2_path
from llm_runner_svc.models.model import Model
from llm_runner_svc.runtime.constraint import Constraint
from llm_runner_svc.runtime.grammar import GrammarError, GrammarMatcher, Grammars

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["stories260K", "smollm2"])
def model(request: pytest.FixtureRequest) -> Model:
    return load_model(EMBEDDED_NAME if request.param == "stories260K" else str(smollm2_path()))


def grammars(model: Model) -> Grammars:
    tok = model.tokenizer
    return Grammars(tok, model.config.vocab_size, set(tok.eos_ids) | set(model.config.eos_ids))


def allowed(masks: list[GrammarMatcher], vocab: int) -> list[set[int]]:
    out = np.zeros((len(masks), (vocab + 31) // 32), dtype=np.int32)
    GrammarMatcher.fill(masks, out)
    bits = np.unpackbits(out.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return [set(np.nonzero(row)[0].tolist()) for row in bits]


def walk(g: Grammars, model: Model, constraint: Constraint, text: str) -> GrammarMatcher:
    """Feed `text`'s tokens, each checked against the mask computed before it."""
    m = g.matcher(constraint)
    for tok in model.tokenizer.encode_fragment(text):
        assert tok in allowed([m], model.config.vocab_size)[0]
        assert m.accept(tok), m.error
    return m


def test_json_schema_accepts_a_valid_document_and_ends(model: Model) -> None:
    g = grammars(model)
    m = walk(g, model, Constraint("json_schema", json.dumps(PERSON)), '{"name":"Ann","age":41}')
    assert m.is_done and not m.error


def test_mask_refuses_what_the_schema_forbids(model: Model) -> None:
    g = grammars(model)
    tok = model.tokenizer
    m = walk(g, model, Constraint("json_schema", json.dumps(PERSON)), '{"name":"Ann","age":')
    ok = allowed([m], model.config.vocab_size)[0]
    assert ok, "a digit must be allowed after the age's colon"
    for t in ok:  # every allowed token continues a number (or whitespace)
        piece = tok.decode([t]).strip()
        assert piece == "" or piece[0].isdigit(), piece
    assert not any(t in ok for t in tok.encode_fragment('"'))  # no string for an integer


def test_eos_only_once_the_output_is_whole(model: Model) -> None:
    g = grammars(model)
    eos = set(model.tokenizer.eos_ids) | set(model.config.eos_ids)
    vocab = model.config.vocab_size
    m = walk(g, model, Constraint("regex", "[0-9]+"), "12")
    assert not m.is_done
    assert eos & allowed([m], vocab)[0], "a whole number may end"
    m2 = g.matcher(Constraint("regex", "[0-9]+"))
    assert not eos & allowed([m2], vocab)[0], "an empty output is not a number"


def test_choice_and_grammar(model: Model) -> None:
    g = grammars(model)
    m = walk(g, model, Constraint("choice", ("yes", "no")), "no")
    assert m.is_done
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]+/'
    m = walk(g, model, Constraint("grammar", lark), "(1+22)")
    assert m.is_done


def test_masks_of_a_batch_are_each_requests_own(model: Model) -> None:
    g = grammars(model)
    c = Constraint("json_schema", json.dumps(PERSON))
    fresh = g.matcher(c)
    advanced = walk(g, model, c, '{"name":"Ann","age":')
    a, b = allowed([fresh, advanced], model.config.vocab_size)
    assert a == allowed([g.matcher(c)], model.config.vocab_size)[0]
    assert a != b


@pytest.mark.parametrize(("kind", "value", "needle"), [
    ("regex", "(unclosed", "unclosed"),
    ("grammar", "start: missing_rule", "missing_rule"),
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", "[1, 2]", "JSON object"),
])
def test_bad_constraints_are_refused_with_the_reason(model: Model, kind: str, value: str,
                                                     needle: str) -> None:
    with pytest.raises(GrammarError) as err:
        grammars(model).compile(Constraint(kind, value))
    assert needle in err.value.message
    assert isinstance(err.value, InvalidArgument)


def test_empty_constraints_are_malformed() -> None:
    with pytest.raises(InvalidArgument):
        Constraint("choice", ())
    with pytest.raises(InvalidArgument):
        Constraint("regex", "")
    with pytest.raises(InvalidArgument):
        Constraint("yaml", "a: 1")


def test_compiled_constraints_are_cached(model: Model) -> None:
    g = grammars(model)
    c = Constraint("json_schema", json.dumps(PERSON))
    g.matcher(c)
    g.matcher(c)
    g.matcher(Constraint("json_schema", json.dumps(PERSON)))  # equal value, other object
    assert g.compiles == 1
    g.matcher(Constraint("json_object"))
    assert g.compiles == 2
