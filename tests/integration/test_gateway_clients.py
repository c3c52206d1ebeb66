"""What clients other than the `openai` package send the gateway (lm-eval, vLLM's extensions):
fields that would change the output are refused by name unless they ask for nothing or are
honoured (a malformed or out-of-range value of an honoured one is refused by name too); a list
of prompts is a batch; the gateway's port serves its metrics; the usage counts the
end-of-sequence token, as vLLM's does."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from deployment import Deployment
from http_gateway import GatewayProc, request, sse

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    dep = Deployment(tmp_path_factory.mktemp("clients"), {"backbone": {"maxSeq": 512}})
    gw = GatewayProc(dep.target)
    yield gw
    gw.stop()
    dep.close()


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "backbone", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}


@pytest.mark.parametrize("field, value", [
    ("guided_json", "{not json"), ("guided_regex", ""), ("guided_choice", []),
    ("repetition_penalty", 0), ("min_p", 1.2), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("reasoning_effort", "high"), ("suffix", "The end."),
    ("parallel_tool_calls", "sometimes"), ("min_tokens", 4), ("length_penalty", 0.7),
    ("use_beam_search", True), ("stop_token_ids", [13]), ("temperature", 2.5),
])
def test_a_field_that_would_change_the_output_is_400_naming_it(gateway, field, value) -> None:
    for route, body in (("completions", completion()), ("chat/completions", {
            "model": "backbone", "messages": [{"role": "user", "content": "Hi"}]})):
        status, _, answer = request(f"{gateway.url}/v1/{route}", {**body, field: value})
        assert status == 400, answer
        assert answer["error"]["param"] == field and field in answer["error"]["message"]


def test_values_that_ask_for_nothing_give_the_plain_text(gateway) -> None:
    status, _, plain = request(f"{gateway.url}/v1/completions", completion())
    assert status == 200
    status, _, same = request(f"{gateway.url}/v1/completions", completion(
        repetition_penalty=1.0, min_p=0, min_tokens=0, parallel_tool_calls=True,
        use_beam_search=False, length_penalty=1, guided_json=None))
    assert status == 200 and same["choices"][0]["text"] == plain["choices"][0]["text"]
    status, _, answer = request(f"{gateway.url}/v1/completions", completion(stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert status == 400 and answer["error"]["param"] == "stream_options"


def test_malformed_tool_calls_in_a_conversation_are_400_naming_them(gateway) -> None:
    status, _, answer = request(f"{gateway.url}/v1/chat/completions", {
        "model": "backbone", "messages": [
            {"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "user", "content": "Well?"}]})
    assert status == 400 and answer["error"]["param"] == "messages[1].tool_calls", answer


def test_a_list_of_prompts_is_answered_as_a_batch(gateway) -> None:
    prompts: list[Any] = [PROMPT, "The dog", [1, 403, 407], "Lily"]
    singles = []
    for prompt in prompts:
        status, _, body = request(f"{gateway.url}/v1/completions", completion(prompt=prompt))
        assert status == 200
        singles.append(body)
    status, headers, batch = request(f"{gateway.url}/v1/completions", completion(prompt=prompts))
    assert status == 200, batch
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert [c["finish_reason"] for c in batch["choices"]] == [
        s["choices"][0]["finish_reason"] for s in singles]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)
    assert headers["X-Request-Id"] == batch["id"] and batch["object"] == "text_completion"
    status, events = sse(f"{gateway.url}/v1/completions", completion(prompt=prompts))
    assert status == 400 and events[0]["error"]["param"] == "stream"


def test_the_gateway_port_serves_its_metrics(gateway) -> None:
    request(f"{gateway.url}/v1/models")
    for url in (f"{gateway.url}/metrics", gateway.metrics_url):
        status, headers, text = _get_text(url)
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        assert ('llmstage_gateway_http_requests_total{code="200",method="GET",'
                'route="/v1/models"}') in text


def test_an_answer_that_ends_at_once_counts_its_end_of_sequence_token(gateway) -> None:
    # stories260K's EOS is id 2; the bias makes it the first pick
    status, _, body = request(f"{gateway.url}/v1/completions", completion(
        logit_bias={"2": 100}))
    assert status == 200 and body["choices"][0]["text"] == ""
    assert body["choices"][0]["stop_reason"] == "end_of_sequence"
    assert body["usage"]["completion_tokens"] == 1
    status, _, body = request(f"{gateway.url}/v1/completions", completion(max_tokens=5))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5  # no EOS generated: the tokens delivered


def _get_text(url: str) -> tuple[int, dict[str, str], str]:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return resp.status, dict(resp.headers), resp.read().decode()


def test_tokenize_and_detokenize_use_the_served_models_tokenizer(gateway) -> None:
    status, _, whole = request(f"{gateway.url}/v1/completions", completion())
    status, _, tokens = request(f"{gateway.url}/tokenize", {"model": "backbone",
                                                             "prompt": PROMPT})
    assert status == 200, tokens
    assert tokens["count"] == len(tokens["tokens"]) == whole["usage"]["prompt_tokens"]
    assert tokens["tokens"][0] == 1 and tokens["max_model_len"] == 512  # BOS first
    status, _, bare = request(f"{gateway.url}/tokenize", {"prompt": PROMPT,  # the only model
                                                           "add_special_tokens": False})
    assert status == 200 and bare["tokens"] == tokens["tokens"][1:]
    status, _, empty = request(f"{gateway.url}/tokenize", {"prompt": "",
                                                            "add_special_tokens": False})
    assert status == 200 and (empty["count"], empty["tokens"]) == (0, [])
    status, _, text = request(f"{gateway.url}/detokenize", {"model": "backbone",
                                                             "tokens": tokens["tokens"]})
    assert status == 200 and text == {"prompt": PROMPT}
    # the ids a completion of token ids takes give its text too
    status, _, by_ids = request(f"{gateway.url}/v1/completions",
                                completion(prompt=tokens["tokens"]))
    assert by_ids["choices"][0]["text"] == whole["choices"][0]["text"]
    status, _, info = request(f"{gateway.url}/tokenizer_info")
    assert status == 200 and info["model_max_length"] == 512 and info["vocab_size"] == 512
    assert info["eos_token"] == "</s>" and info["name_or_path"] == "backbone"
    assert info["chat_template"] is None  # stories260K has none


def test_tokenize_refusals_name_the_field(gateway) -> None:
    for path, body, expected, param in (
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404, None),
            ("/tokenize", {"prompt": 5}, 400, "prompt"),
            ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}, 400, None),
            ("/detokenize", {"tokens": [1, 99999]}, 400, None),
            ("/detokenize", {"tokens": ["a"]}, 400, "tokens")):
        status, _, answer = request(f"{gateway.url}{path}", body)
        assert status == expected, (body, answer)
        assert answer["error"]["param"] == param, answer
    status, _, answer = request(f"{gateway.url}/tokenize", {
        "messages": [{"role": "user", "content": "Hi"}]})
    assert "chat template" in answer["error"]["message"]
    status, _, answer = request(f"{gateway.url}/detokenize", {"tokens": [1, 99999]})
    assert "99999" in answer["error"]["message"]
