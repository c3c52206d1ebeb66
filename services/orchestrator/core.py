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

from services.errors import (
    AlreadyExists,
    DeadlineExceeded,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from services.orchestrator.codec import (
    Event,
    FinalReport,
    FinishReason,
    GenerateInput,
    ReplicaReport,
    TopologyReport,
)
from services.orchestrator.discovery import (
    DEFAULT_INTERVAL_S,
    Discovery,
    check_description,
    create_admit,
)
from services.orchestrator.metrics import OrchestratorMetrics
from services.orchestrator.replicas import Replica, StagePool
from services.orchestrator.routes import compute_route
from services.orchestrator.run import Placement, RequestRun
from services.orchestrator.topology import StageSpec, Topology

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("llmstage.orchestrator")
CLEANUP_WAIT_S = 5.0  # how long `close` waits for the runs' Finish and Reset calls


class Orchestrator:
    """Serves Generate over a topology. `start()` checks every stage; `close()` releases."""

    def __init__(self, topology: Topology, max_message_bytes: int = 16 << 20,
                 discover_interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.topology = topology
        self.pools = {s.stage_id: StagePool(s.stage_id, s.endpoints, max_message_bytes,
                                            s.discover) for s in topology.stages}
        self.discover_interval_s = discover_interval_s
        self.discoveries: list[Discovery] = []
        self.runs: dict[str, RequestRun] = {}
        self._cleanups: set[asyncio.Task[None]] = set()  # runs' cleanups under way
        self._queued: dict[str, asyncio.Event] = {}  # request id -> set to cancel it
        self.num_running = 0
        self.num_queued = 0
        self._slots = asyncio.Semaphore(topology.max_running)
        self.metrics = OrchestratorMetrics(self.state)

    async def start(self, wait_s: float = 30.0) -> None:
        """Describe every listed replica (waiting up to `wait_s` for them to come up); refuse a
        topology whose declared ports a stage cannot produce. A discovered stage waits up to
        `wait_s` for its first replica, then keeps discovering in the background (requests
        meanwhile fail with UNAVAILABLE)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        for spec in self.topology.stages:
            for replica in self.pools[spec.stage_id].replicas:
                while True:
                    try:
                        desc = await replica.describe(timeout=5.0)
                        break
                    except grpc.aio.AioRpcError as exc:
                        if loop.time() > deadline:
                            raise Unavailable(f"stage {spec.stage_id} replica "
                                              f"{replica.endpoint}: {exc.details()}") from None
                        await asyncio.sleep(0.1)
                check_description(spec, replica.endpoint, desc)
        for spec in self.topology.stages:
            if spec.discover is not None:
                await self._start_discovery(spec, deadline)

    async def _start_discovery(self, spec: StageSpec, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        found = Discovery(self.pools[spec.stage_id], spec.discover or "",
                          create_admit(spec), self.discover_interval_s)
        self.discoveries.append(found)
        await found.refresh()
        while not found.pool.replicas and loop.time() < deadline:
            await asyncio.sleep(0.2)
            await found.refresh()
        if not found.pool.replicas:
            log.warning("stage %s: no replica found at %s yet", spec.stage_id, spec.discover)
        found.start()

    async def close(self) -> None:
        """Stop. Every slot a request still holds on a stage is finished and reset first
        (up to CLEANUP_WAIT_S), so the stages that outlive the orchestrator are left idle:
        without the wait, a cleanup that a cancelled call started would die with the event
        loop."""
        pending = set(self._cleanups)
        pending.update(self._cleanup(run, FinishReason.CANCELLED) for run in self.runs.values())
        if pending:
            await asyncio.wait(pending, timeout=CLEANUP_WAIT_S)
        for found in self.discoveries:
            await found.close()
        for pool in self.pools.values():
            for replica in pool.replicas:
                await replica.close()

    async def generate(self, call: GenerateInput, time_remaining: float | None,
                       parent: otel_context.Context | None = None) -> AsyncIterator[Event]:
        """One request end to end; `parent` (the caller's trace context) parents its root span."""
        span = _tracer.start_span("llmstage.v1.Orchestrator/Generate", context=parent,
                                  kind=SpanKind.SERVER, attributes={
                                      "rpc.system": "grpc",
                                      "rpc.service": "llmstage.v1.Orchestrator",
                                      "rpc.method": "Generate"})
        t0 = time.perf_counter()
        is_first, outcome = True, "error"
        try:
            async for ev in self._generate(call, time_remaining, span):
                if isinstance(ev, FinalReport):
                    outcome = reason = ev.finish_reason.value
                    self.metrics.e2e.observe(time.perf_counter() - t0)
                    span.set_attributes({
                        "gen_ai.response.finish_reasons": [reason],
                        "gen_ai.usage.input_tokens": ev.usage.prompt_tokens,
                        "gen_ai.usage.output_tokens": ev.usage.completion_tokens})
                    span.add_event("finish", {"llmstage.finish_reason": reason})
                elif is_first:
                    is_first = False
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                yield ev
        except BaseException as exc:
            if isinstance(exc, ServiceError):
                outcome, why = exc.code, f"{exc.code}: {exc.message}"
            else:  # the caller went away (the stream is closed), or a bug
                outcome = "INTERNAL" if isinstance(exc, Exception) else "CANCELLED"
                why = type(exc).__name__
            span.set_status(Status(StatusCode.ERROR, why))
            span.add_event("finish", {"llmstage.finish_reason": "error", "error": why})
            raise
        finally:
            self.metrics.requests.labels(outcome).inc()
            span.end()

    async def _generate(self, call: GenerateInput, time_remaining: float | None,
                        span: trace.Span) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        deadline = None if time_remaining is None else loop.time() + time_remaining
        request_id = call.request_id or uuid.uuid4().hex
        span.set_attribute("llmstage.request_id", request_id)
        if request_id in self.runs or request_id in self._queued:
            where = "running" if request_id in self.runs else "queued"
            raise AlreadyExists(f"request id {request_id!r} is already {where}")
        route = compute_route(self.topology, call.sinks, [call.prompt_field])
        if not await self._acquire(deadline, request_id):
            yield FinalReport(request_id, FinishReason.CANCELLED, route.stages)
            return
        try:
            placements = []
            for sid in route.stages:
                replica = self.pools[sid].pick()
                placements.append(Placement(sid, replica, replica.next_slot_id(),
                                            *self._wiring(sid, route.stages, route.sinks)))
            span.set_attribute("llmstage.route", list(route.stages))
            run = RequestRun(request_id, call.request, route, placements, deadline,
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
        """Cancel a running or queued request; False when no such request is in flight."""
        run = self.runs.get(request_id)
        if run is not None:
            run.cancel()
            return True
        queued = self._queued.get(request_id)
        if queued is not None:
            queued.set()  # its Generate ends with finish reason CANCELLED, nothing generated
            return True
        return False

    def tokenizer_replica(self, stage_id: str) -> Replica:
        """The replica that answers Tokenize and Detokenize for `stage_id` (empty: the stage
        of the first text sink): NotFound for a stage the topology lacks, Unavailable when no
        replica of it is healthy."""
        if not stage_id:
            texts = [s.split(":", 1)[0] for s in self.topology.sinks if s.endswith(":text")]
            if not texts:
                raise NotFound("the topology has no text sink; name a stage (stage_id)")
            stage_id = texts[0]
        pool = self.pools.get(stage_id)
        if pool is None:
            raise NotFound(f"stage {stage_id!r} is not in the topology "
                           f"({', '.join(self.pools)})")
        return pool.pick()

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

    async def _acquire(self, deadline: float | None, request_id: str) -> bool:
        """Wait for a running slot; False when the request was cancelled while queued."""
        if self._slots.locked() and self.num_queued >= self.topology.max_queued:
            raise ResourceExhausted(
                f"admission queue is full ({self.num_running} running, {self.num_queued} "
                f"waiting; limits {self.topology.max_running} and {self.topology.max_queued})")
        loop = asyncio.get_running_loop()
        cancelled = self._queued[request_id] = asyncio.Event()
        self.num_queued += 1
        t0 = time.perf_counter()
        acquire = loop.create_task(self._slots.acquire())
        watch = loop.create_task(cancelled.wait())
        is_acquired = False
        try:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait((acquire, watch), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            is_acquired = acquire.done() and not cancelled.is_set()
        finally:
            watch.cancel()
            self.num_queued -= 1
            del self._queued[request_id]
            if not acquire.done():
                acquire.cancel()
            elif not is_acquired and not acquire.cancelled():
                self._slots.release()  # acquired in the same turn as the cancel or the end
        if cancelled.is_set():
            return False
        if not is_acquired:
            raise DeadlineExceeded("deadline exceeded while queued for admission")
        self.metrics.queue.observe(time.perf_counter() - t0)
        self.num_running += 1
        return True

    async def _drive(self, run: RequestRun) -> AsyncIterator[Event]:
        is_complete = False
        try:
            async for ev in run.events():
                yield ev
                is_complete = isinstance(ev, FinalReport)
        finally:
            if not is_complete:
                reason = FinishReason.CANCELLED if run.is_cancelled else FinishReason.ERROR
                # The client may be gone (this generator is being closed): shield the cleanup.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(self._cleanup(run, reason))
        if not is_complete and run.is_cancelled:
            yield run.final_cancelled()

    def _cleanup(self, run: RequestRun, reason: FinishReason) -> asyncio.Task[None]:
        """`run.cleanup(reason)` as a task `close` waits for."""
        task = asyncio.ensure_future(run.cleanup(reason))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    def topology_report(self) -> TopologyReport:
        """The topology and the orchestrator's state accounting (with each replica's calls
        in flight)."""
        state = self.state()
        return TopologyReport(
            self.topology,
            {sid: tuple(ReplicaReport(r.endpoint, r.is_healthy and not r.is_draining,
                                      r.in_flight)
                        for r in pool.replicas) for sid, pool in self.pools.items()},
            {k: state[k] for k in ("running", "queued", "runs", "step_streams",
                                   "stream_members")})

