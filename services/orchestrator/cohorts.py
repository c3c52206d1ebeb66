"""Cohort streams: one Step stream per (replica, route fingerprint), shared by every request
with that fingerprint. A request joins the open stream (it enters the stage's batch at the next
step boundary) and receives its member updates in its own UpdateBuffer.

Flow control has two levels. The stream's credit goes back as soon as an event arrives, so the
orchestrator never holds a stage's decode loop for all its members. Each member gets a window
of its own (MEMBER_WINDOW events with tokens, granted in the message that joins it); its
credits go back only as the request's reader takes its updates (`grant`), so a caller that
reads slowly holds its own member on the stage while the others go on, and the orchestrator
buffers at most a window per member (plus the ending update). A stage that does not honour
member windows is bounded by the stream's window instead: the credit of an event that leaves a
member's buffer over its window is kept until that member's reader catches up (or it leaves).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc
from services.errors import Unavailable, error_for
from services.orchestrator.updates import UpdateBuffer, spends_credit

log = logging.getLogger(__name__)

WINDOW = 64  # the stream's window; its credits come back at once
# A member's window, in events with tokens. Each read of a lagging caller gathers everything
# waiting into one delta and returns its credits at once, so 16 keeps a reader that keeps up
# from ever holding its member (the credit's round trip is far shorter than 16 decode steps)
# while the orchestrator holds at most 16 steps' tokens for a caller that stopped reading.
MEMBER_WINDOW = 16


@dataclass
class _Member:
    sink: UpdateBuffer
    credits: int = MEMBER_WINDOW  # what the stage still holds for it, as far as we know
    held: int = 0  # stream credits kept while its buffer was over its window


class CohortStream:
    """One open Step stream to one stage replica."""

    def __init__(self, stage_id: str, endpoint: str, stub: stage_pb2_grpc.StageStub,
                 on_closed: Callable[[CohortStream, grpc.aio.AioRpcError | None], None]) -> None:
        self.stage_id = stage_id
        self.endpoint = endpoint
        self._stub = stub
        self._on_closed = on_closed
        self._out: asyncio.Queue[pb.StepRequest | None] = asyncio.Queue()
        self._members: dict[int, _Member] = {}
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self.is_closed = False
        self.num_joined = 0

    @property
    def num_members(self) -> int:
        return len(self._members)

    def join(self, slot_id: int, sink: UpdateBuffer) -> None:
        """Add a PREPARED slot with a full member window; its updates (and any failure) go
        to `sink`."""
        self._members[slot_id] = _Member(sink)
        self.num_joined += 1
        window = [pb.MemberCredit(slot_id=slot_id, credits=MEMBER_WINDOW)]
        if self._call is None:
            self._out.put_nowait(pb.StepRequest(join=[slot_id], credits=WINDOW,
                                                member_credits=window))
            self._call = self._stub.Step(self._requests())
            self._reader = asyncio.get_running_loop().create_task(self._read())
        else:
            self._out.put_nowait(pb.StepRequest(join=[slot_id], member_credits=window))

    def grant(self, slot_id: int, consumed: int) -> None:
        """The reader of `slot_id` took `consumed` updates that spent a credit: give them back
        (never past a full window), with any stream credit kept for it, in one message."""
        member = self._members.get(slot_id)
        if member is None or self.is_closed:
            return
        credits = min(consumed, MEMBER_WINDOW - member.credits)
        member.credits += credits
        released = 0
        if member.sink.num_waiting(self.stage_id) <= MEMBER_WINDOW:
            released, member.held = member.held, 0
        if credits or released:
            self._out.put_nowait(pb.StepRequest(credits=released, member_credits=[
                pb.MemberCredit(slot_id=slot_id, credits=credits)] if credits else []))

    def leave(self, slot_id: int) -> None:
        """Stop routing `slot_id`'s updates (its run is over); stream credits kept for it go
        back."""
        member = self._members.pop(slot_id, None)
        if member is not None:
            self._release(member)

    async def close(self) -> None:
        self._out.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()

    def _release(self, member: _Member) -> None:
        if member.held and not self.is_closed:
            self._out.put_nowait(pb.StepRequest(credits=member.held))
        member.held = 0

    async def _requests(self) -> AsyncIterator[pb.StepRequest]:
        while True:
            msg = await self._out.get()
            if msg is None:
                return
            yield msg

    def _route(self, ev: pb.StepEvent) -> None:
        """One event's updates and refusals to their members; its stream credit goes back
        unless a member's buffer is now over its window."""
        over: _Member | None = None
        for m in ev.members:
            member = self._members.get(m.slot_id)
            if member is None:
                continue
            if spends_credit(m):
                member.credits = max(0, member.credits - 1)
            member.sink.put((self.stage_id, m))
            if m.status == pb.MEMBER_STATUS_ENDED:
                self.leave(m.slot_id)
            elif over is None and member.sink.num_waiting(self.stage_id) > MEMBER_WINDOW:
                over = member
        for r in ev.refused:
            member = self._members.pop(r.slot_id, None)
            if member is not None:
                self._release(member)
                member.sink.put((self.stage_id, error_for(
                    r.code, f"stage {self.stage_id} refused the join: {r.message}")))
        if over is None:
            self._out.put_nowait(pb.StepRequest(credits=1))
        else:
            over.held += 1

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for ev in self._call:
                self._route(ev)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            pass
        self.is_closed = True
        self._out.put_nowait(None)  # the request generator returns instead of being torn down
        why = f"{error.code().name}: {error.details()}" if error else "the stream ended"
        for sid, member in list(self._members.items()):
            member.sink.put((self.stage_id, Unavailable(
                f"stage {self.stage_id} replica {self.endpoint} failed mid-request ({why})")))
            log.warning("slot %d on %s lost: %s", sid, self.endpoint, why)
        self._members.clear()
        self._on_closed(self, error)
