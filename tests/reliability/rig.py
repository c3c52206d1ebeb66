"""The processes of the reliability suite: a runner with its fault hook on (LLM_RUNNER_FAULTS)
and the hidden port, an orchestrator over given stages, and the idle check over both."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
from accounting import (
    orchestrator_leftovers,
    orchestrator_state,
    runner_leftovers,
    stage_state,
    wait_for,
)
from deployment import StageProc
from stage_harness import make_request
from talker_reference import start_talker as start_talker  # used by test_faults

from services.contract.llmstage.v1 import orchestrator_pb2_grpc, stage_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

# Requests named "slow*" make every step they run in take 40 ms; "boom*" fail after 2 tokens.
FAULTS = {"step_delay_ms": 40, "slow_prefix": "slow", "error_prefix": "boom",
          "error_after_tokens": 2}
FAULT_ENV = {"LLM_RUNNER_FAULTS": json.dumps(FAULTS)}
# The embedded model with the hidden port declared, so Subscribe has something to serve.
RUNNER = {"maxSeq": 512, "emits": ["text", "tokens", "hidden"]}


def write_stage(tmp: Path, sid: str = "backbone", **cfg: Any) -> Path:
    path = tmp / f"{sid}.json"
    path.write_text(json.dumps({"stages": [{"id": sid, "runner": "llm.backbone",
                                            **RUNNER, **cfg}]}))
    return path


class Orchestrator:
    """A `python -m services.orchestrator` process over running stages: `stages` maps a
    stage id to its endpoints (a text stage), or give the topology's `stages` list whole."""

    def __init__(self, tmp: Path, stages: dict[str, list[str]] | list[dict[str, Any]],
                 grace_s: float = 10.0, stderr: Any = None, **topology: Any) -> None:
        if isinstance(stages, dict):
            topology.setdefault("sinks", [f"{sid}:text" for sid in stages])
            stages = [{"id": sid, "runner": "llm.backbone", "endpoints": eps,
                       "emits": ["text", "tokens"], "inputs": ["request:prompt"]}
                      for sid, eps in stages.items()]
        (tmp / "topology.json").write_text(json.dumps({"stages": stages, **topology}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.orchestrator", "--topology",
             str(tmp / "topology.json"), "--port", "0", "--metrics-port", "0",
             "--grace-s", str(grace_s)], stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (127\.0\.0\.1:\d+).*metrics on ([\d.]+:\d+)", line)
        assert m, f"orchestrator did not start: {line!r}"
        self.target, self.metrics_url = m.group(1), f"http://{m.group(2)}/metrics"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def state(self) -> dict[str, float]:
        return orchestrator_state(self.metrics_url, self.stub)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s (as a stage process)."""
        StageProc.stop(self)  # type: ignore[arg-type]


class Runner(StageProc):
    """A runner process on a given port (0 = any), so a killed one can come back there."""

    def __init__(self, config: Path, port: int = 0, env: dict[str, str] | None = None,
                 stderr: Any = None) -> None:
        """`stderr`: where its log goes (a file to read it back); default this process's."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llm_runner_svc", "serve", "--port", str(port),
             "--grace-s", "2", "--config", str(config)], stdout=subprocess.PIPE, stderr=stderr,
            text=True, env=os.environ | (env or FAULT_ENV))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
        assert m, f"runner did not start: {line!r}"
        self.endpoint = m.group(1)
        self.metrics_url = None
        self.channel = grpc.insecure_channel(self.endpoint)
        self.stub = stage_pb2_grpc.StageStub(self.channel)

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])


class Rig:
    """One faulty runner (with the hidden port) and an orchestrator over it."""

    def __init__(self, tmp: Path) -> None:
        self.runner = Runner(write_stage(tmp))
        self.orch = Orchestrator(tmp, {"backbone": [self.runner.endpoint]})
        self.stub = self.runner.stub
        self._next_slot = 0

    def slot(self) -> int:
        self._next_slot += 1
        return self._next_slot

    def admit_prepare(self, rid: str, **request: Any) -> int:
        """A new slot holding request `rid`, admitted and prepared on the runner."""
        sid = self.slot()
        ans = self.stub.Admit(pb.AdmitRequest(slot_id=sid, request=make_request(
            text=request.pop("text", "Once upon a time"), request_id=rid, **request)),
            timeout=10)
        assert ans.admitted, ans.reason
        self.stub.Prepare(pb.PrepareRequest(slot_id=sid), timeout=10)
        return sid

    def assert_idle(self) -> None:
        """Every counter of both services is back at its idle value, and the runner holds
        exactly the Step streams the orchestrator has open to it."""
        bad_orch = wait_for(self.orch.state, orchestrator_leftovers)
        assert not bad_orch, f"orchestrator not idle: {bad_orch}"
        streams = int(self.orch.state()["step_streams"])
        bad = wait_for(lambda: stage_state(self.stub),
                       lambda s: runner_leftovers(s, streams) or (
                           {"cohorts": s["cohorts"]} if s["cohorts"] != streams else {}))
        assert not bad, f"runner not idle ({streams} orchestrator streams): {bad}"

    def close(self) -> None:
        self.orch.stop()
        self.runner.stop()


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
