"""Malformed or hostile input: INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a message; the
server keeps serving and nothing is left behind."""

from __future__ import annotations

import math

import grpc
import pytest
from stage_harness import StageServer, StepStream, make_request

from llm_runner_svc.stage import StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb

MiB = 1 << 20

BAD_REQUESTS = [
    ("nan_logit_bias", dict(text="Hi", logit_bias={5: math.nan}), "logit_bias"),
    ("inf_logit_bias", dict(text="Hi", logit_bias={5: math.inf}), "logit_bias"),
    ("negative_bias_key", dict(text="Hi", logit_bias={-3: 1.0}), "negative"),
    ("nan_temperature", dict(text="Hi", temperature=math.nan), "temperature"),
    ("inf_top_p", dict(text="Hi", top_p=math.inf), "top_p"),
    ("no_prompt", dict(), "exactly one prompt"),
    ("empty_text", dict(text=""), "empty"),
    ("empty_token_ids", dict(token_ids=[]), "empty"),
    ("negative_token", dict(token_ids=[1, -5]), "negative"),
    ("bad_role", dict(messages=[("wizard", "hi")]), "role"),
    ("empty_stop", dict(text="Hi", stop=[""]), "stop"),
    ("empty_port", dict(text="Hi", ports=[""]), "port"),
    ("oversized_prompt", dict(text="a" * (2 * MiB)), "bytes"),
]


@pytest.fixture(scope="module")
def tight() -> StageServer:
    with StageServer(StageConfig(max_seq=512), max_message_bytes=4 * MiB) as srv:
        yield srv


def expect(code: grpc.StatusCode, call, needle: str = "") -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert err.value.details() and needle in err.value.details()
    return err.value.details()


@pytest.mark.parametrize("name,kw,needle", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_malformed_request_is_invalid_argument(tight: StageServer, name: str, kw: dict,
                                               needle: str) -> None:
    before = tight.stats()
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: tight.admit(1, **kw), needle)
    assert tight.stats() == before


def test_ten_megabyte_message_is_resource_exhausted(tight: StageServer) -> None:
    before = tight.stats()
    huge = pb.AdmitRequest(slot_id=1, request=pb.GenerationRequest(text="a" * (10 * MiB)))
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: tight.stub.Admit(huge), "larger than")
    media = make_request(text="Hi", media=[pb.MediaPart(mime_type="image/png",
                                                         data=b"\0" * (10 * MiB))])
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED,
           lambda: tight.stub.Admit(pb.AdmitRequest(slot_id=2, request=media)))
    assert tight.stats() == before


def test_negative_slot_id_everywhere(tight: StageServer) -> None:
    s = tight.stub
    for call in (
        lambda: s.Admit(pb.AdmitRequest(slot_id=-1, request=make_request(text="Hi"))),
        lambda: s.Prepare(pb.PrepareRequest(slot_id=-1)),
        lambda: s.Cancel(pb.CancelRequest(slot_id=-1)),
        lambda: s.Finish(pb.FinishRequest(slot_id=-1)),
        lambda: s.Diagnostics(pb.DiagnosticsRequest(slot_id=-1)),
        lambda: s.Reset(pb.ResetRequest(slot_id=-1)),
        lambda: StepStream(s, [-1], 1).next(),
    ):
        expect(grpc.StatusCode.INVALID_ARGUMENT, call, "negative")


def test_negative_slot_in_a_later_join_fails_that_stream(tight: StageServer) -> None:
    tight.admit_prepare(3, text="Once", max_tokens=100, ignore_eos=True)
    stream = tight.step([3], credits=1)
    stream.next()
    stream.send(join=[-4])

    def drain() -> None:
        while True:
            stream.next()
            stream.send(credits=1)

    expect(grpc.StatusCode.INVALID_ARGUMENT, drain, "negative")
    assert tight.wait_idle()["slots"] == 0


def test_unknown_enum_value(tight: StageServer) -> None:
    tight.admit_prepare(4, text="Hi", max_tokens=2)
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: tight.stub.Finish(pb.FinishRequest(slot_id=4, reason=99)), "99")
    assert tight.stub.Reset(pb.ResetRequest(slot_id=4)).existed  # still PREPARED, untouched


def test_admit_without_request_and_empty_step(tight: StageServer) -> None:
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: tight.stub.Admit(pb.AdmitRequest(slot_id=5)), "request")
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: next(tight.stub.Step(iter([]))), "first message")
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: next(tight.stub.Step(iter([pb.StepRequest(credits=3)]))), "join")


def test_server_keeps_serving_after_abuse(tight: StageServer) -> None:
    assert tight.stub.Describe(pb.DescribeRequest()).runner == "llm.backbone"
    tight.admit_prepare(6, text="Once upon a time", temperature=0.0, max_tokens=20)
    stream = tight.step([6])
    got = stream.collect({6})[6]
    assert len(got["tokens"]) == 20 and got["text"]
    stream.half_close()
    tight.stub.Finish(pb.FinishRequest(slot_id=6))
    tight.stub.Reset(pb.ResetRequest(slot_id=6))
    stats = tight.wait_idle()
    assert stats["slots"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
