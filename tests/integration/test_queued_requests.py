"""Requests waiting in the orchestrator's admission queue: Cancel finds and ends them, and a
request id already queued or running is ALREADY_EXISTS."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
from deployment import Deployment, collect, generate_request

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb


def wait_queued(dep: Deployment, n: int) -> None:
    deadline = time.monotonic() + 20
    while dep.topology()["queued"] < n:
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.005)


def in_thread(dep: Deployment, req: opb.GenerateRequest) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(collect(dep.stub.Generate(req, timeout=60)))
        except grpc.RpcError as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_cancel_and_duplicate_ids_of_queued_requests(tmp) -> None:
    dep = Deployment(tmp, {"backbone": {"maxSeq": 512}}, maxRunning=1, maxQueued=4)
    try:
        running = dep.stub.Generate(generate_request(
            "Once upon a time", max_tokens=500, ignore_eos=True, request_id="busy"), timeout=60)
        next(running)  # "busy" holds the one running place
        thread, out = in_thread(dep, generate_request("The dog", max_tokens=5,
                                                      request_id="queued-1"))
        wait_queued(dep, 1)
        for rid, where in (("queued-1", "queued"), ("busy", "running")):
            with pytest.raises(grpc.RpcError) as err:
                collect(dep.stub.Generate(generate_request("Hi", max_tokens=5, request_id=rid),
                                          timeout=30))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert f"already {where}" in err.value.details()
        assert dep.stub.Cancel(opb.CancelGenerateRequest(request_id="queued-1")).found
        thread.join(30)
        tokens, text, final = out[0]
        assert final.finish_reason == pb.FINISH_REASON_CANCELLED
        assert tokens == [] and text == "" and final.usage.completion_tokens == 0
        assert dep.topology()["queued"] == 0
        assert not dep.stub.Cancel(opb.CancelGenerateRequest(request_id="queued-1")).found
        assert dep.stub.Cancel(opb.CancelGenerateRequest(request_id="busy")).found
        _, _, final = collect(running)
        assert final.finish_reason == pb.FINISH_REASON_CANCELLED
        # The running place went back: a new request runs to its end.
        _, _, final = collect(dep.stub.Generate(generate_request("Hi", max_tokens=5),
                                                timeout=60))
        assert final.usage.completion_tokens == 5
        state = dep.topology()
        assert state["running"] == 0 and state["queued"] == 0 and state["runs"] == 0
        assert dep.all_stages[0].wait_idle()["slots"] == 0
    finally:
        dep.close()
