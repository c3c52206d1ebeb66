"""Every ending of every call kind leaves nothing behind.

Endings: normal finish, client cancel, deadline, stage error (the runner's fault hook),
client disconnect. Call kinds: Generate (through the orchestrator), Step and Subscribe (on the
runner). After each, every counter of the runner and the orchestrator returns to idle. The
SIGTERM ending needs its own processes: test_shutdown.py.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from deployment import collect, generate_request
from rig import Rig
from stage_harness import StepStream

from llm_runner_svc.stage.faults import INJECTED_ERROR
from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb

LONG = dict(max_tokens=200, ignore_eos=True)  # with a "slow" id: 8 s, far past any wait here


def generate(rig: Rig, rid: str, timeout: float = 30, **sampling: Any) -> Any:
    return rig.orch.stub.Generate(generate_request("Once upon a time", request_id=rid,
                                                   **sampling), timeout=timeout)


def subscribe(rig: Rig, rid: str, timeout: float = 30) -> Any:
    """A subscription to `rid`'s hidden port, registered (its first event read)."""
    call = rig.stub.Subscribe(pb.SubscribeRequest(request_id=rid, port="hidden"),
                              timeout=timeout)
    assert next(call).HasField("subscribed")
    return call


def hidden_run(rig: Rig, rid: str, timeout: float = 30, **request: Any
               ) -> tuple[Any, int, StepStream]:
    """A subscription to `rid`, then `rid` admitted with the hidden port and stepping."""
    sub = subscribe(rig, rid, timeout)
    sid = rig.admit_prepare(rid, ports=["hidden"], **request)
    return sub, sid, StepStream(rig.stub, [sid], 16)


def finish_reset(rig: Rig, sid: int) -> pb.FinishResponse:
    fin = rig.stub.Finish(pb.FinishRequest(slot_id=sid), timeout=10)
    assert rig.stub.Reset(pb.ResetRequest(slot_id=sid), timeout=10).existed
    return fin


def port_messages(call: Any) -> tuple[int, pb.PortEnd]:
    """Hidden windows read from a per-request subscription, and its terminal message; the
    stream must complete right after it."""
    windows, end = 0, None
    for ev in call:
        assert end is None, "a message after the terminal one"
        if ev.HasField("hidden"):
            windows += 1
        elif ev.HasField("end"):
            end = ev.end
    assert end is not None
    return windows, end


def elapsed(t0: float) -> float:
    return time.monotonic() - t0


# ---- Generate ------------------------------------------------------------------------------
def test_generate_normal(rig: Rig) -> None:
    tokens, text, final = collect(generate(rig, "gen-normal", max_tokens=12, seed=1))
    assert final is not None and final.finish_reason in (pb.FINISH_REASON_MAX_LENGTH,
                                                         pb.FINISH_REASON_END_OF_SEQUENCE)
    assert final.usage.completion_tokens == len(tokens) > 0 and text
    rig.assert_idle()


def test_generate_client_cancel(rig: Rig) -> None:
    call = generate(rig, "slow-gen-cancel", **LONG)
    assert next(call).HasField("delta")
    t0 = time.monotonic()
    assert rig.orch.stub.Cancel(opb.CancelGenerateRequest(request_id="slow-gen-cancel"),
                                timeout=5).found
    rest = list(call)
    assert rest[-1].final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert elapsed(t0) < 3.0  # lands within a step, not after the 200 tokens
    rig.assert_idle()


def test_generate_deadline(rig: Rig) -> None:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        collect(generate(rig, "slow-gen-deadline", timeout=1.0, **LONG))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed(t0) < 3.0
    rig.assert_idle()


def test_generate_stage_error(rig: Rig) -> None:
    tokens, _, final = collect(generate(rig, "boom-gen", max_tokens=50, ignore_eos=True))
    assert final is not None and final.finish_reason == pb.FINISH_REASON_ERROR
    assert final.error == INJECTED_ERROR and len(tokens) == 2
    assert final.diagnostics["backbone"]["error"] == INJECTED_ERROR
    rig.assert_idle()


def test_generate_client_disconnect(rig: Rig) -> None:
    call = generate(rig, "slow-gen-gone", **LONG)
    assert next(call).HasField("delta")
    call.cancel()  # the client goes away without a word to the orchestrator
    rig.assert_idle()


# ---- Step ----------------------------------------------------------------------------------
def test_step_normal(rig: Rig) -> None:
    sid = rig.admit_prepare("step-normal", max_tokens=10, seed=2)
    stream = StepStream(rig.stub, [sid], 16)
    got = stream.collect({sid})[sid]
    stream.half_close()
    assert list(stream.call) == []  # the stream completes once the client is done
    assert finish_reset(rig, sid).finish_reason == got["reason"] != pb.FINISH_REASON_UNSPECIFIED
    rig.assert_idle()


def test_step_client_cancel(rig: Rig) -> None:
    sid = rig.admit_prepare("slow-step-cancel", **LONG)
    stream = StepStream(rig.stub, [sid], 16)
    stream.next()
    assert rig.stub.Cancel(pb.CancelRequest(slot_id=sid), timeout=5).was_running
    assert stream.collect({sid})[sid]["reason"] == pb.FINISH_REASON_CANCELLED
    stream.half_close()
    assert finish_reset(rig, sid).finish_reason == pb.FINISH_REASON_CANCELLED
    rig.assert_idle()


