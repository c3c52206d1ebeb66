"""The illegal-call matrix: every slot call in every state a client can reach over the wire,
against both implementations of the Stage contract, the Python runner (`llm_runner_svc serve`)
and the C++ reference talker (`talker_stage`). The expected code of every cell comes from the
contract's state table (SPEC below, DESIGN.md section 3), never from running either one.

Each cell starts from a fresh slot brought to its state, makes one call, and cleans up. States
are held without timing: the runner keeps a member RUNNING on a Step stream whose one credit is
spent (a long request that ignores EOS); the talker keeps a member RUNNING while the thinker
request its hidden-state input is bound to has not started; a run that completed is read to its
ENDED update first. Waits poll Diagnostics against a deadline.
"""

from __future__ import annotations

import itertools
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from deployment import StageProc
from google.protobuf.json_format import MessageToDict
from stage_harness import StepStream, make_request
from talker_reference import start_talker

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc

C = grpc.StatusCode
OK, FP, NF, IA = C.OK, C.FAILED_PRECONDITION, C.NOT_FOUND, C.INVALID_ARGUMENT
# "Step" is a Step stream whose first message joins the slot (a refusal is the call's status);
# "Join" a later message of a running stream (a refusal comes in-band, as a JoinRefusal; a
# negative id fails the stream).
CALLS = ("Admit", "Prepare", "Step", "Join", "Cancel", "Finish", "Diagnostics", "Reset")
# The contract's table: state -> (the state a FAILED_PRECONDITION names, one code per call).
SPEC: dict[str, tuple[str, tuple[grpc.StatusCode, ...]]] = {
    "unknown": ("", (OK, NF, NF, NF, NF, NF, NF, OK)),
    "ADMITTED": ("ADMITTED", (FP, OK, FP, FP, OK, OK, FP, OK)),
    "PREPARED": ("PREPARED", (FP, FP, OK, OK, OK, OK, FP, OK)),
    "RUNNING": ("RUNNING", (FP, FP, FP, FP, OK, OK, FP, FP)),
    # the run ended before Finish: no Prepare or Step; Cancel is acknowledged
    "ended: cancelled while ADMITTED": ("ADMITTED", (FP, FP, FP, FP, OK, OK, FP, OK)),
    "ended: cancelled while PREPARED": ("PREPARED", (FP, FP, FP, FP, OK, OK, FP, OK)),
    "ended: RUNNING, run completed": ("RUNNING", (FP, FP, FP, FP, OK, OK, FP, FP)),
    "FINISHED": ("FINISHED", (FP, FP, FP, FP, FP, FP, OK, OK)),
    "after Reset": ("", (OK, NF, NF, NF, NF, NF, NF, OK)),
    "negative slot id": ("", (IA,) * len(CALLS)),
}
DEADLINE_S = 30.0


