"""Cancel lands within one step; a broken Step stream frees the slots of its members still
running, and members that had ended wait for Finish (the slot TTL frees them otherwise)."""

from __future__ import annotations

import time

import grpc
import pytest
from helpers import solo
from stage_harness import StageServer

from llm_runner_svc.models import Model
from services.contract.llmstage.v1 import stage_pb2 as pb

SPECS = {
    10: dict(text="Once upon a time", temperature=0.0, max_tokens=60),
    11: dict(text="The cat sat", temperature=0.8, seed=21, max_tokens=60, ignore_eos=True),
    12: dict(text="One day", temperature=0.7, seed=3, max_tokens=50),
    13: dict(text="Tom", temperature=1.0, seed=8, max_tokens=45),
}


def test_cancel_mid_stream_lands_within_one_step(server: StageServer, stories: Model) -> None:
    idle = server.wait_idle()
    for sid, spec in SPECS.items():
        server.admit_prepare(sid, **spec)
    stream = server.step(list(SPECS), credits=2)
    got = {sid: {"tokens": [], "text": ""} for sid in SPECS}
    live = set(SPECS)
    for _ in range(5):
        ev = stream.next()
        stream.send(credits=1)
        for m in ev.members:
            got[m.slot_id]["tokens"] += m.token_ids
            got[m.slot_id]["text"] += m.text
            if m.status == pb.MEMBER_STATUS_ENDED:
                live.discard(m.slot_id)
    ans = server.stub.Cancel(pb.CancelRequest(slot_id=11))
    assert ans.was_running and ans.state == pb.SLOT_STATE_RUNNING
    step_at_cancel = server.stats()["steps"]
    late_tokens, end_step, rest = 0, None, {sid: {"tokens": [], "text": ""} for sid in SPECS}
    while live:
        ev = stream.next()
        stream.send(credits=1)
        for m in ev.members:
            rest[m.slot_id]["tokens"] += m.token_ids
            rest[m.slot_id]["text"] += m.text
            if m.slot_id == 11 and ev.step > step_at_cancel:
                late_tokens += len(m.token_ids)
            if m.status == pb.MEMBER_STATUS_ENDED:
                live.discard(m.slot_id)
                if m.slot_id == 11:
                    assert m.finish_reason == pb.FINISH_REASON_CANCELLED
                    end_step = ev.step
    # at most one step was in flight when the cancel came; the next one ends the member
    assert end_step is not None and end_step <= step_at_cancel + 2
    assert late_tokens <= 1
    for sid in (10, 12, 13):
        tokens, text, _ = solo(stories, SPECS[sid])
        assert got[sid]["tokens"] + rest[sid]["tokens"] == tokens
        assert got[sid]["text"] + rest[sid]["text"] == text
    fin = server.stub.Finish(pb.FinishRequest(slot_id=11))
    assert fin.finish_reason == pb.FINISH_REASON_CANCELLED
    assert len(fin.output_token_ids) < 60
    assert server.stub.Cancel(pb.CancelRequest(slot_id=10)).was_running is False
    for sid in SPECS:
        if sid != 11:
            server.stub.Finish(pb.FinishRequest(slot_id=sid))
        server.stub.Reset(pb.ResetRequest(slot_id=sid))
    stream.half_close()
    assert server.wait_idle()["kv_pages_free"] == idle["kv_pages_total"]


def test_cancel_before_step(server: StageServer) -> None:
    server.admit_prepare(20, text="Hi", max_tokens=5)
    ans = server.stub.Cancel(pb.CancelRequest(slot_id=20))
    assert ans.was_running and ans.state == pb.SLOT_STATE_PREPARED
    with pytest.raises(grpc.RpcError) as err:
        server.step([20]).next()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cancelled" in err.value.details()
    fin = server.stub.Finish(pb.FinishRequest(slot_id=20))
    assert fin.finish_reason == pb.FINISH_REASON_CANCELLED and not fin.output_token_ids
    server.stub.Reset(pb.ResetRequest(slot_id=20))


def test_finish_on_a_running_member_stops_it(server: StageServer) -> None:
    server.admit_prepare(30, text="Once", max_tokens=200, ignore_eos=True)
    stream = server.step([30], credits=2)
    stream.next()
    fin = server.stub.Finish(pb.FinishRequest(slot_id=30, reason=pb.FINISH_REASON_ERROR))
    assert fin.finish_reason == pb.FINISH_REASON_ERROR and len(fin.output_token_ids) < 200
    rest = stream.collect({30})
    assert rest[30]["reason"] == pb.FINISH_REASON_CANCELLED  # what the stream saw
    server.stub.Reset(pb.ResetRequest(slot_id=30))
    stream.half_close()
    assert server.wait_idle()["slots"] == 0


