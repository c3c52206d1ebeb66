"""The orchestrator over real stage processes: exact outputs under concurrency, cohorts,
cancels and deadlines that reach every stage, queue limits, later-stage refusals."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from deployment import Deployment, StageProc, collect, generate_request
from helpers import solo

from llm_runner_svc.models import Model
from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb

PROMPTS = ["Once upon a time", "The dog", "Lily and Ben", "One day", "Tom had a red ball",
           "The sun", "A little bird", "There was a girl"]


def spec(i: int) -> dict:
    return dict(text=PROMPTS[i % len(PROMPTS)], temperature=[0.0, 0.7, 1.0, 0.9][i % 4],
                seed=1000 + i, max_tokens=10 + (i * 7) % 50, top_k=[0, 20, 50][i % 3])


def test_thirty_two_concurrent_clients_get_their_solo_outputs(deployment: Deployment,
                                                              stories: Model) -> None:
    def one(i: int) -> tuple[list[int], str, opb.FinalReport]:
        s = dict(spec(i))
        return collect(deployment.stub.Generate(generate_request(s.pop("text"), **s),
                                                timeout=60))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    max_batch = 0
    for i, (tokens, text, final) in enumerate(results):
        want_tokens, want_text, want_reason = solo(stories, spec(i))
        assert tokens == want_tokens and text == want_text, f"request {i}"
        assert pb.FinishReason.Name(final.finish_reason).lower().endswith(want_reason)
        assert final.usage.completion_tokens == len(want_tokens)
        diag = final.diagnostics["backbone"]
        assert diag["tokens_out"] == len(want_tokens)
        max_batch = max(max_batch, diag["max_batch_size"])
    assert max_batch > 1  # the requests really shared decode steps
    assert deployment.all_stages[0].wait_idle()["slots"] == 0


def test_two_hundred_cancels_leak_nothing(deployment: Deployment) -> None:
    rng = random.Random(7)
    stub = deployment.stub

    def one(i: int) -> str:
        req = generate_request(PROMPTS[i % 8], max_tokens=300, ignore_eos=True, seed=i,
                               request_id=f"c{i}")
        how, after = rng.choice(["rpc", "client", "deadline"]), rng.randint(0, 6)
        call = stub.Generate(req, timeout=rng.uniform(0.02, 0.3) if how == "deadline" else 60)
        try:
            for n, _ in enumerate(call):
                if n == after:
                    if how == "rpc":
                        stub.Cancel(opb.CancelGenerateRequest(request_id=f"c{i}"), timeout=10)
                    elif how == "client":
                        call.cancel()
        except grpc.RpcError as exc:
            return exc.code().name
        return "done"

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(one, range(200)))
    assert set(outcomes) <= {"done", "CANCELLED", "DEADLINE_EXCEEDED"}
    assert outcomes.count("CANCELLED") > 20 and outcomes.count("DEADLINE_EXCEEDED") > 20
    stats = deployment.all_stages[0].wait_idle()
    assert stats["slots"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["running"] == 0 and stats["waiting"] == 0
    topo = deployment.topology()
    assert topo["running"] == 0 and topo["queued"] == 0
    assert all(r["inFlight"] == 0 for r in topo["stages"][0]["replicas"])


def test_cancel_by_request_id_ends_with_cancelled(deployment: Deployment) -> None:
    req = generate_request("Once upon a time", max_tokens=400, ignore_eos=True,
                           request_id="to-cancel")
    call = deployment.stub.Generate(req, timeout=60)
    first = next(call)
    assert first.HasField("delta")
    assert deployment.stub.Cancel(opb.CancelGenerateRequest(request_id="to-cancel")).found
    _, _, final = collect(call)
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert final.diagnostics["backbone"]["finish_reason"] == "cancelled"
    assert not deployment.stub.Cancel(opb.CancelGenerateRequest(request_id="to-cancel")).found


def test_queue_full_is_resource_exhausted_at_once(tmp) -> None:
    dep = Deployment(tmp, {"backbone": {"maxSeq": 512}}, maxRunning=1, maxQueued=1)
    try:
        long_req = generate_request("Once upon a time", max_tokens=500, ignore_eos=True)
        a = dep.stub.Generate(long_req, timeout=60)
        next(a)  # A is generating
        b_result: list = []
        b = threading.Thread(target=lambda: b_result.append(collect(
            dep.stub.Generate(generate_request("The dog", max_tokens=5), timeout=60))))
        b.start()
        deadline = time.monotonic() + 10
        while dep.topology()["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            collect(dep.stub.Generate(generate_request("Hi", max_tokens=5), timeout=60))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        assert time.monotonic() - t0 < 5  # refused at once, not after waiting
        _, _, final = collect(a)
        assert final.usage.completion_tokens == 500
        b.join(30)
        assert b_result and b_result[0][2].usage.completion_tokens == 5
    finally:
        dep.close()


def test_refusal_at_a_later_stage_releases_earlier_admissions(tmp, stories: Model) -> None:
    dep = Deployment(tmp, {"wide": {"maxSeq": 512}, "narrow": {"maxSeq": 32}})
    try:
        prompt = "Once upon a time there was a little girl named Lily who loved to play " * 2
        assert len(stories.tokenizer.encode(prompt)) > 32
        with pytest.raises(grpc.RpcError) as err:
            collect(dep.stub.Generate(generate_request(prompt, max_tokens=5), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stage narrow refused" in err.value.details()
        assert "PROMPT_TOO_LONG" in err.value.details()
        for proc in dep.all_stages:
            stats = proc.wait_idle()
            assert stats["slots"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
        # a short prompt goes through both stages, each streaming its own text
        tokens, text, final = collect(dep.stub.Generate(
            generate_request("Once", max_tokens=6, temperature=0.0), timeout=30))
        assert list(final.route) == ["wide", "narrow"]
        assert set(final.diagnostics.keys()) == {"wide", "narrow"}
        assert len(tokens) == 12  # both sinks stream
    finally:
        dep.close()


def test_start_refuses_ports_a_stage_cannot_produce(tmp) -> None:
    stage = StageProc()  # serves text and tokens, no hidden port
    try:
        topo = tmp / "topology.json"
        topo.write_text(json.dumps({"stages": [{
            "id": "thinker", "runner": "llm.backbone", "endpoints": [stage.endpoint],
            "emits": ["text", "tokens", "hidden"], "inputs": ["request:prompt"]}]}))
        done = subprocess.run([sys.executable, "-m", "services.orchestrator", "--topology",
                               str(topo), "--port", "0"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2
        assert "FAILED_PRECONDITION" in done.stderr and "cannot produce port 'hidden'" \
            in done.stderr
    finally:
        stage.stop()


def test_bad_requests_get_clear_errors_and_leave_nothing(deployment: Deployment) -> None:
    cases = [
        (opb.GenerateRequest(), "request is required"),
        (opb.GenerateRequest(request=pb.GenerationRequest(text="Hi"), sinks=["nope:text"]),
         "not offered"),
        (generate_request("Hi", temperature=float("nan")), "temperature"),
        (generate_request("Hi", top_p=1.5), "SAMPLING_OUT_OF_RANGE"),
        (opb.GenerateRequest(request=pb.GenerationRequest()), "exactly one prompt"),
    ]
    for req, needle in cases:
        with pytest.raises(grpc.RpcError) as err:
            collect(deployment.stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert needle in err.value.details()
    stats = deployment.all_stages[0].wait_idle()
    assert stats["slots"] == 0 and deployment.topology()["running"] == 0