def wait_for(what: str, cond: Callable[[], Any]) -> Any:
    """Poll `cond` until it returns a true value; fail after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def stats(stub: stage_pb2_grpc.StageStub) -> dict[str, Any]:
    return MessageToDict(stub.Diagnostics(pb.DiagnosticsRequest(), timeout=10).values)


def num_running(stub: stage_pb2_grpc.StageStub) -> int:
    return int(stats(stub)["slots_by_state"]["RUNNING"])


@dataclass
class Cell:
    """One slot of one cell, the Step streams its state needs held open, and other slots
    the cell made (a host member for a mid-stream join)."""

    slot_id: int
    request_id: str
    streams: list[StepStream] = field(default_factory=list)
    others: list[Cell] = field(default_factory=list)


def read_refusals(call: Any, out: list[pb.JoinRefusal]) -> None:
    """Collect the join refusals a Step stream delivers, until it ends or breaks."""
    try:
        for event in call:
            out.extend(event.refused)
    except grpc.RpcError:
        pass


class Target:
    """One implementation under test: how it admits and prepares, and the seven calls."""

    name = ""

    def __init__(self, stub: stage_pb2_grpc.StageStub) -> None:
        self.stub = stub
        self._ids = itertools.count(1)

    def new_cell(self) -> Cell:
        sid = next(self._ids)
        return Cell(sid, f"{self.name}-{sid}")

    def request(self, cell: Cell, max_tokens: int) -> pb.GenerationRequest:
        raise NotImplementedError

    def prepare_request(self, cell: Cell) -> pb.PrepareRequest:
        raise NotImplementedError

    def complete_run(self, cell: Cell) -> None:
        """Make the RUNNING member of `cell` end on its own and read its ENDED update."""
        raise NotImplementedError

    # ---- bringing a fresh slot to a state ----------------------------------------------
    def admit(self, cell: Cell, max_tokens: int = 200) -> None:
        ans = self.stub.Admit(pb.AdmitRequest(slot_id=cell.slot_id,
                                              request=self.request(cell, max_tokens)))
        assert ans.admitted, ans.reason

    def run(self, cell: Cell, max_tokens: int = 200) -> None:
        """Admitted, prepared and RUNNING on a Step stream holding one credit."""
        self.admit(cell, max_tokens)
        self.stub.Prepare(self.prepare_request(cell))
        before = num_running(self.stub)
        cell.streams.append(StepStream(self.stub, [cell.slot_id], 1))
        wait_for("the member to run", lambda: num_running(self.stub) > before)

    def bring(self, state: str) -> Cell:
        cell = self.new_cell()
        sid = cell.slot_id
        if state == "negative slot id":
            cell.slot_id = -sid
        elif state == "ADMITTED":
            self.admit(cell)
        elif state == "PREPARED":
            self.admit(cell)
            self.stub.Prepare(self.prepare_request(cell))
        elif state == "RUNNING":
            self.run(cell)
        elif state == "ended: cancelled while ADMITTED":
            self.admit(cell)
            assert self.stub.Cancel(pb.CancelRequest(slot_id=sid)).was_running
        elif state == "ended: cancelled while PREPARED":
            self.admit(cell)
            self.stub.Prepare(self.prepare_request(cell))
            assert self.stub.Cancel(pb.CancelRequest(slot_id=sid)).was_running
        elif state == "ended: RUNNING, run completed":
            self.run(cell, max_tokens=2)
            self.complete_run(cell)
        elif state == "FINISHED":
            self.admit(cell)
            self.stub.Finish(pb.FinishRequest(slot_id=sid))
        elif state == "after Reset":
            self.admit(cell)
            assert self.stub.Reset(pb.ResetRequest(slot_id=sid)).existed
        else:
            assert state == "unknown", state
        return cell

    # ---- the calls -----------------------------------------------------------------------
    def step_join(self, cell: Cell) -> grpc.StatusCode:
        """A Step stream whose first message joins the slot: its status if the join was
        refused, OK once the slot runs."""
        before = num_running(self.stub)
        stream = StepStream(self.stub, [cell.slot_id], 1)
        cell.streams.append(stream)
        call = stream.call
        wait_for("the join to land or fail",
                 lambda: call.done() or num_running(self.stub) > before)
        if call.done():
            return call.code()
        return OK

    def set_up(self, name: str, cell: Cell) -> None:
        """What the call needs besides the slot: a Join needs a stream with a member RUNNING
        (a host slot of the cell)."""
        if name == "Join":
            host = self.new_cell()
            self.run(host)
            cell.others.append(host)

    def join_mid_stream(self, cell: Cell) -> tuple[grpc.StatusCode, str]:
        """A later message of the host's stream joins the slot: the refusal's code, the
        stream's status if it failed, or OK once the slot runs."""
        stream = cell.others[-1].streams[-1]
        refused: list[pb.JoinRefusal] = []
        threading.Thread(target=read_refusals, args=(stream.call, refused), daemon=True).start()
        before = num_running(self.stub)
        stream.send(join=[cell.slot_id], credits=1)
        call = stream.call
        wait_for("the join to land or be refused", lambda: refused or call.done()
                 or num_running(self.stub) > before)
        if refused:
            assert [r.slot_id for r in refused] == [cell.slot_id], refused
            return C[refused[0].code], refused[0].message
        if call.done():
            return call.code(), call.details()
        return OK, ""

    def call(self, name: str, cell: Cell) -> tuple[grpc.StatusCode, str]:
        sid, s = cell.slot_id, self.stub
        unary: dict[str, Callable[[], object]] = {
            "Admit": lambda: s.Admit(pb.AdmitRequest(slot_id=sid,
                                                     request=self.request(cell, 200))),
            "Prepare": lambda: s.Prepare(self.prepare_request(cell)),
            "Cancel": lambda: s.Cancel(pb.CancelRequest(slot_id=sid)),
            "Finish": lambda: s.Finish(pb.FinishRequest(slot_id=sid)),
            "Diagnostics": lambda: s.Diagnostics(pb.DiagnosticsRequest(slot_id=sid)),
            "Reset": lambda: s.Reset(pb.ResetRequest(slot_id=sid)),
        }
        if name == "Step":
            code = self.step_join(cell)
            return code, cell.streams[-1].call.details() if code != OK else ""
        if name == "Join":
            return self.join_mid_stream(cell)
        try:
            unary[name]()
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return OK, ""

    def clean(self, cell: Cell) -> None:
        """Finish the cell's slots while their streams are open, break the streams, drop the
        slots, wait for idle. Finish comes first so that no stream breaks under a member
        awaiting Finish."""
        cells = [cell, *cell.others]
        for c in cells:
            try:
                self.stub.Finish(pb.FinishRequest(slot_id=c.slot_id))
            except grpc.RpcError as exc:
                assert exc.code() in (FP, NF, IA), exc.details()
        for c in cells:
            for stream in c.streams:
                stream.cancel()
        for c in cells:
            if c.slot_id >= 0:
                wait_for(f"slot {c.slot_id} to be reset",
                         lambda sid=c.slot_id: self._reset(sid))
        wait_for(f"{self.name} to be idle", lambda: stats(self.stub)["slots"] == 0)

    def _reset(self, sid: int) -> bool:
        try:
            self.stub.Reset(pb.ResetRequest(slot_id=sid))
        except grpc.RpcError as exc:
            assert exc.code() == FP, exc.details()  # still RUNNING while its run winds down
            return False
        return True


