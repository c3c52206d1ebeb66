"""What the hostile-input suite needs beyond the rig: services whose logs are kept (to prove
nothing was logged at ERROR), a health watch that runs while a hostile call does, and raw
request bytes that protobuf's own encoder would never produce (strings that are not UTF-8)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rig import Orchestrator, Rig, Runner, write_stage

# Generous (the stage answers in milliseconds, see docs/benchmarks.md): the suite shares small
# machines, and a stage that tokenizes on its event loop misses it by many seconds.
HEALTH_TIMEOUT_S = 2.0
LONE_SURROGATE = b"\xed\xa0\x80"  # what a JavaScript string with one becomes (CESU-8)


class LoggedRig(Rig):
    """The rig (a runner with the hidden port, an orchestrator over it) with both processes'
    stderr written to files under `tmp`."""

    def __init__(self, tmp: Path, **stage: Any) -> None:
        self.runner_log = tmp / "runner.log"
        self.orch_log = tmp / "orchestrator.log"
        with self.runner_log.open("w") as runner_err, self.orch_log.open("w") as orch_err:
            self.runner = Runner(write_stage(tmp, **stage), stderr=runner_err)
            self.orch = Orchestrator(tmp, {"backbone": [self.runner.endpoint]},
                                     stderr=orch_err)
        self.stub = self.runner.stub
        self._next_slot = 0

    def error_lines(self) -> list[str]:
        """Lines either process logged at ERROR, or of a traceback."""
        return [line for log in (self.runner_log, self.orch_log)
                for line in log.read_text().splitlines()
                if line.startswith(("ERROR", "CRITICAL", "Traceback"))]


class HealthWatch:
    """Checks grpc.health.v1 on `targets` from a thread, back to back, while the `with` block
    runs (at least once each after it starts); on exit every check must have answered
    SERVING within HEALTH_TIMEOUT_S."""

    def __init__(self, *targets: str) -> None:
        self.channels = [grpc.insecure_channel(t) for t in targets]
        self.stubs = [health_pb2_grpc.HealthStub(c) for c in self.channels]
        for stub in self.stubs:  # connected before the watch starts
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._rounds = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        rounds = self._rounds
        deadline = time.monotonic() + 10 * HEALTH_TIMEOUT_S
        while self._rounds <= rounds + 1 and time.monotonic() < deadline:
            time.sleep(0.005)  # one full round that began after the hostile call ended
        self._stop.set()
        self._thread.join()
        for c in self.channels:
            c.close()
        if exc[0] is None:
            self.check()

    def check(self) -> None:
        assert not self.failures, f"health did not answer: {self.failures[:5]}"
        assert self.latencies_s, "health was never checked"

    def _run(self) -> None:
        while not self._stop.is_set():
            for stub in self.stubs:
                t0 = time.monotonic()
                try:
                    ans = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
                    if ans.status != health_pb2.HealthCheckResponse.SERVING:
                        self.failures.append(f"status {ans.status}")
                    self.latencies_s.append(time.monotonic() - t0)
                except grpc.RpcError as err:
                    self.failures.append(f"{err.code().name} after {time.monotonic() - t0:.3f} s")
            self._rounds += 1
            time.sleep(0.01)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """One length-delimited field (string, bytes or message) in protobuf's wire format."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def number_of(message: Any, name: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[name].number)


def raw_call(channel: grpc.Channel, method: str, body: bytes, is_stream: bool
             ) -> grpc.RpcError | Any:
    """Call `method` with `body` as the request bytes; its error, or its (first) answer."""
    try:
        if is_stream:
            return next(iter(channel.unary_stream(method)(body, timeout=10)))
        return channel.unary_unary(method)(body, timeout=10)
    except grpc.RpcError as err:
        return err
