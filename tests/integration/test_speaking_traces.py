"""Traces across orchestrator, runner and the C++ talker (separate processes, OTLP to a test
receiver): one request through the speaking topology is one trace; the talker reports the
traceparent of the call that reached it and carries the context into its Subscribe."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from deployment import collect, generate_request
from otlp_receiver import OtlpReceiver, SpanRecord
from talker_reference import talker_binary

from services.contract.llmstage.v1 import orchestrator_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SPEAKING = ROOT / "services" / "orchestrator" / "topologies" / "speaking.json"
GENERATE = "llmstage.v1.Orchestrator/Generate"


TALKER_CALLS = {"Admit", "Prepare", "Finish", "Diagnostics", "Reset"}
RUNNER_SPANS = {"stage.admit", "stage.prepare", "stage.prefill", "stage.decode", "stage.finish",
                "stage.subscribe"}


def test_one_trace_across_the_speaking_topology() -> None:
    talker_binary()
    receiver = OtlpReceiver()
    up = subprocess.Popen([str(Path(sys.executable).parent / "llm-stage"), "up", "--topology",
                           str(SPEAKING), "--port", "0"], stdout=subprocess.PIPE, text=True,
                          env=os.environ | receiver.env())
    try:
        lines = [up.stdout.readline() for _ in range(3)]
        talker = re.search(r"on ([\d.]+:\d+)", lines[1]).group(1)
        target = re.search(r"on ([\d.]+:\d+)", lines[2]).group(1)
        with grpc.insecure_channel(target) as ch:
            stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
            _, _, final = collect(stub.Generate(generate_request(
                "Once upon a time", max_tokens=8, request_id="tr-speak"), timeout=60))

        def of_request(ss: list[SpanRecord]) -> tuple[SpanRecord | None, list[SpanRecord],
                                                     dict[str, SpanRecord], set[str]]:
            """The root, its trace, the client spans of calls to the talker by method, and
            the runner's span names."""
            root = next((s for s in ss if s.name == GENERATE
                         and s.attributes.get("llmstage.request_id") == "tr-speak"), None)
            mine = [s for s in ss if root is not None and s.trace_id == root.trace_id]
            calls = {s.attributes["rpc.method"]: s for s in mine
                     if s.kind == 3 and s.attributes.get("server.address") == talker}
            return root, mine, calls, {s.name for s in mine if s.service == "llmstage-thinker"}

        def complete(ss: list[SpanRecord]) -> bool:  # each process exports on its own schedule
            root, _, calls, names = of_request(ss)
            return root is not None and set(calls) >= TALKER_CALLS and names >= RUNNER_SPANS

        spans = receiver.wait_for(complete)
        root, mine, to_talker, runner_spans = of_request(spans)
        assert root is not None
        tagged = [s for s in spans if s.attributes.get("llmstage.request_id") == "tr-speak"]
        assert {s.trace_id for s in tagged} == {root.trace_id}  # exactly one trace
        assert set(to_talker) >= TALKER_CALLS
        assert all(s.parent_id == root.span_id for s in to_talker.values())
        diag = final.diagnostics["talker"]
        # the talker saw the client span of the call that reached it, and the request's root
        assert diag["traceparent"].startswith(
            f"00-{root.trace_id}-{to_talker['Admit'].span_id}-")
        assert diag["request_traceparent"].startswith(f"00-{root.trace_id}-{root.span_id}-")
        # and carried the Prepare call's context into its Subscribe to the runner
        subscribe = next(s for s in mine if s.name == "stage.subscribe")
        assert subscribe.parent_id == to_talker["Prepare"].span_id
        assert subscribe.service == "llmstage-thinker"
        assert runner_spans >= RUNNER_SPANS
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
        receiver.stop()
