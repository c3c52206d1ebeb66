"""Hostile input over real processes (a runner and an orchestrator on loopback): prompts
large enough to freeze a stage that tokenized them on its event loop, request bytes that are
not valid protobuf (strings that are not UTF-8), and requests or subscriptions that would
exhaust the stage. Each case asserts its status code, that health answered throughout (checked
from a thread while the case runs), and that both services return to idle; at the end, that
neither logged anything at ERROR."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from hostile import LONE_SURROGATE, HealthWatch, LoggedRig, field, number_of, raw_call
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stage_harness import StepStream, make_request

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb

MAX_SEQ = 512  # the rig's runner: prompts over 512 x 32 bytes are malformed
SHM_RINGS = 8  # the default ports.hidden.maxShmSubscriptions
STAGE = "/llmstage.v1.Stage/"
ORCH = "/llmstage.v1.Orchestrator/"
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedRig]:
    r = LoggedRig(tmp_path_factory.mktemp("hostile"))
    yield r
    r.close()
    assert not r.error_lines(), r.error_lines()


@pytest.fixture
def watch(rig: LoggedRig) -> Iterator[HealthWatch]:
    """Health of both services checked for the whole test; both idle after it."""
    with HealthWatch(rig.runner.endpoint, rig.orch.target) as w:
        yield w
    rig.assert_idle()


def story(size: int) -> str:
    line = "Once upon a time, there was a little girl named Lily. She loved to play. "
    return (line * (size // len(line) + 1))[:size]


def admit(rig: LoggedRig, slot: int, **request: object) -> pb.AdmitResponse:
    return rig.stub.Admit(pb.AdmitRequest(slot_id=slot, request=make_request(**request)),
                          timeout=30)


def code_of(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


# ---- A: prompts a tokenizer on the event loop would freeze on ------------------------------
def test_megabyte_prompt_is_malformed_before_tokenizing(rig: LoggedRig, watch: HealthWatch
                                                        ) -> None:
    code, details = code_of(lambda: admit(rig, rig.slot(), text=story(1_000_000)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "maxPromptBytes" in details
    events = rig.orch.stub.Generate(opb.GenerateRequest(
        request=pb.GenerationRequest(text=story(1_000_000))), timeout=30)
    code, details = code_of(lambda: list(events))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "maxPromptBytes" in details


def test_long_prompts_tokenize_while_the_stage_answers(rig: LoggedRig, watch: HealthWatch
                                                       ) -> None:
    """Prompts just under the byte limit: tokenized (then too long for maxSeq), eight at
    once, and one 1 KB prompt admitted among them."""
    slots = [rig.slot() for _ in range(9)]
    with ThreadPoolExecutor(9) as pool:
        answers = list(pool.map(lambda s: admit(rig, s, text=story(
            1024 if s == slots[0] else MAX_SEQ * 32 - 8)), slots))
    assert answers[0].admitted and 0 < answers[0].prompt_tokens < MAX_SEQ
    for ans in answers[1:]:
        assert not ans.admitted and ans.refusal == pb.REFUSAL_PROMPT_TOO_LONG, ans
    assert rig.stub.Reset(pb.ResetRequest(slot_id=slots[0])).existed


def test_racing_admits_of_one_slot_admit_once(rig: LoggedRig, watch: HealthWatch) -> None:
    slot = rig.slot()
    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(lambda _: code_of(lambda: admit(rig, slot, text=story(1200))),
                                 range(6)))
    codes = sorted(c.name for c, _ in outcomes)
    assert codes == ["FAILED_PRECONDITION"] * 5 + ["OK"], outcomes
    assert rig.stub.Reset(pb.ResetRequest(slot_id=slot)).existed


# ---- B: request bytes that do not decode --------------------------------------------------
def generation(name: str, raw: bytes, **valid: object) -> bytes:
    """A GenerationRequest's bytes with field `name` set to `raw` (after the valid fields)."""
    return make_request(**valid).SerializeToString() + field(
        number_of(pb.GenerationRequest, name), raw)


def admit_bytes(slot: int, request: bytes, traceparent: bytes = b"") -> bytes:
    return (pb.AdmitRequest(slot_id=slot).SerializeToString() + field(2, request)
            + (field(3, traceparent) if traceparent else b""))


def chat_bytes(content: bytes) -> bytes:
    turn = field(1, b"user") + field(2, content)
    return field(number_of(pb.GenerationRequest, "messages"), field(1, turn))


