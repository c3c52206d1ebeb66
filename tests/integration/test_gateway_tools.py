"""Chat through the gateway on SmolLM2-135M-Instruct with the `openai` package: JSON output
constrained by a schema, tool calls (named, required, auto) whole and streamed, a
conversation that carries earlier tool calls and results, chat log-probabilities and n
choices. What the model writes under a constraint parses with json.loads and validates with
jsonschema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from deployment import Deployment
from http_gateway import LONG, GatewayProc, request
from openai import OpenAI

CITIES = ["Paris", "London", "Tokyo"]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": CITIES},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
        "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                      "description": "The local time in a city"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[OpenAI, str]]:
    dep = Deployment(tmp_path_factory.mktemp("tools"),  # loading takes seconds
                     {"backbone": {"artifact": "smollm2", "maxSeq": 1024, "maxBatch": 4}})
    gw = GatewayProc(dep.target)
    yield OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0,
                 timeout=LONG), gw.url
    gw.stop()
    dep.close()


def test_a_json_schema_answer_validates(smol) -> None:
    api, _ = smol
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "enum": CITIES},
        "is_capital": {"type": "boolean"}}, "required": ["city", "is_capital"],
        "additionalProperties": False}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                       "strict": True}}
    whole = api.chat.completions.create(model="backbone", messages=ASK, max_tokens=40,
                                        temperature=0, response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    content = whole.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), schema)
    chunks = list(api.chat.completions.create(model="backbone", messages=ASK, max_tokens=40,
                                              temperature=0, response_format=fmt,
                                              stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_a_json_object_answer_parses(smol) -> None:
    api, _ = smol
    got = api.chat.completions.create(
        model="backbone", max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Return a JSON object with one key "city" for '
                   "the capital of France."}])
    content = got.choices[0].message.content
    assert got.choices[0].finish_reason == "stop" and content is not None, content
    assert isinstance(json.loads(content), dict)


def test_a_named_tool_is_called_with_valid_arguments(smol) -> None:
    api, _ = smol
    whole = api.chat.completions.create(model="backbone", messages=ASK, max_tokens=40,
                                        temperature=0, tools=TOOLS, tool_choice=NAMED)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call: Any = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(api.chat.completions.create(model="backbone", messages=ASK, max_tokens=40,
                                              temperature=0, tools=TOOLS, tool_choice=NAMED,
                                              stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1  # the arguments come in fragments
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function is not None
    assert first.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in rest)
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("is_parallel", [False, True])
def test_required_calls_name_a_tool_and_match_its_parameters(smol, is_parallel) -> None:
    api, _ = smol
    ask: dict[str, Any] = {"model": "backbone", "messages": ASK, "max_tokens": 80,
                           "temperature": 0, "tools": TOOLS, "tool_choice": "required",
                           "parallel_tool_calls": is_parallel}
    whole = api.chat.completions.create(**ask)
    calls: Any = whole.choices[0].message.tool_calls
    assert calls and (is_parallel or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if whole.choices[0].finish_reason != "length":
        assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(api.chat.completions.create(**ask, stream=True))
    streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments or "")) for d in
            streamed if d.function] == [
        (i, c.function.name, json.loads(c.function.arguments)) for i, c in enumerate(calls)]


def test_auto_answers_with_a_call_of_a_known_tool_or_text(smol) -> None:
    api, _ = smol
    got = api.chat.completions.create(model="backbone", messages=ASK, max_tokens=60,
                                      temperature=0, tools=TOOLS)
    message: Any = got.choices[0].message
    if message.tool_calls:
        assert got.choices[0].finish_reason in ("tool_calls", "length")
        for call in message.tool_calls:
            assert call.function.name in SCHEMAS
            assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert isinstance(message.content, str) and message.content


def test_a_conversation_with_tool_calls_and_results(smol) -> None:
    api, url = smol
    messages: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"}]
    status, _, tokens = request(f"{url}/tokenize", {"model": "backbone",
                                                    "messages": messages})
    assert status == 200
    status, _, text = request(f"{url}/detokenize", {"model": "backbone",
                                                    "tokens": tokens["tokens"]})
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris", ' \
        '"unit": "celsius"}}<|im_end|>' in text["prompt"]
    assert "<|im_start|>tool\n22 degrees, sunny<|im_end|>" in text["prompt"]
    got = api.chat.completions.create(model="backbone", messages=messages, max_tokens=12,
                                      temperature=0, tools=TOOLS, tool_choice="none")
    assert got.choices[0].message.content and got.choices[0].message.tool_calls is None


def test_chat_logprobs_and_n_choices(smol) -> None:
    api, _ = smol
    whole = api.chat.completions.create(model="backbone", messages=ASK, max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert whole.usage is not None
    assert len(logprobs.content) == whole.usage.completion_tokens
    assert "".join(e.token for e in logprobs.content) == whole.choices[0].message.content
    for entry in logprobs.content:
        assert entry.bytes == list(entry.token.encode()) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
    chunks = list(api.chat.completions.create(model="backbone", messages=ASK, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=2,
                                              stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in logprobs.content]
    several = api.chat.completions.create(model="backbone", messages=ASK, max_tokens=8,
                                          temperature=1.0, seed=11, n=2)
    assert [c.index for c in several.choices] == [0, 1]
    second = api.chat.completions.create(model="backbone", messages=ASK, max_tokens=8,
                                         temperature=1.0, seed=12)
    assert several.choices[1].message.content == second.choices[0].message.content
