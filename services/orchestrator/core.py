"""The Orchestrator: admission queue, routes, replica choice, and one RequestRun per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from services.orchestrator.metrics import OrchestratorMetrics
from services.orchestrator.replicas import StagePool
from services.orchestrator.routes import compute_route
from services.orchestrator.run import Placement, RequestRun
from services.orchestrator.topology import Topology

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("llmstage.orchestrator")


class Orchestrator:
    """Serves Generate over a topology. `start()` checks every stage; `close()` releases."""

    def __init__(self, topology: Topology, max_message_bytes: int = 16 << 20) -> None:
        self.topology = topology
        self.pools = {s.stage_id: StagePool(s.stage_id, s.endpoints, max_message_bytes)
                      for s in topology.stages}
        self.runs: dict[str, RequestRun] = {}
        self.num_running = 0
        self.num_queued = 0
        self._slots = asyncio.Semaphore(topology.max_running)
        self.metrics = OrchestratorMetrics(self)

    async def start(self, wait_s: float = 30.0) -> None:
        """Describe every replica (waiting up to `wait_s` for them to come up); refuse a
        topology whose declared ports a stage cannot produce."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        for spec in self.topology.stages:
            for replica in self.pools[spec.stage_id].replicas:
                while True:
                    try:
                        replica.description = await replica.stub.Describe(
                            pb.DescribeRequest(), timeout=5.0)
                        break
                    except grpc.aio.AioRpcError as exc:
                        if loop.time() > deadline:
                            raise Unavailable(f"stage {spec.stage_id} replica "
                                              f"{replica.endpoint}: {exc.details()}") from None
                        await asyncio.sleep(0.1)
                desc = replica.description
                if desc.runner != spec.runner:
                    raise FailedPrecondition(f"stage {spec.stage_id}: {replica.endpoint} runs "
                                             f"{desc.runner!r}, the topology says {spec.runner!r}")
                served = {p.name for p in desc.emits}
                missing = [p for p in spec.emits if p not in served]
                if missing:
                    raise FailedPrecondition(
                        f"stage {spec.stage_id}: {replica.endpoint} cannot produce port "
                        f"{missing[0]!r} (it emits {sorted(served)})")

    async def close(self) -> None:
        for pool in self.pools.values():
            for replica in pool.replicas:
                await replica.close()

    async def generate(self, gen: opb.GenerateRequest, time_remaining: float | None,
                       parent: otel_context.Context | None = None
                       ) -> AsyncIterator[opb.GenerateEvent]:
        """One request end to end; `parent` (the caller's trace context) parents its root span."""
        span = _tracer.start_span("llmstage.v1.Orchestrator/Generate", context=parent,
                                  kind=SpanKind.SERVER, attributes={
                                      "rpc.system": "grpc",
                                      "rpc.service": "llmstage.v1.Orchestrator",
                                      "rpc.method": "Generate"})
        t0 = time.perf_counter()
        is_first, outcome = True, "error"
        try:
            async for ev in self._generate(gen, time_remaining, span):
                if is_first and ev.HasField("delta"):
                    is_first = False
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                if ev.HasField("final"):
                    outcome = pb.FinishReason.Name(ev.final.finish_reason)[14:].lower()
                    self.metrics.e2e.observe(time.perf_counter() - t0)
                    f = ev.final
                    reason = pb.FinishReason.Name(f.finish_reason)[14:].lower()
                    span.set_attributes({
                        "gen_ai.response.finish_reasons": [reason],
                        "gen_ai.usage.input_tokens": f.usage.prompt_tokens,
                        "gen_ai.usage.output_tokens": f.usage.completion_tokens})
                    span.add_event("finish", {"llmstage.finish_reason": reason})
                yield ev
        except BaseException as exc:
            code = getattr(exc, "code", None)
            outcome = code if isinstance(code, str) else "CANCELLED"
            why = f"{code}: {getattr(exc, 'message', exc)}" if isinstance(code, str) \
                else type(exc).__name__
            span.set_status(Status(StatusCode.ERROR, why))
            span.add_event("finish", {"llmstage.finish_reason": "error", "error": why})
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()
            span.end()

    async def _generate(self, gen: opb.GenerateRequest, time_remaining: float | None,
                        span: trace.Span) -> AsyncIterator[opb.GenerateEvent]:
        loop = asyncio.get_running_loop()
        deadline = None if time_remaining is None else loop.time() + time_remaining
        if not gen.HasField("request"):
            raise InvalidArgument("GenerateRequest.request is required")
        request = pb.GenerationRequest()
        request.CopyFrom(gen.request)
        request_id = request.request_id or uuid.uuid4().hex
        request.request_id = request_id
        span.set_attribute("llmstage.request_id", request_id)
        if request_id in self.runs:
            raise InvalidArgument(f"request id {request_id!r} is already running")
        fields = [request.WhichOneof("prompt") or ""]
        route = compute_route(self.topology, list(gen.sinks), fields)
        await self._acquire(deadline)
        try:
            placements = []
            for sid in route.stages:
                replica = self.pools[sid].pick()
                placements.append(Placement(sid, replica, replica.next_slot_id(),
                                            *self._wiring(sid, route.stages, route.sinks)))
            span.set_attribute("llmstage.route", list(route.stages))
            run = RequestRun(request_id, request, route, placements, deadline,
                             trace.set_span_in_context(span))
            for p in placements:
                p.replica.in_flight += 1
            self.runs[request_id] = run
            try:
                async for ev in self._drive(run):
                    yield ev
            finally:
                self.runs.pop(request_id, None)
                for p in placements:
                    p.replica.in_flight -= 1
        finally:
            self.num_running -= 1
            self._slots.release()

    def state(self) -> dict[str, int]:
        """What the orchestrator holds now; every count is 0 when no request is in flight
        (open Step streams stay, at most one per replica and route in use)."""
        replicas = [r for pool in self.pools.values() for r in pool.replicas]
        return {
            "runs": len(self.runs),
            "running": self.num_running,
            "queued": self.num_queued,
            "in_flight": sum(r.in_flight for r in replicas),
            "step_streams": sum(r.num_step_streams for r in replicas),
            "stream_members": sum(r.num_stream_members for r in replicas),
        }

    def cancel(self, request_id: str) -> bool:
        run = self.runs.get(request_id)
        if run is None:
            return False
        run.cancel()
        return True

    # ---- internals ---------------------------------------------------------------------
    def _wiring(self, stage_id: str, active: tuple[str, ...], sinks: tuple[str, ...]
                ) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        """The ports `stage_id` must produce (its sinks and what active stages read from it)
        and its inputs from other active stages."""
        spec = self.topology.stage(stage_id)
        wanted = {s.split(":", 1)[1] for s in sinks if s.split(":", 1)[0] == stage_id}
        for other in active:
            for inp in self.topology.stage(other).inputs:
                src, port = inp.split(":", 1)
                if src == stage_id:
                    wanted.add(port)
        ports = tuple(p for p in spec.emits if p in wanted)
        inputs = tuple((inp, inp.split(":", 1)[0]) for inp in spec.inputs
                       if inp.split(":", 1)[0] in active)
        return ports, inputs

    async def _acquire(self, deadline: float | None) -> None:
        if self._slots.locked() and self.num_queued >= self.topology.max_queued:
            raise ResourceExhausted(
                f"admission queue is full ({self.num_running} running, {self.num_queued} "
                f"waiting; limits {self.topology.max_running} and {self.topology.max_queued})")
        self.num_queued += 1
        t0 = time.perf_counter()
        try:
            timeout = None if deadline is None else \
                max(0.0, deadline - asyncio.get_running_loop().time())
            await asyncio.wait_for(self._slots.acquire(), timeout)
        except TimeoutError:
            raise DeadlineExceeded("deadline exceeded while queued for admission") from None
        finally:
            self.num_queued -= 1
        self.metrics.queue.observe(time.perf_counter() - t0)
        self.num_running += 1

    async def _drive(self, run: RequestRun) -> AsyncIterator[opb.GenerateEvent]:
        is_complete = False
        try:
            async for ev in run.events():
                yield ev
                is_complete = ev.HasField("final")
        finally:
            if not is_complete:
                reason = pb.FINISH_REASON_CANCELLED if run.is_cancelled else \
                    pb.FINISH_REASON_ERROR
                # The client may be gone (this generator is being closed): shield the cleanup.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(run.cleanup(reason))
        if not is_complete and run.is_cancelled:
            yield run.final_cancelled()

    def topology_pb(self) -> opb.TopologyResponse:
        """The topology and the orchestrator's state accounting (with each replica's calls
        in flight)."""
        t, state = self.topology, self.state()
        return opb.TopologyResponse(
            stages=[opb.StageInfo(
                id=s.stage_id, runner=s.runner, emits=list(s.emits), inputs=list(s.inputs),
                on_missing=s.on_missing,
                replicas=[opb.ReplicaInfo(endpoint=r.endpoint, healthy=r.is_healthy,
                                          in_flight=r.in_flight)
                          for r in self.pools[s.stage_id].replicas]) for s in t.stages],
            sinks=list(t.sinks), default_sinks=list(t.default_sinks), max_running=t.max_running,
            max_queued=t.max_queued, running=self.num_running, queued=self.num_queued,
            runs=state["runs"], step_streams=state["step_streams"],
            stream_members=state["stream_members"])
