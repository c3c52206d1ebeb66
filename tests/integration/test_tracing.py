"""Traces: the orchestrator and the runner export OTLP to a test receiver; each request is one
trace with the expected tree, also when requests share a Step stream, are cancelled or fail."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from deployment import Deployment, collect, generate_request
from otlp_receiver import OtlpReceiver, SpanRecord

from services.contract.llmstage.v1 import orchestrator_pb2 as opb

GENERATE = "llmstage.v1.Orchestrator/Generate"
CALLS = ("Admit", "Prepare", "Finish", "Diagnostics", "Reset")


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, OtlpReceiver]]:
    receiver = OtlpReceiver()
    dep = Deployment(tmp_path_factory.mktemp("traced"), {"backbone": {"maxSeq": 512}},
                     env=receiver.env())
    yield dep, receiver
    dep.close()
    receiver.stop()


STAGE_SPANS = frozenset({"stage.admit", "stage.prepare", "stage.prefill", "stage.decode",
                         "stage.finish"})


def request_trace(receiver: OtlpReceiver, request_id: str,
                  names: frozenset[str] = STAGE_SPANS) -> list[SpanRecord]:
    """Every span of the trace whose root carries `request_id`, once the spans `names` are
    in it too."""
    root, spans = receiver.request_trace(GENERATE, request_id, names)
    assert root is not None, request_id
    return spans


def by_name(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def test_one_request_is_one_trace_with_the_expected_tree(traced) -> None:
    dep, receiver = traced
    collect(dep.stub.Generate(generate_request("Once upon a time", max_tokens=12,
                                               request_id="t-one"), timeout=30))
    spans = request_trace(receiver, "t-one",
                          STAGE_SPANS | {f"llmstage.v1.Stage/{call}" for call in CALLS})
    root = by_name(spans, GENERATE)
    assert root.parent_id == "" and root.service == "llmstage-orchestrator"
    assert {"first_token", "finish"} <= set(root.events)
    assert root.attributes["gen_ai.usage.output_tokens"] == 12
    for call in CALLS:
        client = by_name(spans, f"llmstage.v1.Stage/{call}")
        assert client.parent_id == root.span_id and client.kind == 3  # SPAN_KIND_CLIENT
        assert client.attributes["llmstage.stage_id"] == "backbone"
        if call in ("Admit", "Prepare", "Finish"):
            server = by_name(spans, f"stage.{call.lower()}")
            assert server.parent_id == client.span_id and server.service == "llmstage-backbone"
    for name in ("stage.prefill", "stage.decode"):
        assert by_name(spans, name).parent_id == root.span_id
    decode = by_name(spans, "stage.decode")
    assert decode.attributes["gen_ai.usage.output_tokens"] == 12
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["max_length"]
    assert "first_token" in by_name(spans, "stage.prefill").events
    # every span of the request is in this one trace
    tagged = [s for s in receiver.spans if s.attributes.get("llmstage.request_id") == "t-one"]
    assert {s.trace_id for s in tagged} == {root.trace_id}


def test_a_callers_traceparent_parents_the_root(traced) -> None:
    dep, receiver = traced
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    collect(dep.stub.Generate(generate_request("The dog", max_tokens=4, request_id="t-caller"),
                              timeout=30,
                              metadata=[("traceparent", f"00-{trace_id}-{span_id}-01")]))
    root = by_name(request_trace(receiver, "t-caller"), GENERATE)
    assert root.trace_id == trace_id and root.parent_id == span_id


def test_requests_sharing_a_step_stream_get_separate_traces(traced) -> None:
    dep, receiver = traced

    def one(i: int) -> None:
        collect(dep.stub.Generate(generate_request("One day", max_tokens=30, seed=i,
                                                   request_id=f"t-pair-{i}"), timeout=30))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, range(2)))
    traces = [request_trace(receiver, f"t-pair-{i}") for i in range(2)]
    assert traces[0][0].trace_id != traces[1][0].trace_id
    for i, spans in enumerate(traces):
        for name in ("stage.prefill", "stage.decode", "stage.finish", GENERATE):
            assert by_name(spans, name).attributes["llmstage.request_id"] == f"t-pair-{i}"


def test_cancelled_and_failed_requests_record_why(traced) -> None:
    dep, receiver = traced
    call = dep.stub.Generate(generate_request("Once upon a time", max_tokens=400,
                                              ignore_eos=True, request_id="t-cancel"),
                             timeout=30)
    next(call)
    dep.stub.Cancel(opb.CancelGenerateRequest(request_id="t-cancel"))
    collect(call)
    spans = request_trace(receiver, "t-cancel")
    assert "cancel" in by_name(spans, GENERATE).events
    decode = by_name(spans, "stage.decode")
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["cancelled"]
    assert "cancel" in decode.events
    with pytest.raises(grpc.RpcError):
        collect(dep.stub.Generate(generate_request("Hi", top_p=1.5, request_id="t-fail"),
                                  timeout=30))
    spans = request_trace(receiver, "t-fail", frozenset({"stage.admit"}))
    root = by_name(spans, GENERATE)
    assert root.status_code == 2 and "SAMPLING_OUT_OF_RANGE" in root.status_message
    admit = by_name(spans, "stage.admit")
    assert admit.attributes["llmstage.refusal"] == "sampling_out_of_range"
