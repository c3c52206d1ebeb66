"""Cancel across orchestrator replicas. Several orchestrators behind one Service share no
state: a request lives on the replica that received its Generate, while its Cancel may land on
any replica. A replica that does not hold the request forwards the Cancel once to every peer
(found by the same DNS discovery as the stages); the forwarded call carries
`FORWARDED_KEY` metadata so it is never forwarded again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.errors import ServiceError
from services.orchestrator.dns import parse_target, resolve

log = logging.getLogger(__name__)

FORWARDED_KEY = "llmstage-cancel-forwarded"


class Peers:
    """The other orchestrator replicas, resolved afresh on each forwarded Cancel."""

    def __init__(self, target: str, timeout_s: float = 2.0) -> None:
        self.target = parse_target(target)
        self.timeout_s = timeout_s

    async def cancel(self, request_id: str) -> bool:
        """True when some peer held the request and cancelled it. A peer that cannot be
        reached is skipped (it holds no request anyone can still cancel)."""
        try:
            endpoints = await resolve(self.target, self.timeout_s)
        except ServiceError as exc:
            log.warning("cancel %s: peers unknown: %s", request_id, exc.message)
            return False
        answers = await asyncio.gather(*(self._cancel_on(e, request_id) for e in endpoints))
        return any(answers)

    async def _cancel_on(self, endpoint: str, request_id: str) -> bool:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            try:
                ans = await stub.Cancel(opb.CancelGenerateRequest(request_id=request_id),
                                        metadata=((FORWARDED_KEY, "1"),),
                                        timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("cancel %s: peer %s: %s", request_id, endpoint, exc.code().name)
                return False
        return bool(ans.found)


def is_forwarded(metadata: Any) -> bool:
    """Whether a Cancel's invocation metadata (pairs, or None) marks it as forwarded."""
    return any(key == FORWARDED_KEY for key, _ in (metadata or ()))
