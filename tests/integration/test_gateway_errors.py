"""Every error the gateway answers, with its HTTP status and an OpenAI-shaped body: 400 bad
input, 404 unknown model, 429 a full queue (RESOURCE_EXHAUSTED), 503 the orchestrator down,
504 the deadline, 502 a request a stage failed; and the metrics that count them."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from deployment import Deployment
from http_gateway import LONG, GatewayProc, request, sse, stream_events, wait_until
from test_metrics import scrape

SLOW = json.dumps({"step_delay_ms": 25})  # every decode step: a long request stays running
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, GatewayProc]]:
    """One request generates at a time and none may wait: a second one is refused."""
    dep = Deployment(tmp_path_factory.mktemp("busy"), {"backbone": {"maxSeq": 512}},
                     env={"LLM_RUNNER_FAULTS": SLOW}, maxRunning=1, maxQueued=0)
    gw = GatewayProc(dep.target)
    yield dep, gw
    gw.stop()
    dep.close()


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "backbone", "prompt": "Once upon a time", "max_tokens": 4, **fields}


def error_of(status: int, body: Any, expected: int, kind: str, code: str | None) -> str:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["type"] == kind and body["error"]["code"] == code, body
    return str(body["error"]["message"])


def test_bad_input_is_400(busy) -> None:
    _, gw = busy
    url = f"{gw.url}/v1/completions"
    message = error_of(*request(url, b"{not json")[::2], 400, "invalid_request_error",
                       "invalid_argument")
    assert "not valid JSON" in message
    status, _, body = request(url, completion(n=3, best_of=2))
    error_of(status, body, 400, "invalid_request_error", "invalid_argument")
    assert body["error"]["param"] == "best_of"
    # refused by the stage at Admit: its reason reaches the caller
    status, _, body = request(url, completion(top_p=1.5))
    assert "top_p" in error_of(status, body, 400, "invalid_request_error", "invalid_argument")
    status, _, body = request(f"{gw.url}/v1/chat/completions", {
        "model": "backbone", "messages": [{"role": "user", "content": "Hi"}]})
    assert "no chat template" in error_of(status, body, 400, "invalid_request_error",
                                          "invalid_argument")
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="backbone", prompt="Hi", temperature=-1, stream=True)
    assert info.value.status_code == 400 and "temperature" in info.value.message


def test_unknown_model_and_path_are_404(busy) -> None:
    _, gw = busy
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found" and "backbone" in info.value.message
    status, _, body = request(f"{gw.url}/v1/models/gpt-4o")
    error_of(status, body, 404, "invalid_request_error", "model_not_found")
    status, _, body = request(f"{gw.url}/v1/embeddings", {"model": "backbone"})
    error_of(status, body, 404, "invalid_request_error", None)


def test_a_full_queue_is_429_and_the_first_request_goes_on(busy) -> None:
    dep, gw = busy
    first = stream_events(f"{gw.url}/v1/completions", completion(  # 25 ms a step: 5 s
        max_tokens=200, ignore_eos=True, temperature=0, stream_options={"include_usage": True}))
    status, chunk = next(first)  # generating: it holds the one running place
    assert status == 200 and chunk["choices"][0]["text"]
    status, headers, body = request(f"{gw.url}/v1/completions", completion())
    assert "queue is full" in error_of(status, body, 429, "rate_limit_error",
                                       "resource_exhausted")
    assert headers["Retry-After"] == "1"
    rest = [data for _, data in first]
    assert rest[-1] == "[DONE]" and rest[-2]["usage"]["completion_tokens"] == 200
    assert wait_until(lambda: dep.topology()["runs"] == 0)


def test_the_deadline_is_504_and_frees_the_stage(busy) -> None:
    dep, _ = busy
    short = GatewayProc(dep.target, "--request-timeout-s", "3")
    try:
        long_ask = completion(max_tokens=400, ignore_eos=True)  # 25 ms a step: 10 s
        status, _, body = request(f"{short.url}/v1/completions", long_ask)
        assert "deadline" in error_of(status, body, 504, "timeout_error", "deadline_exceeded")
        assert wait_until(lambda: dep.topology()["runs"] == 0)  # its one place is free again
        # streaming: the 200 is sent with the first text; the deadline then ends the stream
        status, events = sse(f"{short.url}/v1/completions", long_ask)
        assert status == 200 and events[0]["choices"][0]["text"]
        assert "[DONE]" not in events
        assert events[-1]["error"]["code"] == "deadline_exceeded"
    finally:
        short.stop()
    assert wait_until(lambda: dep.topology()["runs"] == 0)
    stage = dep.all_stages[0].wait_idle(LONG)
    assert stage["slots"] == 0 and stage["kv_pages_free"] == stage["kv_pages_total"]


def test_an_orchestrator_that_is_down_is_503() -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gw = GatewayProc(f"127.0.0.1:{port}")
    try:
        for status, headers, body in (request(f"{gw.url}/v1/completions", completion()),
                                      request(f"{gw.url}/v1/models")):
            assert f"127.0.0.1:{port}" in error_of(status, body, 503,
                                                   "service_unavailable_error", "unavailable")
            assert headers["Retry-After"] == "1"
        status, _, body = request(f"{gw.url}/health")
        error_of(status, body, 503, "service_unavailable_error", "unavailable")
        api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0,
                            timeout=LONG)
        with pytest.raises(openai.InternalServerError) as info:
            api.completions.create(model="backbone", prompt="Hi", stream=True)
        assert info.value.status_code == 503
        counts = scrape(gw.metrics_url)  # type: ignore[arg-type]
        key = ("llmstage_gateway_http_requests_total",
               (("code", "503"), ("method", "POST"), ("route", "/v1/completions")))
        assert counts[key] == 2
        assert counts[("llmstage_gateway_http_requests_in_flight", ())] == 0
    finally:
        gw.stop()


def test_a_request_a_stage_failed_is_502(tmp_path) -> None:
    faults = json.dumps({"error_prefix": "cmpl-", "error_after_tokens": 2})
    dep = Deployment(tmp_path, {"backbone": {"maxSeq": 512}}, env={"LLM_RUNNER_FAULTS": faults})
    gw = GatewayProc(dep.target)
    try:
        status, _, body = request(f"{gw.url}/v1/completions", completion(max_tokens=20))
        error_of(status, body, 502, "server_error", "generation_failed")
        status, events = sse(f"{gw.url}/v1/completions", completion(max_tokens=20))
        assert status == 200 and events[-1]["error"]["code"] == "generation_failed"
        assert "[DONE]" not in events
    finally:
        gw.stop()
        dep.close()


def test_metrics_count_requests_by_route_and_code(busy) -> None:
    _, gw = busy
    for body in (completion(), completion(model="nope"), completion(top_p=7)):
        request(f"{gw.url}/v1/completions", body)
    request(f"{gw.url}/v1/models")
    samples = scrape(gw.metrics_url)  # type: ignore[arg-type]
    route = ("route", "/v1/completions")
    for code in ("200", "404", "400"):
        assert samples[("llmstage_gateway_http_requests_total",
                        (("code", code), ("method", "POST"), route))] >= 1
    assert samples[("llmstage_gateway_http_requests_total",
                    (("code", "200"), ("method", "GET"), ("route", "/v1/models")))] == 1
    assert samples[("llmstage_gateway_http_request_duration_seconds_count", (route,))] >= 3


def test_a_batch_larger_than_the_queue_runs_in_turns(busy) -> None:
    dep, gw = busy  # one request runs, none may wait: the batch's prompts go one at a time
    status, _, body = request(f"{gw.url}/v1/completions", completion(
        prompt=["Once upon a time", "The dog", "Lily"], max_tokens=3, ignore_eos=True))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 9
    assert wait_until(lambda: dep.topology()["runs"] == 0)
