"""The orchestrator and the gateway as two worker processes on one port (`--workers 2`): calls
over many connections land on both workers and all get their solo output; a Cancel reaching
the worker that does not hold the request is forwarded to the one that does; a port already
served by another group is refused; a worker that dies takes the group down with exit 1."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from deployment import Deployment, _start, collect, generate_request, terminate
from http_gateway import GatewayProc, joined, sse, wait_until

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

PROMPTS = ["Once upon a time", "The dog", "Lily and Ben", "One day"]
SLOW = {"LLM_RUNNER_FAULTS": json.dumps({"step_delay_ms": 20, "slow_prefix": "slow"})}


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(tmp_path_factory.mktemp("workers"), {"backbone": {"maxSeq": 512}},
                   env=SLOW, metrics=True, workers=2)
    yield d
    d.close()


def worker_metrics(line: str) -> list[str]:
    """Each worker's metrics URL, from the "[2 workers; metrics of each on ports ...]" note."""
    m = re.search(r"metrics of each on ports ([\d, ]+)\]", line)
    assert m is not None, line
    return [f"http://127.0.0.1:{p.strip()}/metrics" for p in m.group(1).split(",")]


def served(url: str) -> float:
    """Generate calls a worker has ended (its requests_total over every outcome)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmstage_orchestrator_requests_total{"))


def fresh_stub(target: str) -> tuple[grpc.Channel, orchestrator_pb2_grpc.OrchestratorStub]:
    """A stub on a connection of its own (channels of equal arguments would share one)."""
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, orchestrator_pb2_grpc.OrchestratorStub(channel)


def holder(dep: Deployment, request_id: str) -> int:
    """The index of the worker running `request_id` (its Topology counts the run)."""
    found: list[int] = []

    def check() -> bool:
        found[:] = [i for i, stub in enumerate(dep.worker_stubs)
                    if dep.topology(stub)["runs"] == 1]
        return len(found) == 1
    assert wait_until(check, 30), "no worker holds the request"
    return found[0]


def test_calls_over_many_connections_reach_both_workers_with_solo_output(dep) -> None:
    def request(i: int) -> opb.GenerateRequest:
        return generate_request(PROMPTS[i % 4], max_tokens=24, ignore_eos=True, seed=i % 4)

    solo = [collect(dep.worker_stubs[0].Generate(request(i), timeout=60))[1] for i in range(4)]
    before = [served(u) for u in worker_metrics(dep.line)]
    conns = [fresh_stub(dep.target) for _ in range(16)]
    try:
        with ThreadPoolExecutor(32) as pool:
            got = list(pool.map(lambda i: collect(conns[i % 16][1].Generate(request(i),
                                                                            timeout=60)),
                                range(64)))
    finally:
        for channel, _ in conns:
            channel.close()
    for i, (tokens, text, final) in enumerate(got):
        assert final is not None and final.finish_reason == pb.FINISH_REASON_MAX_LENGTH
        assert len(tokens) == 24 and text == solo[i % 4], i
    counts: list[float] = []

    def all_counted() -> bool:  # a worker counts a call just after its final event
        counts[:] = [served(u) - b for u, b in zip(worker_metrics(dep.line), before,
                                                    strict=True)]
        return sum(counts) == 64
    assert wait_until(all_counted, 30), counts
    assert min(counts) > 0, counts  # 16 connections: both workers served


def test_a_cancel_on_the_other_worker_ends_the_request(dep) -> None:
    call = dep.stub.Generate(generate_request("Once upon a time", max_tokens=400,
                                              ignore_eos=True, request_id="slow-other"),
                             timeout=60)
    events = iter(call)
    assert next(events).HasField("delta")
    other = dep.worker_stubs[1 - holder(dep, "slow-other")]
    t0 = time.monotonic()
    assert other.Cancel(opb.CancelGenerateRequest(request_id="slow-other"), timeout=10).found
    tokens, _, final = collect(events)
    assert final is not None and final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert len(tokens) < 399 and time.monotonic() - t0 < 10
    stage = dep.all_stages[0]

    def is_idle() -> bool:  # each worker keeps its own Step stream (cohort) open
        s = stage.stats()
        return s["slots"] == 0 and s["kv_pages_free"] == s["kv_pages_total"]
    assert wait_until(is_idle, 10), stage.stats()
    assert all(dep.topology(s)["runs"] == 0 for s in dep.worker_stubs)


def test_a_cancel_on_any_fresh_connection_finds_the_request(dep) -> None:
    for n in range(4):  # each Cancel on its own connection: either worker answers it
        rid = f"slow-fresh-{n}"
        call = dep.stub.Generate(generate_request("The dog", max_tokens=400, ignore_eos=True,
                                                  request_id=rid), timeout=60)
        events = iter(call)
        assert next(events).HasField("delta")
        channel, stub = fresh_stub(dep.target)
        with channel:
            assert stub.Cancel(opb.CancelGenerateRequest(request_id=rid), timeout=10).found
        assert collect(events)[2].finish_reason == pb.FINISH_REASON_CANCELLED
    channel, stub = fresh_stub(dep.target)
    with channel:  # held by no worker: forwarded once, found nowhere
        assert not stub.Cancel(opb.CancelGenerateRequest(request_id="nobody"), timeout=10).found


def test_the_gateway_with_two_workers_streams_completions(dep) -> None:
    gw = GatewayProc(dep.target, "--workers", "2", "--orchestrator-channels", "8")
    try:
        body = {"model": "backbone", "prompt": "Once upon a time", "max_tokens": 20,
                "temperature": 0}
        before = [served(u) for u in worker_metrics(dep.line)]
        with ThreadPoolExecutor(8) as pool:  # a connection each: both gateway workers serve
            got = list(pool.map(lambda _: sse(f"{gw.url}/v1/completions", body), range(32)))
        texts = {joined(events) for _, events in got}
        assert all(status == 200 and events[-1] == "[DONE]" for status, events in got)
        assert len(texts) == 1 and texts.pop()
        counts: list[float] = []

        def all_counted() -> bool:
            counts[:] = [served(u) - b for u, b in zip(worker_metrics(dep.line), before,
                                                        strict=True)]
            return sum(counts) == 32
        assert wait_until(all_counted, 30), counts
        assert min(counts) > 0, counts  # 8 channels a gateway worker: both workers served
    finally:
        gw.stop()
    assert gw.proc.returncode == 0


def test_a_port_served_by_workers_is_refused_to_another_group(dep) -> None:
    port = dep.target.rsplit(":", 1)[1]
    done = subprocess.run([sys.executable, "-m", "services.orchestrator", "--topology",
                           "/nonexistent.json", "--port", port, "--workers", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2  # the topology is checked first: one line
    assert done.stderr.count("\n") == 1 and "does not exist" in done.stderr
    topology = next(Path(p) for p in dep.proc.args if str(p).endswith("topology.json"))
    for module in ("services.orchestrator", "services.gateway"):
        args = ["--topology", str(topology)] if module == "services.orchestrator" else []
        done = subprocess.run([sys.executable, "-m", module, *args, "--port", port,
                               "--workers", "2"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (module, done.stderr)
        assert done.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" \
            in done.stderr, done.stderr


def test_a_worker_that_dies_stops_the_group_with_exit_1(dep) -> None:
    topology = next(str(p) for p in dep.proc.args if str(p).endswith("topology.json"))
    proc, _, _ = _start(["-m", "services.orchestrator", "--topology", topology,
                              "--port", "0", "--workers", "2"], r"listening on [\d.]+:(\d+)")
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 2
        subprocess.run(["kill", "-KILL", children[0]], check=True)
        assert proc.wait(60) == 1
        assert not Path(f"/proc/{children[1]}").exists() or \
            "zombie" in Path(f"/proc/{children[1]}/status").read_text()
    finally:
        terminate(proc)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
