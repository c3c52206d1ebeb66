"""The stage's own admission limits (maxQueued, maxTokensInFlight): over a limit Admit answers
at once with NO_CAPACITY and a reason, nothing is allocated, and the orchestrator turns it into
RESOURCE_EXHAUSTED for its caller; once load drops, requests are served again."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from accounting import runner_leftovers, stage_state, wait_for
from deployment import collect, generate_request
from rig import Orchestrator, Runner, write_stage
from stage_harness import make_request

from services.contract.llmstage.v1 import stage_pb2 as pb


def admit(runner: Runner, sid: int, **request: object) -> pb.AdmitResponse:
    return runner.stub.Admit(pb.AdmitRequest(slot_id=sid, request=make_request(
        text="Once upon a time", **request)), timeout=5)


def test_queue_and_token_limits(tmp_path: Path) -> None:
    runner = Runner(write_stage(tmp_path, maxQueued=4, maxTokensInFlight=300))
    orch = Orchestrator(tmp_path, {"backbone": [runner.endpoint]})
    try:
        # A flood of Admit without Prepare: four wait, the rest are refused at once.
        t0 = time.monotonic()
        answers = [admit(runner, sid, max_tokens=8) for sid in range(1, 41)]
        took = time.monotonic() - t0
        assert [a.admitted for a in answers] == [True] * 4 + [False] * 36
        assert all(a.refusal == pb.REFUSAL_NO_CAPACITY and "queue full" in a.reason
                   and "maxQueued" in a.reason for a in answers[4:])
        assert took < 5.0  # 40 answers, none of them waits for capacity
        s = stage_state(runner.stub)
        assert (s["slots"], s["queued"]) == (4, 4)
        # The orchestrator's caller gets RESOURCE_EXHAUSTED with the stage's reason, quickly.
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            collect(orch.stub.Generate(generate_request("Hi", max_tokens=4), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in (err.value.details() or "")
        assert time.monotonic() - t0 < 2.0
        for sid in range(1, 5):
            runner.stub.Reset(pb.ResetRequest(slot_id=sid), timeout=5)
        # Tokens in flight: prompt + max new tokens of every unended run count.
        assert admit(runner, 50, max_tokens=200).admitted
        held = stage_state(runner.stub)["tokens_in_flight"]
        assert 200 < held < 300
        refused = admit(runner, 51, max_tokens=200)
        assert not refused.admitted and refused.refusal == pb.REFUSAL_NO_CAPACITY
        assert "token budget full" in refused.reason and "maxTokensInFlight" in refused.reason
        assert admit(runner, 52, max_tokens=300 - int(held) - 6).admitted  # what is left fits
        for sid in (50, 52):
            runner.stub.Reset(pb.ResetRequest(slot_id=sid), timeout=5)
        left = wait_for(lambda: stage_state(runner.stub), lambda s: runner_leftovers(s, 1))
        assert not left, left
        tokens, _, final = collect(orch.stub.Generate(generate_request("Hi", max_tokens=4,
                                                                       seed=1), timeout=10))
        assert final is not None and len(tokens) == 4
    finally:
        orch.stop()
        runner.stop()
