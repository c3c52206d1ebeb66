"""Tokenize and Detokenize on the Stage service: a prompt's ids are the ones Admit counts,
nothing is allocated, and malformed input is INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest
from stage_harness import StageServer, make_request

from services.contract.llmstage.v1 import stage_pb2 as pb

TEXT = "Once upon a time, Lily saw a café."


def test_a_prompts_ids_are_what_admit_counts(server: StageServer) -> None:
    answer = server.stub.Tokenize(pb.TokenizeRequest(request=make_request(text=TEXT)))
    admitted = server.admit(41, text=TEXT)
    assert admitted.admitted and admitted.prompt_tokens == len(answer.token_ids)
    server.stub.Finish(pb.FinishRequest(slot_id=41))
    server.stub.Reset(pb.ResetRequest(slot_id=41))
    assert answer.token_ids[0] == 1 and answer.max_seq == 512 and answer.vocab_size == 512
    assert (answer.bos_token, answer.eos_token, answer.model) == ("<s>", "</s>", "stories260K")
    bare = server.stub.Tokenize(pb.TokenizeRequest(request=make_request(text=TEXT),
                                                   add_special_tokens=False))
    assert list(bare.token_ids) == list(answer.token_ids)[1:]
    text = server.stub.Detokenize(pb.DetokenizeRequest(token_ids=answer.token_ids)).text
    assert text == TEXT
    empty = pb.GenerationRequest(text="")  # no request may carry it, yet it tokenizes
    assert list(server.stub.Tokenize(pb.TokenizeRequest(request=empty)).token_ids) == [1]
    assert list(server.stub.Tokenize(pb.TokenizeRequest(
        request=empty, add_special_tokens=False)).token_ids) == []
    assert server.wait_idle()["slots"] == 0


@pytest.mark.parametrize("call, needle", [
    (lambda stub: stub.Tokenize(pb.TokenizeRequest(request=make_request(
        messages=[("user", "Hi")]))), "chat template"),
    (lambda stub: stub.Tokenize(pb.TokenizeRequest()), "prompt"),
    (lambda stub: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 512])), "512"),
], ids=["no_template", "no_prompt", "out_of_vocab"])
def test_malformed_input_is_invalid_argument(server: StageServer, call, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(server.stub)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()
