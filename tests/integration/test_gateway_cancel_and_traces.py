"""A client that drops its connection mid-stream cancels the request on every stage, which
ends idle (Diagnostics); one request through the gateway is one trace whose root is the
gateway's span (or a child of the caller's traceparent) across orchestrator and runner."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from deployment import Deployment
from http_gateway import LONG, GatewayProc, request, stream_events, wait_until
from otlp_receiver import OtlpReceiver, SpanRecord
from test_metrics import scrape

GENERATE = "llmstage.v1.Orchestrator/Generate"
ROOT_SPAN = "POST /v1/completions"
SLOW = json.dumps({"step_delay_ms": 20})  # a 400-token request runs for seconds


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Deployment, GatewayProc, OtlpReceiver]]:
    receiver = OtlpReceiver()
    dep = Deployment(tmp_path_factory.mktemp("gwtrace"), {"backbone": {"maxSeq": 512}},
                     env=receiver.env() | {"LLM_RUNNER_FAULTS": SLOW}, metrics=True)
    gw = GatewayProc(dep.target, env=receiver.env())
    yield dep, gw, receiver
    gw.stop()
    dep.close()
    receiver.stop()


def test_a_client_leaving_mid_stream_leaves_every_stage_idle(traced) -> None:
    dep, gw, _ = traced
    stage = dep.all_stages[0]
    long_ask = {"model": "backbone", "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True}
    raw = stream_events(f"{gw.url}/v1/completions", long_ask)
    for _ in range(3):
        status, chunk = next(raw)
        assert status == 200 and chunk["choices"][0]["finish_reason"] is None
    raw.close()  # the connection closes with the request still generating
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=LONG)
    with api.completions.create(model="backbone", prompt="Once upon a time", max_tokens=400,
                                extra_body={"ignore_eos": True}, stream=True) as chunks:
        assert next(iter(chunks)).choices[0].text

    assert wait_until(lambda: dep.topology()["runs"] == 0)
    idle = stage.wait_idle(LONG)
    assert idle["slots"] == 0 and idle["running"] == 0 and idle["queued"] == 0
    assert idle["kv_pages_free"] == idle["kv_pages_total"] and idle["tokens_in_flight"] == 0
    topology = dep.topology()
    assert topology["streamMembers"] == 0 and topology["running"] == 0
    # both were cancelled, not run to their end
    finished = scrape(stage.metrics_url)  # type: ignore[arg-type]
    assert finished[("llmstage_requests_finished_total", (("finish_reason", "cancelled"),))] == 2
    assert ("llmstage_requests_finished_total", (("finish_reason", "max_length"),)) \
        not in finished
    assert wait_until(lambda: scrape(gw.metrics_url)[(  # type: ignore[arg-type]
        "llmstage_gateway_http_requests_total",
        (("code", "499"), ("method", "POST"), ("route", "/v1/completions")))] == 2)


# Spans every traced request has, from the gateway, the orchestrator and the runner.
EXPECTED = frozenset({GENERATE, "stage.admit", "stage.prepare", "stage.prefill",
                      "stage.decode", "stage.finish"})


def _trace_of(receiver: OtlpReceiver, request_id: str) -> list[SpanRecord]:
    """Every span of the trace whose gateway span carries `request_id`, once EXPECTED are
    in."""
    found, spans = receiver.request_trace(ROOT_SPAN, request_id, EXPECTED, LONG)
    assert found is not None, request_id
    return spans


def _one(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


@pytest.mark.parametrize("is_stream", [False, True], ids=["whole", "stream"])
def test_one_request_is_one_trace_rooted_at_the_gateway(traced, is_stream: bool) -> None:
    _, gw, receiver = traced
    ask = {"model": "backbone", "prompt": "Once upon a time", "max_tokens": 6}
    if is_stream:
        events = [data for _, data in stream_events(f"{gw.url}/v1/completions", ask)]
        request_id = events[0]["id"]
    else:
        status, _, body = request(f"{gw.url}/v1/completions", ask)
        assert status == 200
        request_id = body["id"]
    spans = _trace_of(receiver, request_id)
    root = _one(spans, ROOT_SPAN)
    assert root.parent_id == "" and root.service == "llmstage-gateway"
    assert root.kind == 2 and root.attributes["http.response.status_code"] == 200  # SERVER
    generate = _one(spans, GENERATE)
    assert generate.parent_id == root.span_id and generate.service == "llmstage-orchestrator"
    assert generate.attributes["llmstage.request_id"] == request_id
    for name in ("stage.admit", "stage.prepare", "stage.prefill", "stage.decode",
                 "stage.finish"):
        assert _one(spans, name).service == "llmstage-backbone"
    assert _one(spans, "stage.decode").attributes["gen_ai.usage.output_tokens"] == 6


def test_a_callers_traceparent_parents_the_gateways_span(traced) -> None:
    _, gw, receiver = traced
    trace_id, span_id = "5af7183fb1d4cf5f4bf92f3577b34da6", "a3ce929d0e0e4736"
    status, headers, body = request(
        f"{gw.url}/v1/completions", {"model": "backbone", "prompt": "The dog", "max_tokens": 3},
        headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
    assert status == 200
    spans = _trace_of(receiver, headers["X-Request-Id"])
    root = _one(spans, ROOT_SPAN)
    assert root.trace_id == trace_id and root.parent_id == span_id
    assert _one(spans, GENERATE).parent_id == root.span_id