def test_step_deadline(rig: Rig) -> None:
    sid = rig.admit_prepare("slow-step-deadline", **LONG)
    stream = StepStream(rig.stub, [sid], 16, timeout=1.0)
    with pytest.raises(grpc.RpcError) as err:
        stream.collect({sid})
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream.half_close()
    rig.assert_idle()  # nobody calls Finish: the runner frees the slot itself
    with pytest.raises(grpc.RpcError) as gone:
        rig.stub.Finish(pb.FinishRequest(slot_id=sid), timeout=5)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_step_stage_error(rig: Rig) -> None:
    sid = rig.admit_prepare("boom-step", max_tokens=50, ignore_eos=True)
    stream = StepStream(rig.stub, [sid], 16)
    got = stream.collect({sid})[sid]
    stream.half_close()
    assert got["reason"] == pb.FINISH_REASON_ERROR and len(got["tokens"]) == 2
    fin = rig.stub.Finish(pb.FinishRequest(slot_id=sid), timeout=5)
    assert fin.finish_reason == pb.FINISH_REASON_ERROR and fin.error == INJECTED_ERROR
    assert rig.stub.Reset(pb.ResetRequest(slot_id=sid), timeout=5).existed
    rig.assert_idle()


def test_step_client_disconnect(rig: Rig) -> None:
    sid = rig.admit_prepare("slow-step-gone", **LONG)
    stream = StepStream(rig.stub, [sid], 16)
    stream.next()
    stream.cancel()
    rig.assert_idle()


# ---- Subscribe -----------------------------------------------------------------------------
def test_subscribe_normal(rig: Rig) -> None:
    sub, sid, stream = hidden_run(rig, "sub-normal", max_tokens=6, ignore_eos=True)
    assert len(stream.collect({sid})[sid]["tokens"]) == 6
    stream.half_close()
    finish_reset(rig, sid)
    windows, end = port_messages(sub)
    assert end.finish_reason == pb.FINISH_REASON_MAX_LENGTH
    assert windows == 1 + 5  # the prefill window, then one row per decode step that fed one
    rig.assert_idle()


def test_subscribe_client_cancel(rig: Rig) -> None:
    sub, sid, stream = hidden_run(rig, "slow-sub-cancel", **LONG)
    stream.next()
    rig.stub.Cancel(pb.CancelRequest(slot_id=sid), timeout=5)
    assert port_messages(sub)[1].finish_reason == pb.FINISH_REASON_CANCELLED
    stream.collect({sid})
    stream.half_close()
    finish_reset(rig, sid)
    rig.assert_idle()


def test_subscribe_cancel_before_the_run_starts(rig: Rig) -> None:
    """A subscriber that came early still gets its terminal message when the request is
    cancelled (or finished, or reset) before it ever joined a Step stream."""
    for ending in ("cancel", "finish", "reset"):
        rid = f"sub-early-{ending}"
        sub = subscribe(rig, rid, timeout=5)
        sid = rig.admit_prepare(rid, max_tokens=5, ports=["hidden"])
        if ending == "cancel":
            rig.stub.Cancel(pb.CancelRequest(slot_id=sid), timeout=5)
        if ending in ("cancel", "finish"):
            rig.stub.Finish(pb.FinishRequest(slot_id=sid), timeout=5)
        rig.stub.Reset(pb.ResetRequest(slot_id=sid), timeout=5)
        windows, end = port_messages(sub)
        assert (windows, end.finish_reason) == (0, pb.FINISH_REASON_CANCELLED), ending
    rig.assert_idle()


def test_subscribe_deadline(rig: Rig) -> None:
    sub, sid, stream = hidden_run(rig, "slow-sub-deadline", timeout=1.0, max_tokens=40,
                                  ignore_eos=True)
    with pytest.raises(grpc.RpcError) as err:
        port_messages(sub)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The run does not wait for the subscriber that went: all 40 tokens come.
    assert len(stream.collect({sid})[sid]["tokens"]) == 40
    stream.half_close()
    finish_reset(rig, sid)
    rig.assert_idle()


def test_subscribe_stage_error(rig: Rig) -> None:
    sub, sid, stream = hidden_run(rig, "boom-sub", max_tokens=50, ignore_eos=True)
    stream.collect({sid})
    stream.half_close()
    windows, end = port_messages(sub)
    assert end.finish_reason == pb.FINISH_REASON_ERROR and end.error == INJECTED_ERROR
    assert windows == 2  # prefill, then the row fed by the first token; then the failure
    finish_reset(rig, sid)
    rig.assert_idle()


def test_subscribe_client_disconnect(rig: Rig) -> None:
    sub, sid, stream = hidden_run(rig, "slow-sub-gone", max_tokens=30, ignore_eos=True)
    assert next(sub).HasField("hidden")
    sub.cancel()
    assert len(stream.collect({sid})[sid]["tokens"]) == 30  # the run goes on to its end
    stream.half_close()
    assert finish_reset(rig, sid).finish_reason == pb.FINISH_REASON_MAX_LENGTH
    rig.assert_idle()