def bad_cases(slot: int) -> list[tuple[str, bytes, bool, str]]:
    """(method, request bytes, is its answer a stream, field the error must name)."""
    bad = LONE_SURROGATE
    gen = {"text": "Once"}
    return [
        (STAGE + "Admit", admit_bytes(slot, generation("text", b"ab" + bad)), False,
         "request.text"),
        (STAGE + "Admit", admit_bytes(slot, generation("request_id", bad, **gen)), False,
         "request.request_id"),
        (STAGE + "Admit", admit_bytes(slot, generation("stop", b"\xff", **gen)), False,
         "request.stop"),
        (STAGE + "Admit", admit_bytes(slot, generation("lora", bad, **gen)), False,
         "request.lora"),
        (STAGE + "Admit", admit_bytes(slot, generation("ports", bad, **gen)), False,
         "request.ports"),
        (STAGE + "Admit", admit_bytes(slot, make_request(**gen).SerializeToString(), bad),
         False, "traceparent"),
        (STAGE + "Admit", admit_bytes(slot, chat_bytes(b"hi " + bad)), False,
         "request.messages.messages.content"),
        (STAGE + "Admit", b"\x12\xff\xff", False, ""),  # a length past the end
        (STAGE + "Subscribe", field(1, bad) + field(3, b"hidden"), True, "request_id"),
        (STAGE + "Subscribe", field(1, b"r1") + field(3, b"\xc3"), True, "port"),
        (ORCH + "Generate", field(1, generation("text", bad)), True, "request.text"),
        (ORCH + "Generate", field(1, make_request(**gen).SerializeToString()) + field(2, bad),
         True, "sinks"),
        (ORCH + "Cancel", field(1, bad), False, "request_id"),
    ]


def test_undecodable_requests_are_invalid_argument(rig: LoggedRig, watch: HealthWatch) -> None:
    for method, body, is_stream, name in bad_cases(rig.slot()):
        channel = rig.orch.channel if method.startswith(ORCH) else rig.runner.channel
        err = raw_call(channel, method, body, is_stream)
        assert isinstance(err, grpc.RpcError), (method, name, err)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, name, err.details())
        assert f"field {name!r}" in (err.details() or "") if name else "malformed" in (
            err.details() or ""), err.details()
    step = rig.runner.channel.stream_stream(STAGE + "Step")(iter([b"\x0a\xff"]), timeout=10)
    code, details = code_of(lambda: next(step))  # join's length runs past the end
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "StepRequest" in details, details
    assert not rig.error_lines()


def admit_with(slot: int, name: str, raw: bytes) -> tuple[bytes, str]:
    """Admit bytes with string field `name` holding `raw`, and that field's path."""
    if name == "traceparent":
        return admit_bytes(slot, make_request(text="Once", max_tokens=4).SerializeToString(),
                           raw), "traceparent"
    if name == "content":
        return admit_bytes(slot, chat_bytes(raw)), "request.messages.messages.content"
    valid = {} if name == "text" else {"text": "Once upon a time", "max_tokens": 4}
    return admit_bytes(slot, generation(name, raw, **valid)), f"request.{name}"


@FUZZ
@given(name=st.sampled_from(["text", "request_id", "stop", "lora", "ports", "traceparent",
                             "content"]), raw=st.binary(max_size=40))
def test_fuzzed_string_bytes_at_admit(rig: LoggedRig, watch: HealthWatch, name: str,
                                      raw: bytes) -> None:
    """Any bytes in a string field: INVALID_ARGUMENT naming it unless they are UTF-8, and
    then the answer of that string (admitted, refused, or malformed for a reason of its own)."""
    slot = rig.slot()
    body, path = admit_with(slot, name, raw)
    err = raw_call(rig.runner.channel, STAGE + "Admit", body, False)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"field {path!r}" in (err.details() or ""), err.details()
        return
    finally:
        rig.stub.Reset(pb.ResetRequest(slot_id=slot), timeout=10)
    if isinstance(err, grpc.RpcError):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "UTF-8" not in (err.details() or "")


@FUZZ
@given(raw=st.binary(max_size=40))
def test_fuzzed_bytes_at_subscribe(rig: LoggedRig, watch: HealthWatch, raw: bytes) -> None:
    """A Subscribe's request id of any bytes: subscribed when UTF-8 (then cancelled),
    INVALID_ARGUMENT naming it otherwise."""
    stream = rig.runner.channel.unary_stream(STAGE + "Subscribe")(
        field(1, raw) + field(3, b"hidden"), timeout=10)
    try:
        first = pb.SubscribeEvent.FromString(next(stream))
        raw.decode("utf-8")
        assert first.HasField("subscribed")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert raw == b"" or "field 'request_id'" in (err.details() or ""), err.details()
    finally:
        stream.cancel()


@FUZZ
@given(raw=st.binary(max_size=24), as_cancel=st.booleans())
def test_fuzzed_bytes_at_the_orchestrator(rig: LoggedRig, watch: HealthWatch, raw: bytes,
                                          as_cancel: bool) -> None:
    """Request ids of any bytes: Cancel of a UTF-8 one finds nothing, of any other is
    INVALID_ARGUMENT; Generate with such a text is served or INVALID_ARGUMENT."""
    try:
        raw.decode("utf-8")
        is_utf8 = True
    except UnicodeDecodeError:
        is_utf8 = False
    if as_cancel:
        ans = raw_call(rig.orch.channel, ORCH + "Cancel", field(1, raw), False)
        if is_utf8:
            assert opb.CancelGenerateResponse.FromString(ans).found is False
        else:
            assert isinstance(ans, grpc.RpcError), ans
            assert ans.code() == grpc.StatusCode.INVALID_ARGUMENT, ans.details()
        return
    body = field(1, generation("text", raw, max_tokens=2))
    try:
        answers = list(rig.orch.channel.unary_stream(ORCH + "Generate")(body, timeout=30))
        assert answers and is_utf8
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert is_utf8 or "not valid UTF-8" in (err.details() or "")


