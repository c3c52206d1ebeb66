"""One subscriber of the hidden port: its bounded buffer, its policy when the buffer is full,
and its shared-memory ring when it asked for that transport (made off the event loop)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from llm_runner_svc.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    RunnerError,
)
from llm_runner_svc.stage.hidden_messages import (
    MAX_INLINE_BYTES_PER_MESSAGE,
    MAX_STEPS_PER_MESSAGE,
    BatchMessage,
    PortMessage,
    StepsMessage,
    inline_bytes,
)
from llm_runner_svc.stage.shm_ring import ShmRing


@dataclass
class Subscriber:
    request_id: str | None  # None = every request
    policy: str
    buffer: int
    ring: ShmRing | None = None
    is_closed: bool = False
    error: RunnerError | None = None
    _items: deque[PortMessage] = field(default_factory=deque)
    _cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def put(self, item: PortMessage) -> None:
        async with self._cond:
            if len(self._items) >= self.buffer and not self.is_closed:
                if self.policy == "disconnect":
                    self._close(ResourceExhausted(
                        f"subscriber fell behind: {len(self._items)} messages unread (buffer "
                        f"{self.buffer}, policy disconnect)"))
                    return
                await self._cond.wait_for(lambda: len(self._items) < self.buffer
                                          or self.is_closed)
            if not self.is_closed:
                self._items.append(item)
                self._cond.notify_all()

    async def get(self) -> PortMessage | None:
        """The next message; None once closed and drained. Raises the closing error.
        Step batches that are already waiting come out together as one StepsMessage (up to
        MAX_STEPS_PER_MESSAGE steps and MAX_INLINE_BYTES_PER_MESSAGE tensor bytes), so a
        reader that lags pays the per-message cost once per backlog, not once per step."""
        async with self._cond:
            await self._cond.wait_for(lambda: bool(self._items) or self.is_closed)
            if self._items:
                item = self._items.popleft()
                if isinstance(item, BatchMessage) and self._items:
                    item = self._take_backlog(item)
                self._cond.notify_all()
                return item
        if self.error is not None:
            raise self.error
        return None

    async def close(self, error: RunnerError | None = None) -> None:
        async with self._cond:
            self._close(error)

    def _take_backlog(self, first: BatchMessage) -> BatchMessage | StepsMessage:
        steps, size = [first], inline_bytes(first)
        while self._items and len(steps) < MAX_STEPS_PER_MESSAGE:
            nxt = self._items[0]
            if not isinstance(nxt, BatchMessage):
                break
            size += inline_bytes(nxt)
            if size > MAX_INLINE_BYTES_PER_MESSAGE:
                break
            steps.append(nxt)
            self._items.popleft()
        return first if len(steps) == 1 else StepsMessage(tuple(steps))

    def _close(self, error: RunnerError | None) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.error = error
            self._cond.notify_all()


async def make_ring(capacity: int, is_faulted_in: bool) -> ShmRing:
    """A new ring, made on a worker thread (faulting its pages in takes tens of ms)."""
    made = asyncio.get_running_loop().run_in_executor(None, ShmRing, capacity, is_faulted_in)
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:  # the caller left: the ring, once made, is not leaked
        made.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                               else f.result().close())
        raise


def check_subscribe(has_hidden_port: bool, request_id: str | None, port: str) -> None:
    """Subscribe's own checks: the port exists here and the target is named."""
    if port != "hidden":
        raise InvalidArgument(f"port {port!r} cannot be subscribed to (only 'hidden')")
    if not has_hidden_port:
        raise FailedPrecondition("this deployment declares no hidden port (add 'hidden' to "
                                 "emits)")
    if request_id == "":
        raise InvalidArgument("Subscribe needs a request_id or all_requests")
