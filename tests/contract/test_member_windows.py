"""Readers' credits hold their own members, never the rest of the stage: a member whose own
window (StepRequest.member_credits) or whose Step stream is out of credit takes no step while
other members keep decoding, and it resumes with no token lost or repeated."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from stage_harness import StageServer, StepStream

from llm_runner_svc.stage import StageConfig
from services.contract.llmstage.v1 import stage_pb2 as pb

SLOW = dict(text="Once upon a time", max_tokens=120, ignore_eos=True, seed=5, temperature=0.8)
FAST = dict(text="The dog", max_tokens=40, ignore_eos=True, seed=6, temperature=0.8)


def solo(server: StageServer, slot_id: int, request: dict[str, Any]) -> list[int]:
    server.admit_prepare(slot_id, **request)
    out = server.step([slot_id], credits=64).collect({slot_id})
    server.stub.Finish(pb.FinishRequest(slot_id=slot_id))
    server.stub.Reset(pb.ResetRequest(slot_id=slot_id))
    return out[slot_id]["tokens"]


def running(server: StageServer) -> int:
    """Runs the runtime holds (a held member counts; one that ended does not)."""
    return int(server.stats()["running"])


def test_a_member_out_of_its_own_window_waits_while_its_stream_mate_decodes(
        server: StageServer) -> None:
    want_slow, want_fast = solo(server, 90, SLOW), solo(server, 91, FAST)
    server.admit_prepare(1, **SLOW)
    server.admit_prepare(2, **FAST)
    # Slot 1 may receive two events with tokens; slot 2 only the stream's window.
    stream = StepStream(server.stub, [1, 2], 64, member_credits={1: 2})
    slow: list[int] = []
    fast: list[int] = []
    while len(fast) < len(want_fast):
        ev = stream.next()
        stream.send(credits=1)
        for m in ev.members:
            (slow if m.slot_id == 1 else fast).extend(m.token_ids)
    # Forty steps ran for slot 2; slot 1 took part in its two (plus, at most, one already
    # under way when its window emptied) and now waits, still running.
    assert fast == want_fast
    assert 2 <= len(slow) <= 3
    assert running(server) == 1
    stream.send(member_credits={1: 8})
    while len(slow) < len(want_slow):
        ev = stream.next()
        stream.send(credits=1, member_credits={1: 1})
        for m in ev.members:
            slow.extend(m.token_ids)
    assert slow == want_slow  # nothing lost or repeated across the hold
    for sid in (1, 2):
        assert server.stub.Finish(pb.FinishRequest(slot_id=sid)).finish_reason == \
            pb.FINISH_REASON_MAX_LENGTH
        server.stub.Reset(pb.ResetRequest(slot_id=sid))
    stream.half_close()
    assert server.wait_idle()["slots"] == 0


def test_a_stream_that_stops_reading_holds_only_its_own_members(server: StageServer) -> None:
    want_fast = solo(server, 91, FAST)
    server.admit_prepare(1, **SLOW)
    stalled = StepStream(server.stub, [1], 1)  # one credit, never read again
    first = stalled.next()
    assert [m.slot_id for m in first.members] == [1]
    server.admit_prepare(2, **FAST)
    out = server.step([2], credits=64).collect({2})
    assert out[2]["tokens"] == want_fast
    assert running(server) == 1  # slot 1 is held, not ended
    assert server.stub.Cancel(pb.CancelRequest(slot_id=1)).was_running
    server.stub.Finish(pb.FinishRequest(slot_id=2))
    server.stub.Reset(pb.ResetRequest(slot_id=2))
    deadline = time.monotonic() + 10.0  # the cancel lands although nobody reads the stream
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert running(server) == 0
    stalled.cancel()  # a broken stream leaves its ended member for Finish, as any stream
    finished = server.stub.Finish(pb.FinishRequest(slot_id=1))
    assert finished.finish_reason == pb.FINISH_REASON_CANCELLED
    server.stub.Reset(pb.ResetRequest(slot_id=1))
    idle = server.wait_idle()
    assert idle["slots"] == 0 and idle["kv_pages_free"] == idle["kv_pages_total"]


def test_a_stream_that_grants_no_credit_for_the_idle_timeout_is_ended() -> None:
    config = StageConfig(max_seq=512, credit_idle_timeout_s=0.3)
    with StageServer(config) as srv:
        srv.admit_prepare(1, **SLOW)
        stalled = StepStream(srv.stub, [1], 1)
        stalled.next()  # the one credit spent; the client grants no more
        with pytest.raises(grpc.RpcError) as err:
            stalled.next()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "creditIdleTimeoutS" in err.value.details()
        idle = srv.wait_idle()  # its member was cancelled and freed
        assert idle["slots"] == 0 and idle["kv_pages_free"] == idle["kv_pages_total"]
