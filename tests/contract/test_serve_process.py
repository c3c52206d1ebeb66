"""`python -m llm_runner_svc serve` as a real process: health, and the drain on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stage_harness import StepStream, make_request

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Proc:
    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "llm_runner_svc", "serve", "--port", "0",
                                   *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        line = self.p.stdout.readline()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert m, line + self.p.stderr.read()
        self.line = line
        self.channel = grpc.insecure_channel(f"127.0.0.1:{m.group(1)}")
        self.stub = stage_pb2_grpc.StageStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def status(self) -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service="llmstage.v1.Stage"),
                                 timeout=5).status

    def start_held_request(self, sid: int) -> StepStream:
        req = make_request(text="Once upon a time", max_tokens=150, ignore_eos=True)
        assert self.stub.Admit(pb.AdmitRequest(slot_id=sid, request=req)).admitted
        self.stub.Prepare(pb.PrepareRequest(slot_id=sid))
        stream = StepStream(self.stub, [sid], 1)
        stream.next()  # one event, then the loop holds for lack of credit
        return stream

    def wait_not_serving(self) -> None:
        deadline = time.monotonic() + 10
        while self.status() != NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def close(self) -> None:
        self.channel.close()
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


@pytest.fixture
def proc_factory() -> Iterator:
    procs: list[Proc] = []

    def make(*args: str) -> Proc:
        procs.append(Proc(*args))
        return procs[-1]

    yield make
    for p in procs:
        p.close()


def test_sigterm_lets_running_requests_finish(proc_factory) -> None:
    proc = proc_factory("--grace-s", "20")
    assert "stories260K" in proc.line and proc.status() == SERVING
    stream = proc.start_held_request(1)
    proc.p.send_signal(signal.SIGTERM)
    proc.wait_not_serving()
    with pytest.raises(grpc.RpcError) as err:
        proc.stub.Admit(pb.AdmitRequest(slot_id=2, request=make_request(text="Hi")))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    stream.send(credits=200)
    got = stream.collect({1}, refill=False)[1]
    assert got["reason"] == pb.FINISH_REASON_MAX_LENGTH and len(got["tokens"]) == 149
    fin = proc.stub.Finish(pb.FinishRequest(slot_id=1))
    assert fin.finish_reason == pb.FINISH_REASON_MAX_LENGTH and len(fin.output_token_ids) == 150
    proc.stub.Reset(pb.ResetRequest(slot_id=1))
    stream.half_close()
    assert proc.p.wait(15) == 0


def test_sigterm_cancels_what_outlives_the_grace(proc_factory) -> None:
    proc = proc_factory("--grace-s", "0.3")
    stream = proc.start_held_request(1)
    t0 = time.monotonic()
    proc.p.send_signal(signal.SIGTERM)
    got = stream.collect({1}, refill=False)[1]  # no credit granted: the cancel still lands
    assert got["reason"] == pb.FINISH_REASON_CANCELLED
    assert proc.p.wait(15) == 0
    assert time.monotonic() - t0 < 10


def test_serve_reads_a_stage_config(proc_factory, tmp_path: Path) -> None:
    cfg = tmp_path / "stages.json"
    cfg.write_text(json.dumps({"stages": [
        {"id": "thinker", "runner": "llm.backbone", "artifact": "stories260K", "maxBatch": 2,
         "maxSeq": 128, "emits": ["text", "tokens", "hidden"],
         "config": {"temperature": 0.0, "max_generate_length": 12}}]}))
    proc = proc_factory("--config", str(cfg))
    d = proc.stub.Describe(pb.DescribeRequest())
    assert (d.stage_id, d.max_batch, d.max_seq) == ("thinker", 2, 128)
    assert [p.name for p in d.emits] == ["text", "tokens", "hidden"] and d.emits[2].width == 64
    assert d.sampling_defaults.max_generate_length == 12


def test_bad_config_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "stages.json"
    spec = {"dspark_w2_backend": "x"}
    cfg.write_text(json.dumps({"stages": [{"id": "t", "runner": "llm.backbone",
                                           "config": {"spec_decode": spec}}]}))
    done = subprocess.run([sys.executable, "-m", "llm_runner_svc", "serve", "--config", str(cfg),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "UNIMPLEMENTED" in done.stderr and "config.spec_decode" in done.stderr
