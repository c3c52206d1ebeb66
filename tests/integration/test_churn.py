"""A thousand Generate calls that mostly end early: deadlines of 0.1 to 20 ms (the gRPC
timeout of the call) and random cancels, by the Cancel RPC and by the client, at any moment of
a request's life on a two-stage route. However each one ended, every stage and the
orchestrator are idle again within 2 s of the last call's return. The same through an
orchestrator of two workers (a Cancel reaching either), and through a gateway of two workers
(streams closed by their client, or cancelled by the Cancel RPC of their X-Request-Id)."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from deployment import Deployment, generate_request
from http_gateway import GatewayProc

from services.contract.llmstage.v1 import orchestrator_pb2 as opb

NUM_CALLS = 1000
NUM_THREADS = 16
NUM_GATEWAY_CALLS = 300  # HTTP: each call its own connection
IDLE_WITHIN_S = 2.0
PROMPTS = ["Once upon a time", "The dog", "Lily and Ben", "One day", "Tom had a red ball"]


def _leftovers(dep: Deployment) -> dict[str, Any]:
    """What is not idle: each stage's busy counters, the orchestrator's counts."""
    bad: dict[str, Any] = {}
    for proc in dep.all_stages:
        s = proc.stats()
        busy = {k: v for k, v in s["slots_by_state"].items() if v}
        busy |= {k: s[k] for k in ("slots", "running", "waiting") if s[k]}
        if s["kv_pages_free"] != s["kv_pages_total"]:
            busy["kv_pages_used"] = s["kv_pages_total"] - s["kv_pages_free"]
        if busy:
            bad[s["stage_id"]] = busy
    for i, stub in enumerate(dep.worker_stubs or [dep.stub]):  # every worker's own count
        topo = dep.topology(stub)
        counts = {k: topo[k] for k in ("runs", "running", "queued")}
        counts["in_flight"] = sum(r["inFlight"] for s in topo["stages"] for r in s["replicas"])
        if any(counts.values()):
            bad[f"orchestrator worker {i}"] = counts
    return bad


def _wait_idle(dep: Deployment, returned: float) -> None:
    while (bad := _leftovers(dep)) and time.monotonic() - returned < IDLE_WITHIN_S:
        time.sleep(0.02)
    assert not bad, f"not idle {time.monotonic() - returned:.2f} s after the last call: {bad}"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_thousand_short_lived_calls_leave_every_service_idle(tmp_path: Path,
                                                               workers: int) -> None:
    dep = Deployment(tmp_path, {"first": {"maxSeq": 512}, "second": {"maxSeq": 512}},
                     workers=workers)
    rngs = [random.Random(1000 + i) for i in range(NUM_CALLS)]  # one per call: seeded runs

    def one(i: int) -> str:
        """One call; how it ended: "done" (a final report) or the status code."""
        rng = rngs[i]
        rid = f"churn-{i}"
        req = generate_request(PROMPTS[i % len(PROMPTS)], max_tokens=rng.randint(1, 200),
                               ignore_eos=True, seed=i, request_id=rid)
        how = rng.choice(["deadline", "deadline", "rpc", "client"])
        call = dep.stub.Generate(req, timeout=rng.uniform(0.0001, 0.020))
        # A cancel at a random moment of the call's life (it may come after the end).
        canceller = threading.Timer(rng.uniform(0.0, 0.020), _cancel, (dep, call, how, rid))
        if how != "deadline":
            canceller.start()
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc.code().name
        finally:
            if how != "deadline":
                canceller.join()
        return "done"

    try:
        with ThreadPoolExecutor(NUM_THREADS) as pool:
            codes = list(pool.map(one, range(NUM_CALLS)))
        returned = time.monotonic()
        assert set(codes) <= {"done", "CANCELLED", "DEADLINE_EXCEEDED"}, set(codes)
        assert codes.count("DEADLINE_EXCEEDED") > 100 and codes.count("CANCELLED") > 50
        _wait_idle(dep, returned)
    finally:
        dep.close()


def test_short_lived_streams_through_a_gateway_of_two_workers_leave_every_service_idle(
        tmp_path: Path) -> None:
    dep = Deployment(tmp_path, {"first": {"maxSeq": 512}, "second": {"maxSeq": 512}},
                     workers=2)
    gw = GatewayProc(dep.target, "--workers", "2")
    host, port = gw.url.removeprefix("http://").split(":")
    rngs = [random.Random(2000 + i) for i in range(NUM_CALLS)]

    def one(i: int) -> str:
        """One stream; how it ended: "done" (finish reason length), "cancelled" (finish
        reason cancelled: the Cancel RPC), "cut" (closed by this client), or else what came."""
        rng = rngs[i]
        how = rng.choice(["client", "client", "rpc", "none"])
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": ("first", "second")[i % 2], "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": rng.randint(1, 200), "ignore_eos": True, "seed": i,
                "stream": True}
        rid: list[str] = []
        known = threading.Event()

        def cancel() -> None:
            sock = conn.sock
            if how == "client" and sock is not None:
                with contextlib.suppress(OSError):  # it may have ended meanwhile
                    sock.shutdown(socket.SHUT_RDWR)
            elif how == "rpc" and known.wait(10) and rid:
                dep.stub.Cancel(opb.CancelGenerateRequest(request_id=rid[0]), timeout=10)
        canceller = threading.Timer(rng.uniform(0.0, 0.020), cancel)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            if how != "none":
                canceller.start()
            resp = conn.getresponse()
            rid.append(resp.getheader("X-Request-Id", ""))
            known.set()
            if resp.status != 200:
                return str(resp.status)
            text = resp.read().decode()
            if not text.rstrip().endswith("data: [DONE]"):
                return text[-200:]
            return "cancelled" if '"finish_reason":"cancelled"' in text else "done"
        except (OSError, http.client.HTTPException):
            return "cut"
        finally:
            known.set()
            canceller.cancel()  # a cancel not sent yet is dropped; one under way ends first
            if canceller.is_alive():
                canceller.join()
            conn.close()

    try:
        with ThreadPoolExecutor(NUM_THREADS) as pool:
            codes = list(pool.map(one, range(NUM_GATEWAY_CALLS)))
        returned = time.monotonic()
        assert set(codes) <= {"done", "cut", "cancelled"}, set(codes)
        assert codes.count("done") > 50 and codes.count("cut") > 50
        assert codes.count("cancelled") > 10
        _wait_idle(dep, returned)
    finally:
        gw.stop()
        dep.close()


def _cancel(dep: Deployment, call: Any, how: str, rid: str) -> None:
    if how == "rpc":
        dep.stub.Cancel(opb.CancelGenerateRequest(request_id=rid), timeout=10)
    else:
        call.cancel()