# ---- C: requests and subscriptions that would exhaust the stage ----------------------------
@pytest.mark.parametrize("request_kw,refusal,key", [
    (dict(text="Hi", stop=[f"stop-{i}" for i in range(300_000)]),
     pb.REFUSAL_SAMPLING_OUT_OF_RANGE, "maxStopStrings"),
    (dict(text="Hi", stop=["x" * 3000, "y" * 3000]), pb.REFUSAL_SAMPLING_OUT_OF_RANGE,
     "maxStopBytes"),
    (dict(text="Hi", logit_bias={i: 1.0 for i in range(5000)}),
     pb.REFUSAL_SAMPLING_OUT_OF_RANGE, "maxLogitBias"),
    (dict(messages=[("user", "hi")] * 300), pb.REFUSAL_PROMPT_TOO_LONG, "maxMessages"),
    (dict(text="Hi", media=[pb.MediaPart(mime_type="image/png")] * 40),
     pb.REFUSAL_MEDIA_UNSUPPORTED, "maxMediaParts"),
    (dict(token_ids=[5] * 2_000_000), pb.REFUSAL_PROMPT_TOO_LONG, "maxSeq"),
], ids=["stop_strings", "stop_bytes", "logit_bias", "messages", "media", "token_ids"])
def test_oversized_requests_are_refused_at_admit(rig: LoggedRig, watch: HealthWatch,
                                                 request_kw: dict, refusal: int,
                                                 key: str) -> None:
    ans = admit(rig, rig.slot(), **request_kw)
    assert not ans.admitted and ans.refusal == refusal and key in ans.reason, ans


def test_overlong_request_id_is_invalid_argument(rig: LoggedRig, watch: HealthWatch) -> None:
    code, details = code_of(lambda: admit(rig, rig.slot(), text="Hi", request_id="r" * 300))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "maxRequestIdBytes" in details


def test_shared_memory_subscriptions_stop_at_the_stage_limit(rig: LoggedRig,
                                                             watch: HealthWatch) -> None:
    """64 subscriptions to request ids that will never exist: SHM_RINGS get a ring, every
    other one RESOURCE_EXHAUSTED; /dev/shm holds exactly those rings, and none once they go."""
    streams, regions, refused = [], [], []
    for i in range(64):
        stream = rig.stub.Subscribe(pb.SubscribeRequest(
            request_id=f"ghost-{i}", port="hidden", transport=pb.TRANSPORT_SHARED_MEMORY),
            timeout=60)
        streams.append(stream)
        try:
            assert next(stream).HasField("subscribed")
            regions.append(next(stream).region)
        except grpc.RpcError as err:
            refused.append(err.code())
    try:
        assert len(regions) == SHM_RINGS
        assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (64 - SHM_RINGS)
        stats = rig.runner.stats()
        held = sum(Path("/dev/shm", r.name).stat().st_size for r in regions)
        # rings for requests that never started hold their header page, not their size
        assert all(Path("/dev/shm", r.name).stat().st_blocks * 512 <= 8192 for r in regions)
        assert stats["hidden_shm_rings"] == SHM_RINGS and stats["hidden_shm_bytes"] == held
        assert held <= SHM_RINGS * 2 * 2 * MAX_SEQ * 64 * 4 + SHM_RINGS * 4096  # width 64
    finally:
        for stream in streams:
            stream.cancel()
    rig.assert_idle()
    assert not any(Path("/dev/shm", r.name).exists() for r in regions)


def test_early_shared_memory_ring_is_faulted_in_when_its_request_comes(
        rig: LoggedRig, watch: HealthWatch) -> None:
    """A shared-memory subscription opened before its request: its ring takes its pages
    once the request is admitted, and every window then arrives through it."""
    sub = rig.stub.Subscribe(pb.SubscribeRequest(
        request_id="early-shm", port="hidden", transport=pb.TRANSPORT_SHARED_MEMORY), timeout=60)
    assert next(sub).HasField("subscribed")
    region = next(sub).region
    ring = Path("/dev/shm", region.name)
    assert ring.stat().st_blocks * 512 <= 8192
    sid = rig.admit_prepare("early-shm", ports=["hidden"], max_tokens=6, ignore_eos=True)
    deadline = time.monotonic() + 30
    while ring.stat().st_blocks * 512 < region.size - 8192 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring.stat().st_blocks * 512 >= region.size - 8192
    stream = StepStream(rig.stub, [sid], 16)
    assert len(stream.collect({sid})[sid]["tokens"]) == 6
    stream.half_close()
    rig.stub.Finish(pb.FinishRequest(slot_id=sid), timeout=10)
    rig.stub.Reset(pb.ResetRequest(slot_id=sid), timeout=10)
    events = list(sub)
    windows = [e.hidden for e in events if e.HasField("hidden")]
    assert len(windows) == 6 and events[-1].HasField("end")
    assert all(not w.states.data and w.states_shm.length > 0 for w in windows)
