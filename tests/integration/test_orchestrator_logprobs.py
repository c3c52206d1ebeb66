"""Log-probabilities and structured output through a real orchestrator and stage: a caller that
reads slowly gets deltas that gather several steps, each with one log-probability per token in
order and the prompt's once; a structured output that does not compile ends the call with the
stage's refusal; `llm-stage generate` constrains and reports log-probabilities."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from deployment import Deployment
from llm_stage_client.cli import main

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb


def test_a_slow_reader_gets_one_logprob_per_token(deployment: Deployment) -> None:
    # A small HTTP/2 window, so what the caller does not read waits in the orchestrator.
    channel = grpc.insecure_channel(deployment.target, options=[
        ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)])
    stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
    request = opb.GenerateRequest(request=pb.GenerationRequest(
        text="Once upon a time", ignore_eos=True, logprobs=2, prompt_logprobs=1,
        sampling=pb.SamplingOverrides(temperature=0.0, max_tokens=200)))
    deltas: list[opb.Delta] = []
    final = None
    try:
        for ev in stub.Generate(request, timeout=120):
            if ev.HasField("delta"):
                if not deltas:
                    time.sleep(1.0)  # the stage steps on meanwhile: later deltas gather
                deltas.append(ev.delta)
            else:
                final = ev.final
    finally:
        channel.close()
    assert final is not None and final.finish_reason == pb.FINISH_REASON_MAX_LENGTH
    assert sum(len(d.token_ids) for d in deltas) == 200
    assert max(len(d.token_ids) for d in deltas) > 1  # some deltas gathered several steps
    for d in deltas:
        assert [lp.token_id for lp in d.logprobs] == list(d.token_ids)
        assert all(len(lp.top_ids) == 2 and lp.token_id == lp.top_ids[0] for lp in d.logprobs)
    assert len(deltas[0].prompt_logprobs) == final.usage.prompt_tokens - 1
    assert not any(d.prompt_logprobs for d in deltas[1:])


@pytest.mark.parametrize("so", [pb.StructuredOutput(regex="(ab"),
                                pb.StructuredOutput(json_schema="{not json")],
                         ids=["regex", "json_schema"])
def test_a_structured_output_that_does_not_compile_ends_the_call(deployment: Deployment,
                                                                 so: pb.StructuredOutput) -> None:
    request = opb.GenerateRequest(request=pb.GenerationRequest(text="Hi",
                                                               structured_output=so))
    with pytest.raises(grpc.RpcError) as err:
        list(deployment.stub.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "REFUSAL_STRUCTURED_OUTPUT" in (err.value.details() or "")


def test_the_cli_constrains_and_reports_logprobs(deployment: Deployment,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--target", deployment.target, "--choice", "yes", "--choice",
                 "no", "--logprobs", "1", "--prompt-logprobs", "0", "--max-tokens", "8",
                 "Is the sky blue? "]) == 0
    out, err = capsys.readouterr()
    report = json.loads(err.strip().splitlines()[-1])
    assert out.rstrip("\n") in ("yes", "no")
    assert report["diagnostics"]["backbone"]["structured_output"] == "choice"
    assert len(report["logprobs"]) == report["completion_tokens"]
    assert all(len(lp["top"]) == 1 for lp in report["logprobs"])
    assert len(report["prompt_logprobs"]) == report["prompt_tokens"] - 1
    assert main(["generate", "--target", deployment.target, "--regex", "(ab", "Hi"]) == 2
    assert "REFUSAL_STRUCTURED_OUTPUT" in capsys.readouterr().err


def test_log_probabilities_arrive_when_the_first_pick_ends_the_request(
        deployment: Deployment) -> None:
    eos = 2  # stories260K's end of sequence, made the certain first pick by the bias
    request = opb.GenerateRequest(request=pb.GenerationRequest(
        text="Once upon a time", prompt_logprobs=0, logprobs=0, logit_bias={eos: 100.0},
        sampling=pb.SamplingOverrides(temperature=0.0, max_tokens=1)))
    events = list(deployment.stub.Generate(request, timeout=60))
    deltas = [ev.delta for ev in events if ev.HasField("delta")]
    final = events[-1].final
    assert final.finish_reason == pb.FINISH_REASON_END_OF_SEQUENCE
    assert final.usage.completion_tokens == 0
    assert sum(len(d.prompt_logprobs) for d in deltas) == final.usage.prompt_tokens - 1
    # the ending token's log-probability comes last, though it is not among the token ids
    assert [lp.token_id for d in deltas for lp in d.logprobs] == [eos]
