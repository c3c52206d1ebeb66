"""Stage replicas: channels, health, load, and the cohort streams open on each."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.errors import ServiceError, Unavailable, error_for
from services.orchestrator.cohorts import CohortStream

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5


class Replica:
    """One endpoint of a stage, as this orchestrator sees it."""

    def __init__(self, stage_id: str, endpoint: str, max_message_bytes: int) -> None:
        self.stage_id = stage_id
        self.endpoint = endpoint
        self.channel = grpc.aio.insecure_channel(endpoint, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)])
        self.stub = stage_pb2_grpc.StageStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.is_healthy = True
        self.is_draining = False  # gone from discovery: no new requests, running ones finish
        self.in_flight = 0
        self.on_down: Callable[[], None] | None = None  # told when a call finds it down
        self.description: pb.DescribeResponse | None = None
        # Slot ids: a random base keeps two orchestrators (or a restart) from colliding.
        self._slot_ids = itertools.count(secrets.randbits(30) << 20)
        self._cohorts: dict[str, CohortStream] = {}
        self._probe: asyncio.Task[None] | None = None

    @property
    def num_step_streams(self) -> int:
        """Open Step streams to this replica (one per route fingerprint in use)."""
        return sum(1 for s in self._cohorts.values() if not s.is_closed)

    @property
    def num_stream_members(self) -> int:
        """Slots whose updates those streams still route to a request."""
        return sum(s.num_members for s in self._cohorts.values())

    def next_slot_id(self) -> int:
        return next(self._slot_ids)

    async def forward(self, method: str, request_pb: Any, timeout: float | None) -> Any:
        """One unary call of the Stage service passed through as it is (Tokenize,
        Detokenize); its failure raised as the typed error of its status."""
        try:
            return await getattr(self.stub, method)(request_pb, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            error: ServiceError = error_for(exc.code().name, f"stage {self.stage_id} at "
                                            f"{self.endpoint}: {exc.details()}")
            raise error from None

    async def describe(self, timeout: float) -> pb.DescribeResponse:
        """Ask the replica what it runs (kept in `description`); raises grpc.aio.AioRpcError."""
        self.description = await self.stub.Describe(pb.DescribeRequest(), timeout=timeout)
        return self.description

    def cohort(self, fingerprint: str) -> CohortStream:
        """The open cohort stream for this fingerprint, opened on first use."""
        stream = self._cohorts.get(fingerprint)
        if stream is None or stream.is_closed:
            stream = CohortStream(self.stage_id, self.endpoint, self.stub,
                                  lambda s, err: self._closed(fingerprint, s, err))
            self._cohorts[fingerprint] = stream
        return stream

    def mark_down(self, why: str) -> None:
        if self.is_healthy:
            log.warning("replica %s of stage %s is down: %s", self.endpoint, self.stage_id, why)
        self.is_healthy = False
        if self.on_down is not None:
            self.on_down()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._wait_healthy())

    async def check(self, timeout: float = 2.0) -> bool:
        try:
            ans = await self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                           timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return bool(ans.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        for stream in list(self._cohorts.values()):
            await stream.close()
        await self.channel.close()

    def _closed(self, fingerprint: str, stream: CohortStream,
                error: grpc.aio.AioRpcError | None) -> None:
        if self._cohorts.get(fingerprint) is stream:
            del self._cohorts[fingerprint]
        if error is not None and error.code() in (grpc.StatusCode.UNAVAILABLE,
                                                  grpc.StatusCode.INTERNAL,
                                                  grpc.StatusCode.UNKNOWN):
            self.mark_down(f"{error.code().name}: {error.details()}")

    async def _wait_healthy(self) -> None:
        while not await self.check(timeout=1.0):
            await asyncio.sleep(PROBE_INTERVAL_S)
        log.info("replica %s of stage %s is back", self.endpoint, self.stage_id)
        self.is_healthy = True


class StagePool:
    """The replicas of one stage; requests go to the least-loaded healthy one that is not
    draining. With discovery the set changes: `add` a replica that answered its checks,
    `drain` one that left the answer, `sweep` closes drained ones once their calls ended."""

    def __init__(self, stage_id: str, endpoints: tuple[str, ...], max_message_bytes: int,
                 discover: str | None = None) -> None:
        self.stage_id = stage_id
        self.max_message_bytes = max_message_bytes
        self.discover = discover
        self.replicas = [Replica(stage_id, e, max_message_bytes) for e in endpoints]

    def pick(self) -> Replica:
        healthy = [r for r in self.replicas if r.is_healthy and not r.is_draining]
        if not healthy:
            known = (", ".join(r.endpoint for r in self.replicas)
                     or f"none found at {self.discover}")
            raise Unavailable(f"no healthy replica of stage {self.stage_id} ({known})")
        return min(healthy, key=lambda r: r.in_flight)

    def endpoints(self) -> set[str]:
        return {r.endpoint for r in self.replicas}

    def add(self, replica: Replica) -> None:
        """Start sending requests to `replica` (its checks passed); a draining replica of the
        same endpoint is taken back instead."""
        for r in self.replicas:
            if r.endpoint == replica.endpoint:
                r.is_draining = False
                return
        self.replicas.append(replica)
        log.info("replica %s of stage %s joins", replica.endpoint, self.stage_id)

    def drain(self, endpoint: str) -> None:
        for r in self.replicas:
            if r.endpoint == endpoint and not r.is_draining:
                log.info("replica %s of stage %s drains", endpoint, self.stage_id)
                r.is_draining = True

    async def sweep(self) -> None:
        """Close and forget draining replicas with no call in flight."""
        for r in [r for r in self.replicas if r.is_draining and r.in_flight == 0]:
            self.replicas.remove(r)
            await r.close()
