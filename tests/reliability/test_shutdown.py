"""The SIGTERM ending of each call kind: the server gets SIGTERM with a 2 s grace period while
one short and one long request are in flight. The short one ends normally inside the grace, the
long one is ended (never left hanging), new work is refused with UNAVAILABLE, the process exits
0, and a service that outlives the one stopped is back at idle."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from accounting import runner_leftovers, stage_state, wait_for
from deployment import collect, generate_request
from rig import Orchestrator, Runner, write_stage
from stage_harness import StepStream, make_request

from services.contract.llmstage.v1 import stage_pb2 as pb

GRACE_S = 2.0  # Runner serves with --grace-s 2
SHORT = dict(max_tokens=15, ignore_eos=True)  # "slow": 40 ms a step, well inside the grace
LONG = dict(max_tokens=300, ignore_eos=True)  # 12 s: only the grace's end stops it


def admit_prepare(stub: Any, sid: int, rid: str, **request: Any) -> None:
    ans = stub.Admit(pb.AdmitRequest(slot_id=sid, request=make_request(
        text="Once upon a time", request_id=rid, **request)), timeout=5)
    assert ans.admitted, ans.reason
    stub.Prepare(pb.PrepareRequest(slot_id=sid), timeout=5)


def in_thread(fn: Callable[[], Any]) -> Future:
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(fn)
    pool.shutdown(wait=False)
    return fut


def outcome(fn: Callable[[], Any]) -> tuple[str, Any, float]:
    """(status name or "OK", result or details, when it returned)."""
    try:
        result = fn()
        return "OK", result, time.monotonic()
    except grpc.RpcError as exc:
        return exc.code().name, exc.details(), time.monotonic()


def test_generate_sigterm_to_the_orchestrator(tmp_path: Path) -> None:
    runner = Runner(write_stage(tmp_path))
    orch = Orchestrator(tmp_path, {"backbone": [runner.endpoint]}, grace_s=GRACE_S)
    try:
        started = {"slow-short": threading.Event(), "slow-long": threading.Event()}

        def run(rid: str, sampling: dict[str, Any]) -> Future:
            def go() -> Any:
                call = orch.stub.Generate(generate_request("Once upon a time", request_id=rid,
                                                           **sampling), timeout=30)
                first = next(call)
                started[rid].set()
                return collect([first, *call])
            return in_thread(lambda: outcome(go))

        short, long = run("slow-short", SHORT), run("slow-long", LONG)
        assert all(e.wait(10) for e in started.values())
        t0 = time.monotonic()
        orch.proc.send_signal(signal.SIGTERM)
        status, out, _ = short.result(10)
        assert status == "OK" and out[2].finish_reason == pb.FINISH_REASON_MAX_LENGTH
        assert len(out[0]) == 15
        status, _, t_end = long.result(10)
        assert status in ("CANCELLED", "UNAVAILABLE")
        assert t_end - t0 < GRACE_S + 3.0
        assert orch.proc.wait(10) == 0
        # The runner outlives the orchestrator: nothing of its requests is left there.
        bad = wait_for(lambda: stage_state(runner.stub), runner_leftovers)
        assert not bad, bad
    finally:
        orch.stop()
        runner.stop()


def test_step_sigterm_to_the_runner(tmp_path: Path) -> None:
    runner = Runner(write_stage(tmp_path))
    try:
        stub = runner.stub
        admit_prepare(stub, 1, "slow-short", **SHORT)
        admit_prepare(stub, 2, "slow-long", **LONG)
        stream = StepStream(stub, [1, 2], 64)
        first = {m.slot_id: len(m.token_ids) for m in stream.next().members}
        t0 = time.monotonic()
        runner.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as refused:
            admit_prepare(stub, 3, "late", max_tokens=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in (refused.value.details() or "")
        got = stream.collect({1, 2})
        assert got[1]["reason"] == pb.FINISH_REASON_MAX_LENGTH
        assert first[1] + len(got[1]["tokens"]) == 15
        assert got[2]["reason"] == pb.FINISH_REASON_CANCELLED
        assert time.monotonic() - t0 < GRACE_S + 3.0
        assert runner.proc.wait(10) == 0
    finally:
        runner.stop()


def test_subscribe_sigterm_to_the_runner(tmp_path: Path) -> None:
    runner = Runner(write_stage(tmp_path))
    try:
        stub = runner.stub

        def read(request: pb.SubscribeRequest) -> Future:
            call = stub.Subscribe(request, timeout=30)
            assert next(call).HasField("subscribed")
            return in_thread(lambda: outcome(lambda: [ev for ev in call
                                                      if ev.HasField("end")]))

        running = read(pb.SubscribeRequest(request_id="slow-long", port="hidden"))
        never = read(pb.SubscribeRequest(request_id="never-started", port="hidden"))
        everything = read(pb.SubscribeRequest(all_requests=True, port="hidden"))
        admit_prepare(stub, 1, "slow-long", ports=["hidden"], **LONG)
        stream = StepStream(stub, [1], 64)
        stream.next()
        t0 = time.monotonic()
        runner.proc.send_signal(signal.SIGTERM)
        status, ends, _ = running.result(GRACE_S + 5)
        assert status == "OK" and [e.end.finish_reason for e in ends] == \
            [pb.FINISH_REASON_CANCELLED]
        for sub in (never, everything):
            status, _, t_end = sub.result(GRACE_S + 5)  # ended by the stop, not left open
            assert status in ("OK", "CANCELLED", "UNAVAILABLE")
            assert t_end - t0 < GRACE_S + 4.0
        assert stream.collect({1})[1]["reason"] == pb.FINISH_REASON_CANCELLED
        assert runner.proc.wait(10) == 0
    finally:
        runner.stop()
