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
        # What the next Step message carries. Joins and credits wait here and leave as one
        # message whenever the stream can take another write: a write waits for the one
        # before it, and 64 members returning credits every step as messages of their own
        # queued faster than they left, holding the stage's members for want of credit.
        self._joins: list[int] = []
        self._credits = 0
        self._member_credits: dict[int, int] = {}
        self._is_ending = False  # no message after what is pending
        self._has_pending = asyncio.Event()
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
        self._joins.append(slot_id)
        self._send(0, slot_id, MEMBER_WINDOW)
        if self._call is None:
            self._credits += WINDOW
            self._call = self._stub.Step(self._requests())
            self._reader = asyncio.get_running_loop().create_task(self._read())

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
            self._send(released, slot_id, credits)

    def leave(self, slot_id: int) -> None:
        """Stop routing `slot_id`'s updates (its run is over); stream credits kept for it go
        back."""
        member = self._members.pop(slot_id, None)
        if member is not None:
            self._release(member)

    async def close(self) -> None:
        self._end_requests()
        if self._reader is not None:
            self._reader.cancel()

    def _release(self, member: _Member) -> None:
        if member.held and not self.is_closed:
            self._send(member.held)
        member.held = 0

    def _send(self, credits: int, slot_id: int | None = None, member_credits: int = 0) -> None:
        """Add stream credits and one member's credits to the next message."""
        self._credits += credits
        if slot_id is not None and member_credits:
            self._member_credits[slot_id] = self._member_credits.get(slot_id, 0) + member_credits
        self._has_pending.set()

    def _end_requests(self) -> None:
        """The request stream ends once what is pending has left."""
        self._is_ending = True
        self._has_pending.set()

    async def _requests(self) -> AsyncIterator[pb.StepRequest]:
        """Everything pending as one message each time the stream takes a write; the stage
        applies a message's joins before its credits, so a member's window may come with
        its join."""
        while True:
            if not (self._joins or self._credits or self._member_credits):
                if self._is_ending:
                    return
                self._has_pending.clear()
                await self._has_pending.wait()
                continue
            msg = pb.StepRequest(join=self._joins, credits=self._credits, member_credits=[
                pb.MemberCredit(slot_id=sid, credits=n)
                for sid, n in self._member_credits.items()])
            self._joins, self._credits, self._member_credits = [], 0, {}
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
            self._send(1)
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
        self._end_requests()  # the request generator returns instead of being torn down
        why = f"{error.code().name}: {error.details()}" if error else "the stream ended"
        for sid, member in list(self._members.items()):
            member.sink.put((self.stage_id, Unavailable(
                f"stage {self.stage_id} replica {self.endpoint} failed mid-request ({why})")))
            log.warning("slot %d on %s lost: %s", sid, self.endpoint, why)
        self._members.clear()
        self._on_closed(self, error)
