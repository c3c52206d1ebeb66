"""The C++ reference talker (clients/cpp, `talker_stage`) as a real process, fed by a fake
thinker: a Python gRPC server implementing only Stage.Subscribe. Frames must equal the numpy
reference of every hidden message's last row; seq gaps, cancels and illegal calls behave as
the contract says; a broken Step stream frees its running members while its ended ones wait
for Finish; the slot TTL (--slot-ttl-s) frees slots nobody touches; SIGTERM exits 0."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stage_harness import StepStream
from talker_reference import codec_frame, start_talker, talker_binary

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc, tensor_pb2

HIDDEN = 64
DECODE_STEPS = 8
# Malformed hidden-state tensors a thinker might send, and what the talker must say about each.
BAD_TENSORS = {
    "rank3": lambda t: tensor_pb2.Tensor(dtype=t.dtype, shape=[*t.shape, 1], data=t.data),
    "short": lambda t: tensor_pb2.Tensor(dtype=t.dtype, shape=t.shape, data=t.data[:-4]),
    "int32": lambda t: tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT32, shape=t.shape,
                                         data=t.data),
    "negative": lambda t: tensor_pb2.Tensor(dtype=t.dtype, shape=[-1, HIDDEN], data=t.data),
    "wide": lambda t: tensor_pb2.Tensor(dtype=t.dtype, shape=[1, 1 << 20],
                                        data=bytes(4 << 20)),
}
BAD_TENSOR_ERRORS = {
    "rank3": "states has rank 3; [positions, hidden] expected",
    "short": "tensor data holds 252 bytes; its shape and dtype need 256",
    "int32": "tensor dtype DTYPE_INT32 is not a float type",
    "negative": "tensor shape has a negative extent -1",
    "wide": "exceeds the talker's limit",
}


class FakeThinker(stage_pb2_grpc.StageServicer):
    """Per request: a prefill window [5, 64], decode windows [1, 64], then end(MAX_LENGTH).
    Request ids starting "gap" skip seq 4; "slow" ones send 200 windows, 50 ms apart; those
    starting with a key of BAD_TENSORS send that malformed tensor as their third window."""

    def __init__(self) -> None:
        self.sent: dict[str, list[np.ndarray]] = {}
        self.cancelled: set[str] = set()  # requests whose subscriber left before their end

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext
                  ) -> Iterator[pb.SubscribeEvent]:
        rid = request.request_id
        assert request.port == "hidden" and request.transport == pb.TRANSPORT_GRPC_BYTES
        rng = np.random.default_rng(zlib.crc32(rid.encode()))
        is_slow = rid.startswith("slow")
        sent = self.sent.setdefault(rid, [])
        is_done = False

        def on_close() -> None:
            if not is_done:
                self.cancelled.add(rid)

        context.add_callback(on_close)
        yield pb.SubscribeEvent(subscribed=pb.Subscribed())  # registered, as a stage does
        seq, pos = 0, 0
        for i, n in enumerate([5] + [1] * (200 if is_slow else DECODE_STEPS)):
            if rid.startswith("gap") and i == 4:
                seq += 1
            states = rng.standard_normal((n, HIDDEN), dtype=np.float32)
            sent.append(states)
            tensor = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[n, HIDDEN],
                                       data=states.tobytes())
            bad = BAD_TENSORS.get(rid.split("-")[0])
            if bad is not None and i == 2:
                tensor = bad(tensor)
            yield pb.SubscribeEvent(request_id=rid, seq=seq, hidden=pb.HiddenStates(
                start_position=pos, token_ids=[1] * n, states=tensor, is_prefill=i == 0))
            seq, pos = seq + 1, pos + n
            if is_slow:
                time.sleep(0.05)
                if not context.is_active():
                    return
        is_done = True
        yield pb.SubscribeEvent(request_id=rid, seq=seq,
                                end=pb.PortEnd(finish_reason=pb.FINISH_REASON_MAX_LENGTH))


@pytest.fixture(scope="module")
def env() -> Iterator[SimpleNamespace]:
    fake = FakeThinker()
    server = grpc.server(futures.ThreadPoolExecutor(16))
    stage_pb2_grpc.add_StageServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proc, endpoint = start_talker()
    channel = grpc.insecure_channel(endpoint)
    yield SimpleNamespace(fake=fake, thinker=f"127.0.0.1:{port}", channel=channel,
                          stub=stage_pb2_grpc.StageStub(channel))
    channel.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    server.stop(0)


def admit_prepare(env: SimpleNamespace, slot: int, rid: str) -> None:
    ans = env.stub.Admit(pb.AdmitRequest(slot_id=slot, request=pb.GenerationRequest(
        request_id=rid, text="hello", ports=["audio"])))
    assert ans.admitted and ans.prompt_tokens == 0
    env.stub.Prepare(pb.PrepareRequest(slot_id=slot, inputs=[pb.InputBinding(
        input="thinker:hidden", endpoint=env.thinker, request_id=rid)]))


def test_describe(env: SimpleNamespace) -> None:
    d = env.stub.Describe(pb.DescribeRequest())
    assert (d.contract_version, d.stage_id, d.runner) == ("llmstage.v1", "talker", "talker.codec")
    assert [(p.name, p.dtype, p.width) for p in d.emits] == [("audio", tensor_pb2.DTYPE_INT32, 1)]
    assert list(d.inputs) == ["hidden"] and d.max_batch == 64 and d.max_step_window == 1024
    assert d.model.name == "codec-projection-2048"


def test_full_lifecycle_frames_match_the_reference(env: SimpleNamespace) -> None:
    admit_prepare(env, 1, "r-ok")
    stream = StepStream(env.stub, [1], 0)
    out = stream.collect({1})[1]
    stream.half_close()
    assert list(stream.call) == []  # no member left, client done: the stream ends OK
    sent = env.fake.sent["r-ok"]
    assert len(sent) == 1 + DECODE_STEPS and sent[0].shape == (5, HIDDEN)
    assert out["reason"] == pb.FINISH_REASON_MAX_LENGTH
    assert out["tokens"] == [codec_frame(s[-1]) for s in sent]
    fin = env.stub.Finish(pb.FinishRequest(slot_id=1))
    assert fin.finish_reason == pb.FINISH_REASON_MAX_LENGTH and not fin.error
    assert list(fin.output_token_ids) == out["tokens"]
    assert fin.metrics.generated_tokens == len(sent)
    diag = MessageToDict(env.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=1)).values)
    assert diag["frames"] == len(sent) == diag["hidden_messages"] and diag["seq_gaps"] == 0
    assert diag["last_seq"] == len(sent) and diag["finish_reason"] == "max_length"  # end's seq
    assert diag["subscribe_endpoint"] == env.thinker
    crc = 0
    for s in sent:
        crc = zlib.crc32(s.tobytes(), crc)
    assert int(diag["states_crc32"]) == crc
    assert env.stub.Reset(pb.ResetRequest(slot_id=1)).existed
    assert not env.stub.Reset(pb.ResetRequest(slot_id=1)).existed


def test_a_seq_gap_ends_the_member_with_an_error(env: SimpleNamespace) -> None:
    admit_prepare(env, 2, "gap-1")
    stream = StepStream(env.stub, [2], 0)
    out = stream.collect({2})[2]
    stream.half_close()
    assert out["reason"] == pb.FINISH_REASON_ERROR
    assert out["tokens"] == [codec_frame(s[-1]) for s in env.fake.sent["gap-1"][:4]]
    fin = env.stub.Finish(pb.FinishRequest(slot_id=2))
    assert fin.finish_reason == pb.FINISH_REASON_ERROR
    assert "hidden-state sequence gap: expected 4, got 5" in fin.error
    diag = MessageToDict(env.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=2)).values)
    assert diag["seq_gaps"] == 1 and diag["finish_reason"] == "error"
    env.stub.Reset(pb.ResetRequest(slot_id=2))


@pytest.mark.parametrize("kind", sorted(BAD_TENSORS))
def test_a_malformed_tensor_ends_the_member_with_an_error(env: SimpleNamespace,
                                                          kind: str) -> None:
    slot = 60 + sorted(BAD_TENSORS).index(kind)
    admit_prepare(env, slot, f"{kind}-1")
    stream = StepStream(env.stub, [slot], 0)
    out = stream.collect({slot})[slot]
    stream.half_close()
    assert out["reason"] == pb.FINISH_REASON_ERROR
    assert out["tokens"] == [codec_frame(s[-1]) for s in env.fake.sent[f"{kind}-1"][:2]]
    fin = env.stub.Finish(pb.FinishRequest(slot_id=slot))
    assert fin.finish_reason == pb.FINISH_REASON_ERROR
    assert "bad hidden states (seq 2)" in fin.error and BAD_TENSOR_ERRORS[kind] in fin.error
    env.stub.Reset(pb.ResetRequest(slot_id=slot))
    # the talker goes on serving
    admit_prepare(env, slot, f"r-after-{kind}")
    stream = StepStream(env.stub, [slot], 0)
    assert stream.collect({slot})[slot]["reason"] == pb.FINISH_REASON_MAX_LENGTH
    stream.half_close()
    env.stub.Finish(pb.FinishRequest(slot_id=slot))
    env.stub.Reset(pb.ResetRequest(slot_id=slot))


def test_cancel_mid_stream(env: SimpleNamespace) -> None:
    admit_prepare(env, 3, "slow-1")
    stream = StepStream(env.stub, [3], 0)
    first = stream.next()
    assert first.members[0].status == pb.MEMBER_STATUS_RUNNING and first.members[0].token_ids
    ans = env.stub.Cancel(pb.CancelRequest(slot_id=3))
    assert ans.state == pb.SLOT_STATE_RUNNING and ans.was_running
    rest = stream.collect({3})[3]
    stream.half_close()
    assert rest["reason"] == pb.FINISH_REASON_CANCELLED
    fin = env.stub.Finish(pb.FinishRequest(slot_id=3))
    assert fin.finish_reason == pb.FINISH_REASON_CANCELLED
    assert 0 < len(fin.output_token_ids) < 100
    assert list(fin.output_token_ids) == list(first.members[0].token_ids) + rest["tokens"]
    env.stub.Reset(pb.ResetRequest(slot_id=3))


def test_a_broken_step_stream_frees_its_running_members(env: SimpleNamespace) -> None:
    admit_prepare(env, 5, "slow-2")
    stream = StepStream(env.stub, [5], 0)
    stream.next()
    stream.cancel()
    deadline = time.monotonic() + 5
    while MessageToDict(env.stub.Diagnostics(pb.DiagnosticsRequest()).values)["slots"] and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as err:
        env.stub.Finish(pb.FinishRequest(slot_id=5))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def stage_stats(stub: stage_pb2_grpc.StageStub) -> dict[str, Any]:
    return MessageToDict(stub.Diagnostics(pb.DiagnosticsRequest(), timeout=10).values)


def is_idle(stub: stage_pb2_grpc.StageStub) -> bool:
    stats = stage_stats(stub)
    return stats["slots"] == 0 and stats["cohorts"] == 0


def wait_until(what: str, cond: Callable[[], bool], stub: stage_pb2_grpc.StageStub,
               timeout: float = 30.0) -> None:
    """Poll `cond`; on timeout, fail showing the stage-wide Diagnostics of `stub`."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {stage_stats(stub)}"
        time.sleep(0.02)


