"""Replica discovery: a stage whose topology names `discover` (a DNS target) has its replicas
re-resolved every `interval_s`, and sooner after a replica fails.

A new address joins the stage's pool once `admit(replica)` accepts it (health SERVING, and a
Describe that matches the topology); an address gone from the answer drains (no new requests,
running ones finish) and is closed once idle. A failed resolution keeps the current set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.errors import FailedPrecondition, ServiceError
from services.orchestrator.dns import parse_target, resolve
from services.orchestrator.replicas import Replica, StagePool
from services.orchestrator.topology import StageSpec

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0

Admit = Callable[[Replica], Awaitable[bool]]


class Discovery:
    """Keeps one pool in step with its DNS target. `refresh()` runs one round; `start()` runs
    rounds in the background until `close()`."""

    def __init__(self, pool: StagePool, target: str, admit: Admit,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.pool = pool
        self.target = parse_target(target)
        self.interval_s = interval_s
        self._admit = admit
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        """Resolve again now (a replica's call failed: it may have gone)."""
        self._wake.set()

    async def refresh(self) -> None:
        """One round: resolve, admit the new, drain the gone, close the drained idle ones."""
        try:
            found = set(await resolve(self.target))
        except ServiceError as exc:
            log.warning("stage %s: %s (keeping %d replicas)", self.pool.stage_id, exc.message,
                        len(self.pool.replicas))
            return
        active = {r.endpoint for r in self.pool.replicas if not r.is_draining}
        for endpoint in sorted(active - found):
            self.pool.drain(endpoint)
        for endpoint in sorted(found - active):
            draining = next((r for r in self.pool.replicas if r.endpoint == endpoint), None)
            replica = draining or Replica(self.pool.stage_id, endpoint,
                                          self.pool.max_message_bytes)
            if await self._admit(replica):
                replica.on_down = self.wake
                self.pool.add(replica)
            elif draining is None:
                await replica.close()
        await self.pool.sweep()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:  # a bug: keep discovering, say it loudly
                log.exception("stage %s: discovery round failed", self.pool.stage_id)


def create_admit(spec: StageSpec) -> Admit:
    """The check a discovered replica of `spec` passes before it gets requests: health
    SERVING, then a Describe that matches the topology."""

    async def admit(replica: Replica) -> bool:
        if not await replica.check(timeout=2.0):
            return False
        try:
            check_description(spec, replica.endpoint, await replica.describe(timeout=5.0))
        except grpc.aio.AioRpcError:
            return False
        except FailedPrecondition as exc:
            log.warning("%s; not sending it requests", exc.message)
            return False
        return True

    return admit


def check_description(spec: StageSpec, endpoint: str, desc: pb.DescribeResponse) -> None:
    """FailedPrecondition when the replica does not run what the topology says."""
    if desc.runner != spec.runner:
        raise FailedPrecondition(f"stage {spec.stage_id}: {endpoint} runs "
                                 f"{desc.runner!r}, the topology says {spec.runner!r}")
    served = {p.name for p in desc.emits}
    missing = [p for p in spec.emits if p not in served]
    if missing:
        raise FailedPrecondition(f"stage {spec.stage_id}: {endpoint} cannot produce port "
                                 f"{missing[0]!r} (it emits {sorted(served)})")
