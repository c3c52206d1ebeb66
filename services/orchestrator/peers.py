"""Cancel across orchestrator processes. Several orchestrators share no state: a request lives
on the process that received its Generate, while its Cancel may land on any of them. Two kinds
of peers:

  - workers: the sibling processes of one orchestrator serving the same port
    (`--workers`, services/workers.py), each also listening on its own socket, a static list;
  - replicas: the other orchestrator replicas of a cluster, found by the same DNS discovery as
    the stages (`--peers`), resolved afresh on each forwarded Cancel.

A process that does not hold the request forwards the Cancel once to its sibling workers and to
every replica. The forwarded call carries `FORWARDED_KEY` metadata naming where it came from: a
replica's forward still reaches the receiving replica's own workers (its listener picked one
of them), a worker's forward goes nowhere further.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.errors import ServiceError
from services.orchestrator.dns import DnsTarget, parse_target, resolve

log = logging.getLogger(__name__)

FORWARDED_KEY = "llmstage-cancel-forwarded"
FROM_REPLICA = "1"  # any value but FROM_WORKER means a replica (older replicas send "1")
FROM_WORKER = "worker"


class Peers:
    """The other orchestrator processes: sibling `workers` ("unix:/path" or "host:port") and
    the replicas at DNS `target` (either may be absent)."""

    def __init__(self, target: str | None = None, workers: Sequence[str] = (),
                 timeout_s: float = 2.0) -> None:
        self.target: DnsTarget | None = None if target is None else parse_target(target)
        self.workers = tuple(workers)
        self.timeout_s = timeout_s

    async def cancel(self, request_id: str, forwarded: str | None = None) -> bool:
        """True when some peer held the request and cancelled it. `forwarded` is where this
        Cancel came from (`forwarded_from`): None, a caller's; FROM_REPLICA, another replica
        (the workers are asked, not the replicas); FROM_WORKER, a sibling (nobody is asked).
        A peer that cannot be reached is skipped (it holds no request anyone can still
        cancel)."""
        if forwarded == FROM_WORKER:
            return False
        calls = [self._cancel_on(w, request_id, FROM_WORKER) for w in self.workers]
        if forwarded is None and self.target is not None:
            calls += [self._cancel_on(e, request_id, FROM_REPLICA)
                      for e in await self._replicas(request_id)]
        answers = await asyncio.gather(*calls)
        return any(answers)

    async def _replicas(self, request_id: str) -> tuple[str, ...]:
        assert self.target is not None
        try:
            return await resolve(self.target, self.timeout_s)
        except ServiceError as exc:
            log.warning("cancel %s: peers unknown: %s", request_id, exc.message)
            return ()

    async def _cancel_on(self, endpoint: str, request_id: str, origin: str) -> bool:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            try:
                ans = await stub.Cancel(opb.CancelGenerateRequest(request_id=request_id),
                                        metadata=((FORWARDED_KEY, origin),),
                                        timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("cancel %s: peer %s: %s", request_id, endpoint, exc.code().name)
                return False
        return bool(ans.found)


def forwarded_from(metadata: Any) -> str | None:
    """Where a Cancel's invocation metadata (pairs, or None) says it was forwarded from:
    FROM_WORKER, FROM_REPLICA, or None for a caller's own Cancel."""
    for key, value in metadata or ():
        if key == FORWARDED_KEY:
            return FROM_WORKER if value == FROM_WORKER else FROM_REPLICA
    return None


def is_forwarded(metadata: Any) -> bool:
    """Whether a Cancel's invocation metadata (pairs, or None) marks it as forwarded."""
    return forwarded_from(metadata) is not None
