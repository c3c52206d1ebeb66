"""A stage built with a RuntimeFactory steps the runtime that factory makes: here the faulty
one, in process, without the LLM_RUNNER_FAULTS variable the process-level suite uses."""

from __future__ import annotations

from stage_harness import StageServer

from llm_runner_svc.stage.faults import INJECTED_ERROR, Faults, faulty_runtime_factory
from services.contract.llmstage.v1 import stage_pb2 as pb


def test_a_factory_runtime_fails_its_marked_request_and_no_other() -> None:
    factory = faulty_runtime_factory(Faults(error_prefix="boom", error_after_tokens=3))
    with StageServer(runtime_factory=factory) as srv:
        srv.admit_prepare(1, text="Once upon a time", max_tokens=30, ignore_eos=True,
                          request_id="boom-1")
        srv.admit_prepare(2, text="Once upon a time", max_tokens=30, ignore_eos=True,
                          request_id="calm-2")
        out = srv.step([1, 2], credits=64).collect({1, 2})
        assert out[1]["reason"] == pb.FINISH_REASON_ERROR
        assert 3 <= len(out[1]["tokens"]) < 30
        assert out[2]["reason"] == pb.FINISH_REASON_MAX_LENGTH and len(out[2]["tokens"]) == 30
        assert srv.stub.Finish(pb.FinishRequest(slot_id=1)).error == INJECTED_ERROR
        assert srv.stub.Finish(pb.FinishRequest(slot_id=2)).error == ""
        for sid in (1, 2):
            srv.stub.Reset(pb.ResetRequest(slot_id=sid))
        assert srv.wait_idle()["slots"] == 0


def test_without_a_factory_the_stage_steps_the_plain_runtime() -> None:
    with StageServer() as srv:
        srv.admit_prepare(1, text="Once upon a time", max_tokens=30, ignore_eos=True,
                          request_id="boom-1")
        out = srv.step([1], credits=64).collect({1})
        assert out[1]["reason"] == pb.FINISH_REASON_MAX_LENGTH and len(out[1]["tokens"]) == 30
        srv.stub.Finish(pb.FinishRequest(slot_id=1))
        srv.stub.Reset(pb.ResetRequest(slot_id=1))
