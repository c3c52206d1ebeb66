"""Cohort streams: one Step stream per (replica, route fingerprint), shared by every request
with that fingerprint. A request joins the open stream (it enters the stage's batch at the next
step boundary) and receives its member updates on its own queue. The orchestrator reads every
event at once and hands the credit straight back, so it never holds a stage's decode loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.errors import ServiceError, Unavailable, error_for

log = logging.getLogger(__name__)

WINDOW = 64
# What a member queue receives: (stage id, update) or (stage id, error).
Item = tuple[str, "pb.MemberUpdate | ServiceError"]


class CohortStream:
    """One open Step stream to one stage replica."""

    def __init__(self, stage_id: str, endpoint: str, stub: stage_pb2_grpc.StageStub,
                 on_closed: Callable[[CohortStream, grpc.aio.AioRpcError | None], None]) -> None:
        self.stage_id = stage_id
        self.endpoint = endpoint
        self._stub = stub
        self._on_closed = on_closed
        self._out: asyncio.Queue[pb.StepRequest | None] = asyncio.Queue()
        self._members: dict[int, asyncio.Queue[Item]] = {}
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self.is_closed = False
        self.num_joined = 0

    @property
    def num_members(self) -> int:
        return len(self._members)

    def join(self, slot_id: int, sink: asyncio.Queue[Item]) -> None:
        """Add a PREPARED slot; its updates (and any failure) go to `sink`."""
        self._members[slot_id] = sink
        self.num_joined += 1
        if self._call is None:
            self._out.put_nowait(pb.StepRequest(join=[slot_id], credits=WINDOW))
            self._call = self._stub.Step(self._requests())
            self._reader = asyncio.get_running_loop().create_task(self._read())
        else:
            self._out.put_nowait(pb.StepRequest(join=[slot_id]))

    def leave(self, slot_id: int) -> None:
        self._members.pop(slot_id, None)

    async def close(self) -> None:
        self._out.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()

    async def _requests(self) -> AsyncIterator[pb.StepRequest]:
        while True:
            msg = await self._out.get()
            if msg is None:
                return
            yield msg

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for ev in self._call:
                self._out.put_nowait(pb.StepRequest(credits=1))
                for m in ev.members:
                    sink = self._members.get(m.slot_id)
                    if sink is not None:
                        sink.put_nowait((self.stage_id, m))
                        if m.status == pb.MEMBER_STATUS_ENDED:
                            self._members.pop(m.slot_id, None)
                for r in ev.refused:
                    sink = self._members.pop(r.slot_id, None)
                    if sink is not None:
                        sink.put_nowait((self.stage_id, error_for(
                            r.code, f"stage {self.stage_id} refused the join: {r.message}")))
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            pass
        self.is_closed = True
        self._out.put_nowait(None)  # the request generator returns instead of being torn down
        why = f"{error.code().name}: {error.details()}" if error else "the stream ended"
        for sid, sink in list(self._members.items()):
            sink.put_nowait((self.stage_id, Unavailable(
                f"stage {self.stage_id} replica {self.endpoint} failed mid-request ({why})")))
            log.warning("slot %d on %s lost: %s", sid, self.endpoint, why)
        self._members.clear()
        self._on_closed(self, error)
