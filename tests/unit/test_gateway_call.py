"""OpenAI bodies -> Call: what is taken, what is refused (naming the field), what is ignored."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from services.errors import InvalidArgument
from services.gateway.call import (
    BadField,
    Sampling,
    parse_chat,
    parse_completion,
    parse_completions,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_a_chat_body_with_every_supported_field() -> None:
    call = parse_chat({**CHAT, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                      "text": "there"}]},
        {"role": "assistant", "content": "Hello"}],
        "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
        "seed": 3, "stop": "x", "logit_bias": {"17": -100, "4": 2.5}, "user": "u1",
        "stream": True, "stream_options": {"include_usage": True}, "top_k": 4,
        "ignore_eos": True, "disable_spec_decode": True, "store": False,
        "metadata": {"a": "b"}, "n": 1, "logprobs": False})
    assert call.kind == "chat" and call.model == "m"
    assert call.messages == (("system", "Be brief."), ("user", "Hi there"),
                             ("assistant", "Hello"))
    assert call.sampling == Sampling(temperature=0.0, top_p=0.5, top_k=4, max_tokens=7, seed=3)
    assert call.stop == ("x",) and call.logit_bias == ((17, -100.0), (4, 2.5))
    assert call.is_stream and call.include_usage and call.ignore_eos and call.user == "u1"
    assert call.disable_spec_decode


def test_image_url_parts_become_images_in_order() -> None:
    def image(data: bytes, mime: str = "image/png") -> dict[str, Any]:
        return {"type": "image_url", "image_url": {
            "url": f"data:{mime};base64," + base64.b64encode(data).decode()}}

    call = parse_chat({**CHAT, "messages": [
        {"role": "user", "content": [image(b"one"), {"type": "text", "text": "and"},
                                     image(b"two", "image/jpeg")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, image(b"three")]}]})
    assert call.messages == (("user", (0, "and", 1)), ("assistant", "ok"), ("user", ("a", 2)))
    assert call.images == (("image/png", b"one"), ("image/jpeg", b"two"),
                           ("image/png", b"three"))


def test_completion_prompts() -> None:
    assert parse_completion({"model": "m", "prompt": "Hi"}).text == "Hi"
    assert parse_completion({"model": "m", "prompt": ["Hi"]}).text == "Hi"
    assert parse_completion({"model": "m", "prompt": [1, 2]}).token_ids == (1, 2)
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}).token_ids == (1, 2)
    defaults = parse_completion({"model": "m", "prompt": "Hi"})
    assert defaults.sampling == Sampling() and not defaults.is_stream and defaults.stop == ()


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT["messages"]}, "model"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "https://example.com/a.png"}}]}]}, "messages[0].content[0].image_url"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,@@@"}}]}]}, "messages[0].content[0].image_url"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "messages[0].content"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 129}, "n"),
    ({**CHAT, "n": 2, "best_of": 3}, "best_of"),
    ({**CHAT, "best_of": 2}, "best_of"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": -2.01}, "frequency_penalty"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "min_p": 1.5}, "min_p"),
    ({**CHAT, "min_p": -0.1}, "min_p"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ({**CHAT, "echo": True}, "echo"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "seed": -1}, "seed"),
    ({**CHAT, "seed": 1 << 64}, "seed"),
    ({**CHAT, "stop": [1]}, "stop"),
    ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"1": 101}}, "logit_bias"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "user": 5}, "user"),
])
def test_chat_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadField) as info:
        parse_chat(body)
    assert info.value.param == param and info.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("prompt", [None, 5, [], ["a", "b"], [1, "a"], [-1], [[1], [2]]])
def test_bad_completion_prompts(prompt: Any) -> None:
    with pytest.raises(BadField) as info:
        parse_completion({"model": "m", "prompt": prompt})
    assert info.value.param == "prompt"


def test_a_body_that_is_not_an_object() -> None:
    with pytest.raises(InvalidArgument):
        parse_chat(["not", "an", "object"])


@pytest.mark.parametrize("key, value", [
    ("suffix", "the end"), ("guided_whitespace_pattern", " *"), ("prompt_logprobs", 1),
    ("reasoning_effort", "low"), ("min_tokens", 3), ("length_penalty", 0.5),
    ("use_beam_search", True), ("stop_token_ids", [2]), ("skip_special_tokens", False),
    ("structured_outputs", {"regex": "a", "whitespace_pattern": " "}),
    ("add_generation_prompt", False), ("guided_json", 5), ("guided_choice", []),
    ("add_special_tokens", True), ("repetition_penalty", True), ("parallel_tool_calls", "no"),
    ("prompt_embeds", "AAAA"), ("include_reasoning", False), ("return_token_ids", True),
])
def test_fields_that_change_the_output_are_refused_by_name(key: str, value: Any) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"model": "m", "prompt": "x"})):
        if (key, parse) == ("add_special_tokens", parse_completion):
            value = False  # a text prompt gets its BOS: only false would change it
        with pytest.raises(BadField) as info:
            parse({**body, key: value})
        assert info.value.param == key


def test_values_that_ask_for_nothing_are_accepted() -> None:
    neutral = {"min_tokens": 0, "length_penalty": 1, "reasoning_effort": None,
               "use_beam_search": False, "parallel_tool_calls": True, "stop_token_ids": [],
               "skip_special_tokens": True, "response_format": {"type": "text"},
               "tools": [], "add_generation_prompt": True, "guided_json": None,
               "suffix": "", "best_of": 1, "n": 1}
    assert parse_chat({**CHAT, **neutral}).sampling == Sampling()
    assert parse_chat({**CHAT, "parallel_tool_calls": False}).model == "m"
    assert parse_completion({"model": "m", "prompt": "x", "add_special_tokens": True,
                             **neutral}).text == "x"


def test_temperature_above_openais_limit_is_refused() -> None:
    assert parse_chat({**CHAT, "temperature": 2}).sampling.temperature == 2.0
    for value in (2.5, -0.1):
        with pytest.raises(BadField) as info:
            parse_completion({"model": "m", "prompt": "x", "temperature": value})
        assert info.value.param == "temperature"


def test_assistant_turns_without_content() -> None:
    call = parse_chat({**CHAT, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"}]})
    assert call.messages == (("user", "Hi"), ("assistant", ""), ("user", "Again"))
    with pytest.raises(BadField) as info:
        parse_chat({**CHAT, "messages": [{"role": "user", "content": None}]})
    assert info.value.param == "messages[0].content"


def test_continuous_usage_stats_is_refused() -> None:
    with pytest.raises(BadField) as info:
        parse_completion({"model": "m", "prompt": "x", "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
    assert info.value.param == "stream_options"


def test_a_list_of_prompts_is_one_call_each() -> None:
    calls = parse_completions({"model": "m", "prompt": ["a", [1, 2], "b"], "max_tokens": 3,
                               "temperature": 0})
    assert [(c.text, c.token_ids) for c in calls] == [("a", None), (None, (1, 2)), ("b", None)]
    assert all(c.sampling == Sampling(temperature=0.0, max_tokens=3) for c in calls)
    assert len(parse_completions({"model": "m", "prompt": [[5]]})) == 1
    for prompt, where in ((["a", 5], "prompt[1]"), (["a", []], "prompt[1]"),
                          (["a", [1, -1]], "prompt[1]")):
        with pytest.raises(BadField) as info:
            parse_completions({"model": "m", "prompt": prompt})
        assert info.value.param == "prompt" and where in info.value.message
    with pytest.raises(BadField) as info:
        parse_completions({"model": "m", "prompt": ["a", "b"], "stream": True})
    assert info.value.param == "stream"
