"""The orchestrator's codec: every FinishReason value maps both ways through its table, and
the domain types encode to the messages the API documents."""

from __future__ import annotations

import pytest

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import InvalidArgument
from services.orchestrator.codec import (
    Delta,
    FinalReport,
    FinishReason,
    GenerateInput,
    Usage,
    finish_reason_from_pb,
    finish_reason_to_pb,
)


def test_every_finish_reason_maps_both_ways():
    assert {finish_reason_to_pb(r) for r in FinishReason} == set(pb.FinishReason.values())
    for value in pb.FinishReason.values():
        assert finish_reason_to_pb(finish_reason_from_pb(value)) == value
    assert finish_reason_from_pb(pb.FINISH_REASON_MAX_LENGTH).value == "max_length"
    assert finish_reason_from_pb(999) is FinishReason.UNSPECIFIED


def test_generate_input_copies_the_request_and_names_its_prompt():
    msg = opb.GenerateRequest(request=pb.GenerationRequest(request_id="r", text="Hi"),
                              sinks=["llm:text"])
    call = GenerateInput.from_pb(msg)
    msg.request.text = "changed"
    assert call.request.text == "Hi" and call.request_id == "r"
    assert call.prompt_field == "text" and call.sinks == ("llm:text",)
    assert GenerateInput.from_pb(opb.GenerateRequest(request=pb.GenerationRequest())
                                 ).prompt_field == ""
    with pytest.raises(InvalidArgument, match="request is required"):
        GenerateInput.from_pb(opb.GenerateRequest())


def test_events_encode_as_the_api_messages():
    delta = Delta("llm", "text", [1, 2], "ab").to_pb()
    assert delta.WhichOneof("event") == "delta"
    assert list(delta.delta.token_ids) == [1, 2] and delta.delta.text == "ab"
    final = FinalReport("r", FinishReason.CANCELLED, ("llm", "talker"), error="",
                        usage=Usage(3, 4), diagnostics={"llm": {"tokens_out": 4}}).to_pb()
    assert final.final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert list(final.final.route) == ["llm", "talker"]
    assert (final.final.usage.prompt_tokens, final.final.usage.completion_tokens) == (3, 4)
    assert final.final.diagnostics["llm"]["tokens_out"] == 4
