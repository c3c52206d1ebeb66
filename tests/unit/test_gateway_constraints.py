"""What the gateway makes of structured output, tools, log-probabilities and n, without a
server: the constraint each field asks for, the schema a tool_choice constrains to, tool calls
read from an output whole or streamed, and OpenAI's two log-probability shapes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from services.gateway.call import BadField, parse_chat, parse_completion
from services.gateway.constraints import Constraint
from services.gateway.logprobs import (
    CompletionLogprobs,
    Position,
    chat_content,
    prompt_positions,
)
from services.gateway.tool_stream import ToolStream, calls_of
from services.gateway.upstream import TokenLogprob

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "integer"}},
                   "required": ["zone"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "time", "parameters": TIME_PARAMETERS}}


@pytest.mark.parametrize("extra, expected", [
    ({"response_format": {"type": "json_object"}}, Constraint("json_object", True,
                                                              "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}},
     Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")), "response_format")),
    ({"guided_json": json.dumps(SCHEMA)},
     Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")), "guided_json")),
    ({"guided_regex": "[ab]+"}, Constraint("regex", "[ab]+", "guided_regex")),
    ({"guided_grammar": 'start: "x"'}, Constraint("grammar", 'start: "x"', "guided_grammar")),
    ({"guided_choice": ["yes", "no"]}, Constraint("choice", ("yes", "no"), "guided_choice")),
    ({"structured_outputs": {"choice": ["a"]}}, Constraint("choice", ("a",),
                                                            "structured_outputs")),
    ({"structured_outputs": {"json": SCHEMA}},
     Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")),
                "structured_outputs")),
    ({"response_format": {"type": "text"}, "guided_regex": "a"},
     Constraint("regex", "a", "guided_regex")),
])
def test_each_field_asks_for_its_constraint(extra: dict[str, Any], expected: Constraint
                                            ) -> None:
    assert parse_chat({**CHAT, **extra}).constraint == expected
    assert parse_completion({"model": "m", "prompt": "x", **extra}).constraint == expected


@pytest.mark.parametrize("extra, param, names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     ("response_format", "guided_regex")),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice",
     ("guided_json", "guided_choice")),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs",
     ("guided_regex", "structured_outputs")),
    ({"structured_outputs": {"regex": "b", "choice": ["a"]}}, "structured_outputs",
     ("regex", "choice")),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice",
     ("response_format", "tool_choice")),
])
def test_two_constraints_are_refused_naming_both(extra: dict[str, Any], param: str,
                                                 names: tuple[str, str]) -> None:
    with pytest.raises(BadField) as info:
        parse_chat({**CHAT, **extra})
    assert info.value.param == param
    assert all(name in info.value.message for name in names)


def test_sampling_fields_pass_through_and_n_moves_the_seed() -> None:
    call = parse_chat({**CHAT, "presence_penalty": -2, "frequency_penalty": 1.5,
                       "repetition_penalty": 1.2, "min_p": 0.05, "seed": (1 << 64) - 1,
                       "n": 3, "best_of": 3})
    s = call.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (
        -2.0, 1.5, 1.2, 0.05)
    assert [call.for_choice(i).sampling.seed for i in range(3)] == [(1 << 64) - 1, 0, 1]
    unseeded = parse_chat({**CHAT, "n": 2})
    assert unseeded.for_choice(1).sampling.seed is None and unseeded.n == 2


def test_logprobs_and_echo_fields() -> None:
    assert parse_chat({**CHAT, "logprobs": True}).logprobs == 0
    assert parse_chat({**CHAT, "logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert parse_chat({**CHAT, "logprobs": False, "top_logprobs": 0}).logprobs is None
    call = parse_completion({"model": "m", "prompt": "x", "logprobs": 3, "echo": True,
                             "max_tokens": 0})
    assert (call.logprobs, call.prompt_logprobs, call.echo, call.is_prompt_only) == (
        3, 3, True, True)
    assert call.sampling.max_tokens == 1  # the stage generates one, dropped
    for body in ({"logprobs": 21}, {"logprobs": True}, {"max_tokens": 0}):
        with pytest.raises(BadField) as info:
            parse_completion({"model": "m", "prompt": "x", **body})
        assert info.value.param == next(iter(body))


def test_a_named_tool_constrains_to_its_parameters() -> None:
    call = parse_chat({**CHAT, "tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "time"}}})
    assert call.tools is not None and call.tools.mode == "named"
    assert call.constraint is not None and call.constraint.source == "tool_choice"
    assert json.loads(str(call.constraint.value)) == TIME_PARAMETERS
    system = call.messages[0] if call.messages else None
    assert system is not None and system[0] == "system" and '"time"' in str(system[1])
    with pytest.raises(BadField) as info:
        parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "nope"}}})
    assert info.value.param == "tool_choice"


def test_required_constrains_to_calls_whose_arguments_match_their_tool() -> None:
    call = parse_chat({**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"})
    assert call.constraint is not None
    schema = json.loads(str(call.constraint.value))
    jsonschema.validate([{"name": "weather", "arguments": {"city": "Paris"}},
                         {"name": "time", "arguments": {"zone": 2}}], schema)
    for wrong in ([], [{"name": "time", "arguments": {"city": "Paris"}}],
                  [{"name": "other", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "required",
                         "parallel_tool_calls": False})
    assert single.constraint is not None
    assert json.loads(str(single.constraint.value))["maxItems"] == 1


def test_required_keeps_each_tools_definitions_reachable() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "$defs": {"Point": point if name == "move" else {"type": "string"}},
        "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"]}}}
        for name in ("move", "say")]
    call = parse_chat({**CHAT, "tools": tools, "tool_choice": "required"})
    assert call.constraint is not None
    schema = json.loads(str(call.constraint.value))
    jsonschema.validate([{"name": "move", "arguments": {"to": {"x": 1}}},
                         {"name": "say", "arguments": {"to": "hello"}}], schema)
    for wrong in ([{"name": "move", "arguments": {"to": "hello"}}],
                  [{"name": "say", "arguments": {"to": {"x": 1}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_auto_describes_the_tools_and_earlier_calls_are_text() -> None:
    call = parse_chat({**CHAT, "tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert call.tools is not None and call.tools.mode == "auto" and call.constraint is None
    assert call.messages is not None
    (role, system), *rest = call.messages
    assert role == "system" and str(system).startswith("Be brief.\n\n")
    assert "weather" in str(system) and "plain text" in str(system)
    assert rest[1] == ("assistant", '{"name": "weather", "arguments": {"city": "Paris"}}')
    assert rest[2] == ("tool", "sunny")
    assert parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": "none"}).tools is None


@pytest.mark.parametrize("text, names", [
    ('{"name": "weather", "arguments": {"city": "Paris"}}', ["weather"]),
    ('```json\n[{"name": "weather", "arguments": {"city": "A"}}, '
     '{"name": "time", "arguments": {"zone": 1}}]\n```', ["weather", "time"]),
    ('<tool_call>{"name": "time", "arguments": {"zone": 1}}</tool_call>', ["time"]),
    ("It is sunny in Paris.", None),
    ('{"name": "unknown", "arguments": {}}', None),
    ('{"name": "weather"', None),
])
def test_auto_reads_calls_of_known_tools(text: str, names: list[str] | None) -> None:
    plan = parse_chat({**CHAT, "tools": [WEATHER, TIME]}).tools
    assert plan is not None
    calls = calls_of(plan, text)
    assert (None if calls is None else [c.name for c in calls]) == names
    stream = ToolStream(plan)
    deltas = [d for piece in _pieces(text) for d in stream.feed(piece)]
    tail, has_calls = stream.end()
    deltas += tail
    assert has_calls == (names is not None)
    if names is None:
        assert "".join(d.get("content", "") for d in deltas) == text
    else:
        streamed = [c for d in deltas for c in d["tool_calls"]]
        assert [c["function"]["name"] for c in streamed] == names
        assert [c["index"] for c in streamed] == list(range(len(names)))
        assert all(c["id"].startswith("call_") for c in streamed)


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    plan = parse_chat({**CHAT, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "weather"}}}).tools
    assert plan is not None
    stream = ToolStream(plan)
    deltas = [d for piece in ('{"ci', 'ty": "Pa', 'ris"}') for d in stream.feed(piece)]
    assert stream.end() == ([], True)
    first, *rest = [d["tool_calls"][0] for d in deltas]
    assert first["function"]["name"] == "weather" and first["type"] == "function"
    assert "id" not in rest[0] and "name" not in rest[0]["function"]
    arguments = "".join(d["function"]["arguments"] for d in [first, *rest])
    assert json.loads(arguments) == {"city": "Paris"}


def test_required_streams_each_call_once_its_object_closes() -> None:
    plan = parse_chat({**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"}).tools
    assert plan is not None
    text = ('[{"name": "weather", "arguments": {"city": "a}\\"b"}}, '
            '{"name": "time", "arguments": {"zone": 3}}, {"name": "time", "argu')
    stream = ToolStream(plan)
    sent = [(i, d) for i, piece in enumerate(_pieces(text)) for d in stream.feed(piece)]
    assert [d["tool_calls"][0]["function"]["name"] for _, d in sent] == ["weather", "time"]
    assert json.loads(sent[0][1]["tool_calls"][0]["function"]["arguments"]) == {
        "city": 'a}"b'}
    assert stream.end() == ([], True)  # cut short: the complete calls stand
    assert [c.name for c in calls_of(plan, text) or []] == ["weather", "time"]


def test_chat_logprobs_shape() -> None:
    texts = {1: "Hi", 2: " there", 3: "é"}
    content = chat_content([TokenLogprob(1, -0.5, ((1, -0.5), (3, -1.5))),
                            TokenLogprob(2, -0.25, ())], texts)
    assert content == [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
            {"token": "é", "logprob": -1.5, "bytes": [195, 169]}]},
        {"token": " there", "logprob": -0.25, "bytes": list(b" there"), "top_logprobs": []}]


def test_completion_logprobs_with_an_echoed_prompt_go_on_across_chunks() -> None:
    texts = {7: "<s>", 1: "Once", 2: " upon", 3: " a"}
    shape = CompletionLogprobs()
    first = shape.shape(prompt_positions(7, [TokenLogprob(1, -2.0, ((2, -1.0),))]), texts)
    assert first == {"tokens": ["<s>", "Once"], "token_logprobs": [None, -2.0],
                     "top_logprobs": [None, {" upon": -1.0, "Once": -2.0}],
                     "text_offset": [0, 3]}
    second = shape.shape([Position.of(TokenLogprob(3, -0.1, ((3, -0.1),)))], texts)
    assert second == {"tokens": [" a"], "token_logprobs": [-0.1],
                      "top_logprobs": [{" a": -0.1}], "text_offset": [7]}


def _pieces(text: str, size: int = 5) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]
