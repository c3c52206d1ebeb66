"""A cluster's mechanics on loopback, with real processes: a DNS server answers a headless
name with one A record per runner (127.0.0.2, 127.0.0.3, ...; every runner on the same port),
two orchestrators discover the runners through it and find each other the same way."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from deployment import StageProc, _start, collect, generate_request, terminate
from dns_server import DnsServer
from google.protobuf.json_format import MessageToDict

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb

RUNNERS = "runners.test"
ORCHESTRATORS = "orchestrators.test"


def free_port(hosts: list[str]) -> int:
    """A port free on every one of `hosts` (the headless Service's one port)."""
    while True:
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Orch:
    def __init__(self, tmp: Path, host: str, port: int, dns: DnsServer, runner_port: int
                 ) -> None:
        topo = tmp / f"topology-{host}.json"
        topo.write_text(json.dumps({"stages": [{
            "id": "backbone", "runner": "llm.backbone", "emits": ["text", "tokens"],
            "discover": f"dns://127.0.0.1:{dns.port}/{RUNNERS}:{runner_port}"}]}))
        self.proc, self.target, _ = _start(
            ["-m", "services.orchestrator", "--topology", str(topo), "--host", host,
             "--port", str(port), "--discover-interval-s", "0.3",
             "--peers", f"dns://127.0.0.1:{dns.port}/{ORCHESTRATORS}:{port}"],
            rf"listening on {host}:(\d+)", host=host)
        self.channel = grpc.insecure_channel(self.target)
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    def topology(self) -> dict[str, Any]:
        return MessageToDict(self.stub.Topology(opb.TopologyRequest(), timeout=5),
                             always_print_fields_with_no_presence=True)

    def serving(self) -> set[str]:
        """Endpoints this orchestrator sends new requests to."""
        return {r["endpoint"] for r in self.topology()["stages"][0]["replicas"] if r["healthy"]}

    def close(self) -> None:
        self.channel.close()
        terminate(self.proc)


def run_many(orchs: list[Orch], num: int, max_tokens: int) -> list[tuple[str, Any]]:
    def one(i: int) -> tuple[str, Any]:
        call = orchs[i % len(orchs)].stub.Generate(generate_request(
            "Once upon a time", max_tokens=max_tokens, ignore_eos=True, seed=i), timeout=120)
        try:
            return "ok", collect(call)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()

    with ThreadPoolExecutor(num) as pool:
        return list(pool.map(one, range(num)))


def test_replicas_come_and_go_behind_a_dns_name(tmp: Path) -> None:
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = free_port(hosts)
    orch_hosts = ["127.0.0.20", "127.0.0.21"]
    orch_port = free_port(orch_hosts)
    config = tmp / "stage.json"
    config.write_text(json.dumps({"stages": [{"id": "backbone", "runner": "llm.backbone",
                                              "maxSeq": 512}]}))
    with DnsServer() as dns:
        runners = {h: StageProc(config, host=h, port=port, grace_s=60) for h in hosts}
        orchs: list[Orch] = []
        try:
            dns.set(RUNNERS, hosts[:2])
            dns.set(ORCHESTRATORS, orch_hosts)
            orchs = [Orch(tmp, h, orch_port, dns, port) for h in orch_hosts]
            two = {f"{h}:{port}" for h in hosts[:2]}
            for o in orchs:
                wait_for(lambda o=o: o.serving() == two, "both runners discovered")

            # (1) load spreads over the replicas
            results = run_many(orchs, 8, 24)
            assert all(status == "ok" for status, _ in results), results
            assert all(runners[h].stats()["steps"] > 0 for h in hosts[:2])
            assert runners[hosts[2]].stats()["steps"] == 0  # not in the answer: no requests

            # (2) a runner added to the answer starts receiving requests
            dns.set(RUNNERS, hosts)
            three = {f"{h}:{port}" for h in hosts}
            for o in orchs:
                wait_for(lambda o=o: o.serving() == three, "the new runner joined")
            results = run_many(orchs, 9, 24)
            assert all(status == "ok" for status, _ in results), results
            assert runners[hosts[2]].stats()["steps"] > 0

            # (3) removed from the answer, then SIGTERM: its running requests finish
            victim = runners[hosts[0]]
            with ThreadPoolExecutor(1) as pool:
                future = pool.submit(run_many, orchs, 9, 400)
                wait_for(lambda: victim.stats()["slots"] > 0, "requests on the drained runner")
                dns.set(RUNNERS, hosts[1:])
                for o in orchs:
                    wait_for(lambda o=o: victim.endpoint not in o.serving(), "drain seen")
                held = victim.stats()["slots"]
                victim.proc.send_signal(signal.SIGTERM)
                results = future.result()
            assert all(status == "ok" for status, _ in results), results
            assert all(final.usage.completion_tokens == 400 for _, (_, _, final) in results)
            assert victim.proc.wait(60) == 0
            assert held > 0  # the drain had requests to finish

            # (4) SIGKILL fails only the killed runner's requests, UNAVAILABLE naming it
            killed = runners[hosts[1]]
            with ThreadPoolExecutor(1) as pool:
                future = pool.submit(run_many, orchs, 8, 400)
                wait_for(lambda: killed.stats()["slots"] > 0 and runners[hosts[2]].stats()[
                    "slots"] > 0, "requests on both runners")
                killed.kill()
                results = future.result()
            failed = [r for r in results if r[0] != "ok"]
            assert failed and len(failed) < len(results)
            assert all(code == "UNAVAILABLE" and killed.endpoint in msg for code, msg in failed)
            dns.set(RUNNERS, hosts[2:])
            last = f"{hosts[2]}:{port}"
            for o in orchs:
                wait_for(lambda o=o: o.serving() == {last}, "the killed runner dropped")

            # (5) Cancel sent to the other orchestrator stops the request
            call = orchs[0].stub.Generate(generate_request(
                "Once upon a time", max_tokens=400, ignore_eos=True, request_id="far-away"),
                timeout=120)
            first = next(call)
            assert first.HasField("delta")
            ans = orchs[1].stub.Cancel(opb.CancelGenerateRequest(request_id="far-away"),
                                       timeout=10)
            assert ans.found
            _, _, final = collect(call)
            assert final is not None and final.finish_reason == pb.FINISH_REASON_CANCELLED
            assert not orchs[1].stub.Cancel(opb.CancelGenerateRequest(request_id="nobody"),
                                            timeout=10).found

            # (6) every stage and orchestrator returns to idle
            assert runners[hosts[2]].wait_idle()["slots"] == 0
            for o in orchs:
                wait_for(lambda o=o: o.topology()["running"] == 0 and o.topology()["runs"] == 0,
                         "orchestrator idle")
        finally:
            for o in orchs:
                o.close()
            for r in runners.values():
                r.stop()