def test_hundred_disconnects_leak_nothing(server: StageServer, stories: Model) -> None:
    idle = server.wait_idle()
    for i in range(100):
        a, b = 1000 + 2 * i, 1001 + 2 * i
        server.admit_prepare(a, text="Once upon a time", max_tokens=200, ignore_eos=True)
        server.admit_prepare(b, text="The dog", temperature=0.9, seed=i, max_tokens=200,
                             ignore_eos=True)
        if i % 2:
            stream = server.step([a, b], credits=2, timeout=0.2)
            with pytest.raises(grpc.RpcError) as err:
                while True:
                    stream.next()  # the window runs dry, then the deadline passes
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            stream = server.step([a, b], credits=2)
            stream.next()
            stream.cancel()
    stats = server.wait_idle()
    assert stats["slots"] == 0 and stats["cohorts"] == 0
    assert stats["kv_pages_free"] == idle["kv_pages_total"]
    assert stats["running"] == 0 and stats["waiting"] == 0
    # and the stage still serves
    server.admit_prepare(5000, **SPECS[10])
    stream = server.step([5000])
    assert stream.collect({5000})[5000]["tokens"] == solo(stories, SPECS[10])[0]
    server.stub.Finish(pb.FinishRequest(slot_id=5000))
    server.stub.Reset(pb.ResetRequest(slot_id=5000))
    stream.half_close()


def test_slow_reader_holds_its_member(server: StageServer, stories: Model) -> None:
    spec = dict(text="The dog", temperature=0.5, seed=4, max_tokens=100, ignore_eos=True)
    server.admit_prepare(40, **spec)
    steps0 = server.stats()["steps"]
    stream = server.step([40], credits=3)
    time.sleep(0.5)  # the reader takes nothing
    held = server.stats()["steps"] - steps0
    assert held <= 4  # three credits (plus at most one overdraw), not 100 steps
    got = stream.collect({40})
    assert got[40]["tokens"] == solo(stories, spec)[0]
    server.stub.Finish(pb.FinishRequest(slot_id=40))
    server.stub.Reset(pb.ResetRequest(slot_id=40))
    stream.half_close()


def test_window_beyond_the_limit_fails_the_stream(server: StageServer) -> None:
    limit = server.stub.Describe(pb.DescribeRequest()).max_step_window
    server.admit_prepare(50, text="Hi", max_tokens=200, ignore_eos=True)
    stream = server.step([50], credits=1)
    stream.send(credits=limit + 1)
    with pytest.raises(grpc.RpcError) as err:
        while True:
            stream.next()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(limit) in err.value.details()
    assert server.wait_idle()["slots"] == 0  # the broken stream freed its member



def test_finish_answers_every_member_of_a_stream_broken_after_their_ends(
        server: StageServer) -> None:
    # A client that read every member's end and then broke out of its Step stream still
    # finishes them: the break must not race their Finish.
    idle = server.wait_idle()
    for i in range(200):
        sids = [7000 + 3 * i + k for k in range(3)]
        for k, sid in enumerate(sids):
            server.admit_prepare(sid, text="Once upon a time", max_tokens=2 + k,
                                 ignore_eos=True)
        stream = server.step(sids, credits=16)
        got = stream.collect(set(sids))
        stream.cancel()
        for k, sid in enumerate(sids):
            fin = server.stub.Finish(pb.FinishRequest(slot_id=sid))
            assert fin.finish_reason == pb.FINISH_REASON_MAX_LENGTH, (i, sid)
            assert list(fin.output_token_ids) == got[sid]["tokens"] and \
                len(got[sid]["tokens"]) == 2 + k, (i, sid)
            assert server.stub.Reset(pb.ResetRequest(slot_id=sid)).existed
    stats = server.wait_idle()
    assert stats["slots"] == 0 and stats["cohorts"] == 0
    assert stats["kv_pages_free"] == idle["kv_pages_total"]


def test_ended_members_of_a_broken_stream_nobody_finishes_expire() -> None:
    with StageServer(slot_ttl_s=0.5) as srv:
        sids = [1, 2, 3]
        for sid in sids:
            srv.admit_prepare(sid, text="Once upon a time", max_tokens=3, ignore_eos=True)
        stream = srv.step(sids, credits=16)
        stream.collect(set(sids))
        stream.cancel()
        stats = srv.wait_idle(30.0)
        assert stats["slots"] == 0 and stats["cohorts"] == 0
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
        with pytest.raises(grpc.RpcError) as err:
            srv.stub.Finish(pb.FinishRequest(slot_id=1))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
