"""Real local deployments for integration tests: `llm-runner serve` stage processes and a
`python -m services.orchestrator` process, all on loopback ports picked by the OS."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc, stage_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb


def _metrics(line: str) -> str | None:
    m = re.search(r"metrics on ([\d.]+:\d+)", line)
    return f"http://{m.group(1)}/metrics" if m else None


def _start(cmd: list[str], pattern: str, env: dict[str, str] | None = None,
           host: str = "127.0.0.1") -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, text=True,
                            env=os.environ | (env or {}))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(pattern, line)
    if m is None:
        proc.kill()
        raise RuntimeError(f"{cmd} did not start: {line!r}")
    return proc, f"{host}:{m.group(1)}", line


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM (the process drains), then SIGKILL if it is still there after 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class StageProc:
    def __init__(self, config: Path | None = None, env: dict[str, str] | None = None,
                 metrics: bool = False, host: str = "127.0.0.1", port: int = 0,
                 grace_s: float = 2.0) -> None:
        cmd = ["-m", "llm_runner_svc", "serve", "--host", host, "--port", str(port),
               "--grace-s", str(grace_s)]
        if config is not None:
            cmd += ["--config", str(config)]
        if metrics:
            cmd += ["--metrics-port", "0"]
        self.proc, self.endpoint, line = _start(cmd, rf"listening on {re.escape(host)}:(\d+)",
                                                env, host)
        self.metrics_url = _metrics(line)
        self.channel = grpc.insecure_channel(self.endpoint)
        self.stub = stage_pb2_grpc.StageStub(self.channel)

    def stats(self) -> dict[str, Any]:
        return MessageToDict(self.stub.Diagnostics(pb.DiagnosticsRequest(), timeout=5).values)

    def wait_idle(self, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["slots"] == 0 and s["kv_pages_free"] == s["kv_pages_total"]
                    and s["cohorts"] <= 1) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        self.channel.close()
        terminate(self.proc)


class Deployment:
    """Stage processes plus an orchestrator process over them."""

    def __init__(self, tmp: Path, stages: dict[str, dict[str, Any]] | None = None,
                 replicas: int = 1, env: dict[str, str] | None = None,
                 metrics: bool = False, workers: int = 1, **topology: Any) -> None:
        """`stages`: stage id -> stage config dict (a multistage_config stage entry); default
        one "backbone" stage serving the embedded model. `workers`: the orchestrator's worker
        processes; with more than one, `worker_stubs` reach each one's own socket."""
        stages = stages or {"backbone": {}}
        self.stage_procs: dict[str, list[StageProc]] = {}
        doc_stages = []
        for sid, cfg in stages.items():
            path = None
            if cfg:
                path = tmp / f"{sid}.json"
                path.write_text(json.dumps({"stages": [{"id": sid, "runner": "llm.backbone",
                                                        **cfg}]}))
            self.stage_procs[sid] = [StageProc(path, env, metrics) for _ in range(replicas)]
            doc_stages.append({"id": sid, "runner": "llm.backbone",
                               "endpoints": [p.endpoint for p in self.stage_procs[sid]],
                               "emits": ["text", "tokens"], "inputs": ["request:prompt"]})
        sinks = [f"{sid}:text" for sid in stages]
        doc = {"stages": doc_stages, "sinks": sinks, "defaultSinks": sinks, **topology}
        (tmp / "topology.json").write_text(json.dumps(doc))
        # A short directory: a unix socket's path has at most 107 bytes.
        self.socket_dir = tempfile.mkdtemp(prefix="orch-")
        self.proc, self.target, line = _start(
            ["-m", "services.orchestrator", "--topology", str(tmp / "topology.json"),
             "--port", "0", "--workers", str(workers), "--worker-socket-dir", self.socket_dir,
             *(["--metrics-port", "0"] if metrics else [])],
            r"listening on 127\.0\.0\.1:(\d+)", env)
        self.line = line
        self.metrics_url = _metrics(line)
        self.channel = grpc.insecure_channel(self.target)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.worker_channels = [grpc.insecure_channel(f"unix:{self.socket_dir}/worker-{i}.sock")
                                for i in range(workers if workers > 1 else 0)]
        self.worker_stubs = [orchestrator_pb2_grpc.OrchestratorStub(c)
                             for c in self.worker_channels]

    @property
    def all_stages(self) -> list[StageProc]:
        return [p for procs in self.stage_procs.values() for p in procs]

    def topology(self, stub: orchestrator_pb2_grpc.OrchestratorStub | None = None
                 ) -> dict[str, Any]:
        """The Topology answer of `stub` (default: whichever worker the port reaches)."""
        return MessageToDict((stub or self.stub).Topology(opb.TopologyRequest(), timeout=5),
                             always_print_fields_with_no_presence=True)

    def close(self) -> None:
        self.channel.close()
        for c in self.worker_channels:
            c.close()
        terminate(self.proc)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        for p in self.all_stages:
            p.stop()


def generate_request(text: str, **sampling: Any) -> opb.GenerateRequest:
    extra = {k: sampling.pop(k) for k in ("stop", "ignore_eos", "request_id") if k in sampling}
    return opb.GenerateRequest(request=pb.GenerationRequest(
        text=text, sampling=pb.SamplingOverrides(**sampling), **extra))


def collect(events: Any) -> tuple[list[int], str, opb.FinalReport | None]:
    tokens: list[int] = []
    text, final = "", None
    for ev in events:
        if ev.HasField("delta"):
            tokens += ev.delta.token_ids
            text += ev.delta.text
        else:
            final = ev.final
    return tokens, text, final