def test_finish_answers_every_member_of_a_stream_broken_after_their_ends(
        env: SimpleNamespace) -> None:
    # A client that read every member's end and then broke out of its Step stream still
    # finishes them: the break must not race their Finish.
    for i in range(50):
        sids = [7000 + 3 * i + k for k in range(3)]
        for sid in sids:
            admit_prepare(env, sid, f"r-break-{sid}")
        stream = StepStream(env.stub, sids, 16)
        got = stream.collect(set(sids))
        stream.cancel()
        for sid in sids:
            fin = env.stub.Finish(pb.FinishRequest(slot_id=sid), timeout=10)
            assert fin.finish_reason == pb.FINISH_REASON_MAX_LENGTH, (i, sid)
            sent = env.fake.sent[f"r-break-{sid}"]
            assert list(fin.output_token_ids) == got[sid]["tokens"] == \
                [codec_frame(s[-1]) for s in sent], (i, sid)
            assert env.stub.Reset(pb.ResetRequest(slot_id=sid)).existed
    wait_until("the talker to be idle", lambda: is_idle(env.stub), env.stub)


@pytest.fixture()
def short_ttl(env: SimpleNamespace) -> Iterator[SimpleNamespace]:
    proc, endpoint = start_talker(0, "--slot-ttl-s", "0.5")
    channel = grpc.insecure_channel(endpoint)
    yield SimpleNamespace(fake=env.fake, thinker=env.thinker,
                          stub=stage_pb2_grpc.StageStub(channel))
    channel.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_ended_members_of_a_broken_stream_nobody_finishes_expire(
        short_ttl: SimpleNamespace) -> None:
    sids = [1, 2, 3]
    for sid in sids:
        admit_prepare(short_ttl, sid, f"r-ttl-{sid}")
    stream = StepStream(short_ttl.stub, sids, 16)
    stream.collect(set(sids))
    stream.cancel()
    wait_until("the slots to expire", lambda: is_idle(short_ttl.stub), short_ttl.stub)
    for sid in sids:
        for call, req in ((short_ttl.stub.Finish, pb.FinishRequest(slot_id=sid)),
                          (short_ttl.stub.Diagnostics, pb.DiagnosticsRequest(slot_id=sid))):
            with pytest.raises(grpc.RpcError) as err:
                call(req)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_untouched_slots_expire_in_every_state_but_a_live_run(
        short_ttl: SimpleNamespace) -> None:
    stub = short_ttl.stub
    stub.Admit(pb.AdmitRequest(slot_id=10, request=pb.GenerationRequest(text="x")))
    admit_prepare(short_ttl, 11, "slow-ttl-prepared")
    stub.Admit(pb.AdmitRequest(slot_id=12, request=pb.GenerationRequest(text="x")))
    stub.Finish(pb.FinishRequest(slot_id=12))
    admit_prepare(short_ttl, 13, "slow-ttl-running")
    stream = StepStream(stub, [13], 0)
    started = time.monotonic()
    wait_until("the idle slots to expire",
               lambda: stage_stats(stub)["slots_by_state"] == {
                   "ADMITTED": 0, "PREPARED": 0, "RUNNING": 1, "FINISHED": 0}, stub)
    wait_until("the expired slot's subscription to be cancelled",
               lambda: "slow-ttl-prepared" in short_ttl.fake.cancelled, stub)
    # The running member outlives the TTL several times over while it streams.
    frames = 0
    while time.monotonic() - started < 4 * 0.5:
        ev = stream.next()
        stream.send(credits=1)
        assert [m.status for m in ev.members] == [pb.MEMBER_STATUS_RUNNING]
        frames += len(ev.members[0].token_ids)
    assert stage_stats(stub)["slots_by_state"]["RUNNING"] == 1
    fin = stub.Finish(pb.FinishRequest(slot_id=13), timeout=30)
    assert fin.finish_reason == pb.FINISH_REASON_CANCELLED and len(fin.output_token_ids) >= frames
    assert stub.Reset(pb.ResetRequest(slot_id=13)).existed
    stream.cancel()
    for sid in (10, 11, 12):
        with pytest.raises(grpc.RpcError) as err:
            stub.Diagnostics(pb.DiagnosticsRequest(slot_id=sid))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x", ""])
