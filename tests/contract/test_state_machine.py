"""Every illegal call order is FAILED_PRECONDITION naming the state, and changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from stage_harness import StageServer, StepStream, make_request

from services.contract.llmstage.v1 import stage_pb2 as pb

LONG = dict(text="Once upon a time", max_tokens=200, ignore_eos=True)


def calls(srv: StageServer, sid: int) -> dict[str, Callable[[], object]]:
    s = srv.stub
    return {
        "Admit": lambda: s.Admit(pb.AdmitRequest(slot_id=sid, request=make_request(text="x"))),
        "Prepare": lambda: s.Prepare(pb.PrepareRequest(slot_id=sid)),
        "Step": lambda: StepStream(s, [sid], 1).next(),
        "Cancel": lambda: s.Cancel(pb.CancelRequest(slot_id=sid)),
        "Finish": lambda: s.Finish(pb.FinishRequest(slot_id=sid)),
        "Diagnostics": lambda: s.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)),
        "Reset": lambda: s.Reset(pb.ResetRequest(slot_id=sid)),
    }


def assert_refused(srv: StageServer, sid: int, illegal: list[str], state: str) -> None:
    for name in illegal:
        before = srv.stats()
        with pytest.raises(grpc.RpcError) as err:
            calls(srv, sid)[name]()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, name
        assert state in err.value.details(), (name, err.value.details())
        after = srv.stats()
        assert after["slots_by_state"] == before["slots_by_state"], name
        assert after["kv_pages_free"] == before["kv_pages_free"], name


def test_admitted(server: StageServer) -> None:
    assert server.admit(1, text="Hi").admitted
    assert_refused(server, 1, ["Admit", "Step", "Diagnostics"], "ADMITTED")
    assert server.stub.Reset(pb.ResetRequest(slot_id=1)).existed


def test_prepared(server: StageServer) -> None:
    server.admit_prepare(2, text="Hi")
    assert_refused(server, 2, ["Admit", "Prepare", "Diagnostics"], "PREPARED")
    assert server.stub.Reset(pb.ResetRequest(slot_id=2)).existed


def test_running_and_ended_before_finish(server: StageServer) -> None:
    server.admit_prepare(3, **LONG)
    stream = server.step([3], credits=1)  # the loop holds after one event: 3 stays RUNNING
    stream.next()
    assert_refused(server, 3, ["Admit", "Prepare", "Step", "Diagnostics", "Reset"], "RUNNING")
    stream.send(join=[3])  # a second join of a member is refused in-band
    server.stub.Cancel(pb.CancelRequest(slot_id=3))
    stream.send(credits=4)
    refused, ended = [], False
    while not (ended and refused):  # the refusal may ride on the end event or come after it
        ev = stream.next()
        refused += list(ev.refused)
        ended |= any(m.status == pb.MEMBER_STATUS_ENDED for m in ev.members)
    assert [(r.slot_id, r.code) for r in refused] == [(3, "FAILED_PRECONDITION")]
    assert "RUNNING" in refused[0].message
    # ended, not finished: still no Prepare/Step/Reset/Diagnostics
    assert_refused(server, 3, ["Prepare", "Step", "Diagnostics", "Reset"], "RUNNING")
    server.stub.Finish(pb.FinishRequest(slot_id=3))
    stream.half_close()
    assert_refused(server, 3, ["Admit", "Prepare", "Step", "Cancel", "Finish"], "FINISHED")
    assert server.stub.Diagnostics(pb.DiagnosticsRequest(slot_id=3)).values["finish_reason"] \
        == "cancelled"
    assert server.stub.Reset(pb.ResetRequest(slot_id=3)).existed
    assert not server.stub.Reset(pb.ResetRequest(slot_id=3)).existed  # idempotent


def test_mid_stream_join_of_an_unprepared_slot_is_refused_in_band(server: StageServer) -> None:
    server.admit_prepare(4, text="Once", max_tokens=30)
    assert server.admit(5, text="Hi").admitted  # ADMITTED, not PREPARED
    stream = server.step([4], credits=2)
    stream.send(join=[5, 77])
    got, refused = {}, []
    while 4 not in got:
        ev = stream.next()
        stream.send(credits=1)
        refused += [(r.slot_id, r.code) for r in ev.refused]
        got |= {m.slot_id: m for m in ev.members if m.status == pb.MEMBER_STATUS_ENDED}
    assert sorted(refused) == [(5, "FAILED_PRECONDITION"), (77, "NOT_FOUND")]
    assert set(got) == {4}  # the refused joins did not disturb the member
    stream.half_close()
    server.stub.Finish(pb.FinishRequest(slot_id=4))
    for sid in (4, 5):
        assert server.stub.Reset(pb.ResetRequest(slot_id=sid)).existed


def test_unknown_slot_is_not_found(server: StageServer) -> None:
    for name, call in calls(server, 424242).items():
        if name in ("Admit", "Reset"):
            continue
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, name
        assert "424242" in err.value.details()
    assert not server.stub.Reset(pb.ResetRequest(slot_id=424242)).existed


def test_first_join_is_all_or_nothing(server: StageServer) -> None:
    server.admit_prepare(6, text="Hi", max_tokens=3)
    assert server.admit(7, text="Hi").admitted
    before = server.stats()
    with pytest.raises(grpc.RpcError) as err:
        server.step([6, 7]).next()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert server.stats()["slots_by_state"] == before["slots_by_state"]  # 6 still PREPARED
    stream = server.step([6])
    assert stream.collect({6})[6]["reason"] == pb.FINISH_REASON_MAX_LENGTH
    stream.half_close()
    server.stub.Finish(pb.FinishRequest(slot_id=6))
    for sid in (6, 7):
        server.stub.Reset(pb.ResetRequest(slot_id=sid))