class RunnerTarget(Target):
    name = "python"

    def request(self, cell: Cell, max_tokens: int) -> pb.GenerationRequest:
        return make_request(text="Once upon a time", max_tokens=max_tokens, ignore_eos=True,
                            request_id=cell.request_id)

    def prepare_request(self, cell: Cell) -> pb.PrepareRequest:
        return pb.PrepareRequest(slot_id=cell.slot_id)

    def complete_run(self, cell: Cell) -> None:
        stream = cell.streams[-1]
        stream.send(credits=16)
        stream.collect({cell.slot_id}, refill=False)


class TalkerTarget(Target):
    """The talker, its hidden-state input bound to the runner's hidden port. The thinker
    request a talker slot reads runs on the runner only when complete_run starts it."""

    name = "cpp"

    def __init__(self, stub: stage_pb2_grpc.StageStub, runner: StageProc) -> None:
        super().__init__(stub)
        self.runner = runner

    def request(self, cell: Cell, max_tokens: int) -> pb.GenerationRequest:
        return pb.GenerationRequest(request_id=cell.request_id, text="hello", ports=["audio"])

    def prepare_request(self, cell: Cell) -> pb.PrepareRequest:
        return pb.PrepareRequest(slot_id=cell.slot_id, inputs=[pb.InputBinding(
            input="thinker:hidden", endpoint=self.runner.endpoint, request_id=cell.request_id)])

    def complete_run(self, cell: Cell) -> None:
        thinker, sid = self.runner.stub, 1_000_000 + cell.slot_id
        ans = thinker.Admit(pb.AdmitRequest(slot_id=sid, request=make_request(
            text="Once upon a time", max_tokens=2, ignore_eos=True, request_id=cell.request_id,
            ports=["text", "hidden"])))
        assert ans.admitted, ans.reason
        thinker.Prepare(pb.PrepareRequest(slot_id=sid))
        stream = StepStream(thinker, [sid], 16)
        stream.collect({sid}, refill=False)
        stream.half_close()
        thinker.Finish(pb.FinishRequest(slot_id=sid))
        thinker.Reset(pb.ResetRequest(slot_id=sid))
        talker_stream = cell.streams[-1]
        talker_stream.send(credits=16)
        got = talker_stream.collect({cell.slot_id}, refill=False)[cell.slot_id]
        assert got["reason"] == pb.FINISH_REASON_MAX_LENGTH


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StageProc]:
    config = tmp_path_factory.mktemp("illegal") / "runner.json"
    config.write_text(json.dumps({"stages": [{
        "id": "thinker", "runner": "llm.backbone", "maxSeq": 512,
        "emits": ["text", "tokens", "hidden"]}]}))
    proc = StageProc(Path(config))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def targets(runner: StageProc) -> Iterator[list[Target]]:
    talker, endpoint = start_talker()
    channel = grpc.insecure_channel(endpoint)
    yield [RunnerTarget(runner.stub), TalkerTarget(stage_pb2_grpc.StageStub(channel), runner)]
    channel.close()
    talker.send_signal(signal.SIGTERM)
    assert talker.wait(10) == 0


def observe(target: Target, state: str) -> list[tuple[grpc.StatusCode, str]]:
    """Every call of CALLS, each on a fresh slot in `state`; an illegal one changes nothing."""
    out = []
    for name in CALLS:
        cell = target.bring(state)
        target.set_up(name, cell)
        before = stats(target.stub)["slots_by_state"]
        code, details = target.call(name, cell)
        if code != OK and not (name == "Join" and code == IA):  # that one fails the stream
            assert stats(target.stub)["slots_by_state"] == before, (target.name, state, name)
        out.append((code, details))
        target.clean(cell)
    return out


@pytest.mark.parametrize("state", list(SPEC))
def test_every_call_in_every_state(targets: list[Target], state: str) -> None:
    named, expected = SPEC[state]
    legal = {c for c, code in zip(CALLS, expected, strict=True) if code == OK} - {"Admit", "Join"}
    seen = {t.name: observe(t, state) for t in targets}
    codes = {name: tuple(code for code, _ in cells) for name, cells in seen.items()}
    assert codes["python"] == codes["cpp"], (state, codes)
    for name, cells in seen.items():
        got = dict(zip(CALLS, (code.name for code, _ in cells), strict=True))
        assert got == dict(zip(CALLS, (c.name for c in expected), strict=True)), (name, state)
        for call, (code, details) in zip(CALLS, cells, strict=True):
            if code == FP:
                named_call = "Step" if call == "Join" else call
                assert f" {named}" in details and named_call in details, (name, call, details)
            if code == FP and call != "Admit":  # the message lists what the state allows
                allowed = details.rsplit("allowed now: ", 1)[-1].split(", ")
                assert set(allowed) == legal, (name, call, details)