def test_a_bad_slot_ttl_is_a_usage_error(value: str) -> None:
    res = subprocess.run([str(talker_binary()), f"--slot-ttl-s={value}"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == "", res
    assert "--slot-ttl-s must be a positive number of seconds" in res.stderr, res.stderr


def test_help_documents_the_slot_ttl() -> None:
    res = subprocess.run([str(talker_binary()), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "--slot-ttl-s" in res.stdout and "600" in res.stdout


def test_illegal_calls(env: SimpleNamespace) -> None:
    def fails(code: grpc.StatusCode, fn, *args, match: str = "") -> None:
        with pytest.raises(grpc.RpcError) as err:
            fn(*args)
        assert err.value.code() == code and match in err.value.details(), err.value.details()

    fp, nf, inv = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                   grpc.StatusCode.INVALID_ARGUMENT)
    fails(nf, env.stub.Prepare, pb.PrepareRequest(slot_id=40))
    fails(inv, env.stub.Reset, pb.ResetRequest(slot_id=-1))
    env.stub.Admit(pb.AdmitRequest(slot_id=41, request=pb.GenerationRequest(text="x")))
    fails(fp, env.stub.Admit, pb.AdmitRequest(slot_id=41, request=pb.GenerationRequest(
        text="x")))
    fails(fp, env.stub.Diagnostics, pb.DiagnosticsRequest(slot_id=41), match="is ADMITTED")
    fails(inv, env.stub.Prepare, pb.PrepareRequest(slot_id=41, inputs=[pb.InputBinding(
        input="thinker:text", endpoint=env.thinker, request_id="x")]),
        match="the talker needs a hidden-state input binding")
    stream = StepStream(env.stub, [41], 0)
    fails(fp, stream.next, match="Step is not allowed: slot 41 is ADMITTED")
    stream.cancel()
    admit_prepare(env, 42, "r-illegal")
    fails(fp, env.stub.Prepare, pb.PrepareRequest(slot_id=42),
          match="Prepare is not allowed: slot 42 is PREPARED")
    stream = StepStream(env.stub, [42], 0)
    first = stream.next()
    fails(fp, env.stub.Reset, pb.ResetRequest(slot_id=42), match="slot 42 is RUNNING")
    stream.send(join=[41])  # a later join is refused in-band; the stream goes on
    # The fake thinker is fast: the first event may already end slot 42.
    refused = [(r.slot_id, r.code) for r in first.refused]
    is_ended = any(m.status == pb.MEMBER_STATUS_ENDED for m in first.members)
    while not (refused and is_ended):
        ev = stream.next()
        stream.send(credits=1)
        refused += [(r.slot_id, r.code) for r in ev.refused]
        is_ended |= any(m.status == pb.MEMBER_STATUS_ENDED for m in ev.members)
    assert refused == [(41, "FAILED_PRECONDITION")]
    stream.half_close()
    env.stub.Finish(pb.FinishRequest(slot_id=42))
    fails(fp, env.stub.Cancel, pb.CancelRequest(slot_id=42), match="slot 42 is FINISHED")
    for slot in (41, 42):
        assert env.stub.Reset(pb.ResetRequest(slot_id=slot)).existed


def test_health_and_sigterm_exit_zero() -> None:
    proc, endpoint = start_talker()
    with grpc.insecure_channel(endpoint) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "llmstage.v1.Stage"):
            ans = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert ans.status == health_pb2.HealthCheckResponse.SERVING
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_version_prints_the_projects_version() -> None:
    cmake = (Path(__file__).resolve().parents[2] / "clients/cpp/CMakeLists.txt").read_text()
    version = re.search(r"project\(llmstage_cpp VERSION ([\d.]+)", cmake)
    assert version
    res = subprocess.run([str(talker_binary()), "--version"], capture_output=True, text=True,
                         timeout=60)
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout == f"talker_stage {version.group(1)} (contract llmstage.v1)\n"
