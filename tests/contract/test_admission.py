"""Admission refusals: admitted=false with a reason; nothing is allocated."""

from __future__ import annotations

import pytest
from stage_harness import StageServer

from llm_runner_svc.stage import StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb

REFUSED = [
    ("prompt_too_long", dict(token_ids=[1] * 64), pb.REFUSAL_PROMPT_TOO_LONG, "maxSeq"),
    ("long_text", dict(text="Once upon a time " * 40), pb.REFUSAL_PROMPT_TOO_LONG, "tokens"),
    ("top_p", dict(text="Hi", top_p=1.5), pb.REFUSAL_SAMPLING_OUT_OF_RANGE, "top_p"),
    ("temperature", dict(text="Hi", temperature=-1.0), pb.REFUSAL_SAMPLING_OUT_OF_RANGE,
     "temperature"),
    ("top_k", dict(text="Hi", top_k=-1), pb.REFUSAL_SAMPLING_OUT_OF_RANGE, "top_k"),
    ("max_tokens", dict(text="Hi", max_tokens=0), pb.REFUSAL_SAMPLING_OUT_OF_RANGE,
     "max_tokens"),
    ("bias_token", dict(text="Hi", logit_bias={600: 1.0}), pb.REFUSAL_SAMPLING_OUT_OF_RANGE,
     "600"),
    ("lora", dict(text="Hi", lora="french"), pb.REFUSAL_UNKNOWN_ADAPTER, "french"),
    ("media", dict(text="Hi", media=[pb.MediaPart(mime_type="image/png", data=b"\x89PNG")]),
     pb.REFUSAL_MEDIA_UNSUPPORTED, "text-only"),
    ("hidden", dict(text="Hi", ports=["hidden"]), pb.REFUSAL_PORT_UNAVAILABLE, "hidden"),
    ("audio", dict(text="Hi", ports=["audio"]), pb.REFUSAL_PORT_UNAVAILABLE, "audio"),
    ("vocab", dict(token_ids=[1, 600]), pb.REFUSAL_TOKEN_OUT_OF_VOCAB, "600"),
    ("chat", dict(messages=[("user", "Hi")]), pb.REFUSAL_NO_CHAT_TEMPLATE, "chat template"),
]


@pytest.fixture(scope="module")
def small() -> StageServer:
    with StageServer(StageConfig(max_batch=1, max_waiting=1, max_seq=64)) as srv:
        yield srv


@pytest.mark.parametrize("name,request_kw,refusal,needle", REFUSED, ids=[r[0] for r in REFUSED])
def test_refusal_allocates_nothing(small: StageServer, name: str, request_kw: dict,
                                   refusal: int, needle: str) -> None:
    before = small.stats()
    ans = small.admit(7, **request_kw)
    assert not ans.admitted
    assert ans.refusal == refusal
    assert needle in ans.reason
    assert small.stats() == before  # no slot, no page, nothing queued
    assert not small.stub.Reset(pb.ResetRequest(slot_id=7)).existed


def test_no_capacity_refusal_and_recovery(small: StageServer) -> None:
    small.admit_prepare(1, text="Hi", max_tokens=3)
    assert small.admit(2, text="Hi", max_tokens=3).admitted  # maxBatch 1 + 1 waiting
    before = small.stats()
    ans = small.admit(3, text="Hi")
    assert not ans.admitted and ans.refusal == pb.REFUSAL_NO_CAPACITY
    assert "limit" in ans.reason
    assert small.stats() == before
    small.stub.Reset(pb.ResetRequest(slot_id=2))
    assert small.admit(3, text="Hi").admitted  # room again
    for sid in (1, 3):
        small.stub.Reset(pb.ResetRequest(slot_id=sid))
    assert small.wait_idle()["slots"] == 0


def test_admitted_prompt_at_the_limit(small: StageServer) -> None:
    ans = small.admit(9, token_ids=[1] * 63, max_tokens=5)
    assert ans.admitted and ans.prompt_tokens == 63
    small.stub.Prepare(pb.PrepareRequest(slot_id=9))
    stream = small.step([9])
    got = stream.collect({9})[9]
    # maxSeq counts KV positions; the last sampled token needs none
    assert 63 + len(got["tokens"]) == 64 + 1 and got["reason"] == pb.FINISH_REASON_MAX_LENGTH
    small.stub.Finish(pb.FinishRequest(slot_id=9))
    small.stub.Reset(pb.ResetRequest(slot_id=9))
