"""Structured output, penalties, min_p and log-probabilities over real gRPC: what reaches the
runtime, what Admit refuses (and that a refusal allocates nothing), what is malformed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from helpers import TEST_ENGINE_SCORES
from stage_harness import StageServer

from llm_runner_svc.runtime import GenerationRequest, InferenceRuntime
from llm_runner_svc.stage import StageConfig
from llm_runner_svc.stage.limits import RequestLimits
from services.contract.llmstage.v1 import stage_pb2 as pb


class RecordingRuntime(InferenceRuntime):
    """The plain runtime, keeping every request it was given."""

    submitted: list[GenerationRequest] = []

    def submit(self, req: GenerationRequest) -> None:
        RecordingRuntime.submitted.append(req)
        super().submit(req)


@pytest.fixture(scope="module")
def srv() -> Iterator[StageServer]:
    config = StageConfig(max_seq=128, limits=RequestLimits(max_grammar_bytes=256))
    with StageServer(config, runtime_factory=RecordingRuntime) as server:
        yield server


def request(text: str = "Once upon a time", sampling: dict[str, Any] | None = None,
            **kw: Any) -> pb.GenerationRequest:
    return pb.GenerationRequest(text=text, sampling=pb.SamplingOverrides(**(sampling or {})),
                                **kw)


def admit(srv: StageServer, slot_id: int, req: pb.GenerationRequest) -> pb.AdmitResponse:
    return srv.stub.Admit(pb.AdmitRequest(slot_id=slot_id, request=req))


def run_to_end(srv: StageServer, slot_id: int) -> None:
    srv.stub.Prepare(pb.PrepareRequest(slot_id=slot_id))
    srv.step([slot_id], credits=64).collect({slot_id})
    srv.stub.Finish(pb.FinishRequest(slot_id=slot_id))


def release(srv: StageServer, slot_id: int) -> dict[str, Any]:
    diag = MessageToDict(srv.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=slot_id)).values)
    srv.stub.Reset(pb.ResetRequest(slot_id=slot_id))
    return diag


def test_penalties_min_p_and_logprobs_reach_the_runtime(srv: StageServer) -> None:
    ans = admit(srv, 1, request(
        sampling=dict(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.25,
                      min_p=0.125, max_tokens=4, seed=3),
        logprobs=2, request_id="sampled", ignore_eos=True,
        **({"prompt_logprobs": 0} if TEST_ENGINE_SCORES else {})))
    assert ans.admitted, ans.reason
    run_to_end(srv, 1)
    got = next(r for r in RecordingRuntime.submitted if r.label == "sampled")
    sp = got.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == \
        (0.5, -0.25, 1.25, 0.125)
    assert (sp.logprobs, sp.prompt_logprobs, sp.seed, sp.max_new_tokens) == \
        (2, 0 if TEST_ENGINE_SCORES else None, 3, 4)
    assert got.constraint is None
    sampling = release(srv, 1)["sampling"]
    assert (sampling["presence_penalty"], sampling["min_p"], sampling["logprobs"]) == \
        (0.5, 0.125, 2)


def test_a_structured_output_reaches_the_runtime(srv: StageServer) -> None:
    so = pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no"]))
    ans = admit(srv, 2, request(sampling=dict(max_tokens=8), structured_output=so,
                                request_id="choice"))
    assert ans.admitted, ans.reason
    run_to_end(srv, 2)
    got = next(r for r in RecordingRuntime.submitted if r.label == "choice")
    assert got.constraint is not None
    assert (got.constraint.kind, got.constraint.value) == ("choice", ("yes", "no"))
    assert release(srv, 2)["structured_output"] == "choice"


@pytest.mark.parametrize("so,needle", [
    (pb.StructuredOutput(regex="(ab"), "regex"),
    (pb.StructuredOutput(json_schema="{not json"), "json_schema"),
    (pb.StructuredOutput(json_schema='{"type": "no-such-type"}'), "json_schema"),
], ids=["unbalanced_regex", "schema_not_json", "schema_bad_type"])
def test_a_structured_output_that_does_not_compile_is_refused_at_admit(
        srv: StageServer, so: pb.StructuredOutput, needle: str) -> None:
    before = srv.stats()
    ans = admit(srv, 3, request(structured_output=so))
    assert not ans.admitted
    assert ans.refusal == pb.REFUSAL_STRUCTURED_OUTPUT
    assert "structured output" in ans.reason and needle in ans.reason
    assert srv.stats() == before  # no slot, no page
    assert not srv.stub.Reset(pb.ResetRequest(slot_id=3)).existed


def test_a_schema_over_max_grammar_bytes_is_refused(srv: StageServer) -> None:
    before = srv.stats()
    ans = admit(srv, 4, request(structured_output=pb.StructuredOutput(regex="a" * 257)))
    assert not ans.admitted and ans.refusal == pb.REFUSAL_STRUCTURED_OUTPUT
    assert "257 bytes" in ans.reason and "maxGrammarBytes" in ans.reason
    assert srv.stats() == before


OUT_OF_RANGE = [
    ("presence", dict(sampling=dict(presence_penalty=2.5)), "presence_penalty"),
    ("frequency", dict(sampling=dict(frequency_penalty=-2.5)), "frequency_penalty"),
    ("repetition", dict(sampling=dict(repetition_penalty=0.0)), "repetition_penalty"),
    ("min_p", dict(sampling=dict(min_p=1.5)), "min_p"),
    ("logprobs", dict(logprobs=21), "logprobs"),
    ("prompt_logprobs", dict(prompt_logprobs=-1), "prompt_logprobs"),
]


@pytest.mark.parametrize("name,kw,needle", OUT_OF_RANGE, ids=[r[0] for r in OUT_OF_RANGE])
def test_values_out_of_range_are_refused_naming_the_field(srv: StageServer, name: str,
                                                           kw: dict, needle: str) -> None:
    before = srv.stats()
    ans = admit(srv, 5, request(**kw))
    assert not ans.admitted and ans.refusal == pb.REFUSAL_SAMPLING_OUT_OF_RANGE
    assert needle in ans.reason
    assert srv.stats() == before


MALFORMED = [
    ("no_choices", pb.StructuredOutput(choice=pb.ChoiceList()), "at least one"),
    ("empty_regex", pb.StructuredOutput(regex=""), "empty"),
]


@pytest.mark.parametrize("name,so,needle", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_an_empty_structured_output_is_invalid_argument(srv: StageServer, name: str,
                                                        so: pb.StructuredOutput,
                                                        needle: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        admit(srv, 6, request(structured_output=so))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (err.value.details() or "")


def test_json_object_false_is_free_text(srv: StageServer) -> None:
    ans = admit(srv, 7, request(sampling=dict(max_tokens=2),
                                structured_output=pb.StructuredOutput(json_object=False),
                                request_id="free"))
    assert ans.admitted, ans.reason
    run_to_end(srv, 7)
    got = next(r for r in RecordingRuntime.submitted if r.label == "free")
    assert got.constraint is None
    assert "structured_output" not in release(srv, 7)
