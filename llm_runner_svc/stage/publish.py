"""The hidden-state port: subscriptions, per-request sequence numbers, chunking under the
message limit, backpressure, and the shared-memory transport.

Per request a subscriber receives the prefill window (maybe in several chunks), one message per
decode step, then an end message (also on cancel and error). Every subscriber has a bounded
buffer and the port's declared policy for a full one: `block` holds the producer (the stage's
decode loop) until there is room, so nothing is lost; `disconnect` ends that subscription with
RESOURCE_EXHAUSTED naming the lag. Nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from llm_runner_svc.errors import ResourceExhausted, RunnerError
from llm_runner_svc.stage.shm_ring import ShmRing

log = logging.getLogger(__name__)

POLICIES = ("block", "disconnect")
_SHM_POLL_S = 0.0002


@dataclass(frozen=True)
class TensorBytes:
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]
    data: bytes | None  # None when the bytes are in the ring at (offset, length)
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class HiddenMessage:
    request_id: str
    seq: int
    start_position: int
    token_ids: tuple[int, ...]
    embeddings: TensorBytes
    states: TensorBytes
    is_prefill: bool


@dataclass(frozen=True)
class EndMessage:
    request_id: str
    seq: int
    finish_reason: str
    error: str


@dataclass(frozen=True)
class RegionMessage:
    name: str
    size: int


@dataclass(frozen=True)
class BlockMessage:
    """Every single-row decode window of one step, rows stacked: [rows, hidden]."""

    request_ids: tuple[str, ...]
    seqs: tuple[int, ...]
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    embeddings: TensorBytes
    states: TensorBytes


@dataclass(frozen=True)
class BatchMessage:
    """One decode step's messages for a subscription to every request."""

    messages: tuple[HiddenMessage | EndMessage, ...]
    block: BlockMessage | None = None


@dataclass
class _Row:
    request_id: str
    seq: int
    position: int
    token_id: int
    embeddings: bytes
    states: bytes


@dataclass
class _StepBatch:
    sub: Subscriber
    messages: list[HiddenMessage | EndMessage] = field(default_factory=list)
    rows: list[_Row] = field(default_factory=list)
    dtype: str = ""
    width: int = 0


PortMessage = HiddenMessage | EndMessage | RegionMessage | BatchMessage


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
        """The next message; None once closed and drained. Raises the closing error."""
        async with self._cond:
            await self._cond.wait_for(lambda: bool(self._items) or self.is_closed)
            if self._items:
                item = self._items.popleft()
                self._cond.notify_all()
                return item
        if self.error is not None:
            raise self.error
        return None

    async def close(self, error: RunnerError | None = None) -> None:
        async with self._cond:
            self._close(error)

    def _close(self, error: RunnerError | None) -> None:
        if not self.is_closed:
            self.is_closed = True
            self.error = error
            self._cond.notify_all()


class HiddenPublisher:
    """Fans the hidden port out to subscribers. Runs on the event loop thread."""

    def __init__(self, policy: str, buffer: int, max_message_bytes: int,
                 shm_ring_bytes: int) -> None:
        self.policy = policy
        self.buffer = buffer
        self.max_payload_bytes = max(4096, int(max_message_bytes * 0.9) - 4096)
        self.shm_ring_bytes = shm_ring_bytes
        self._by_request: dict[str, list[Subscriber]] = {}
        self._all: list[Subscriber] = []
        self.num_bytes_published = 0
        self.num_messages_published = 0
        self._step: dict[int, _StepBatch] | None = None
        self._seqs: dict[str, int] = {}  # per request: messages published so far

    def _next_seq(self, request_id: str) -> int:
        seq = self._seqs.get(request_id, 0)
        self._seqs[request_id] = seq + 1
        return seq

    @property
    def max_lag(self) -> int:
        """Messages queued for the furthest-behind subscriber."""
        subs = [*self._all, *(s for v in self._by_request.values() for s in v)]
        return max((len(s._items) for s in subs), default=0)

    @property
    def num_subscriptions(self) -> int:
        return len(self._all) + sum(len(v) for v in self._by_request.values())

    def begin_step(self) -> None:
        """From here to `flush_step`, whole-stage subscribers collect one batch."""
        self._step = {}

    async def flush_step(self) -> None:
        step, self._step = self._step, None
        for batch in (step or {}).values():
            block = await self._block(batch) if batch.rows else None
            if not batch.sub.is_closed:
                await batch.sub.put(BatchMessage(tuple(batch.messages), block))

    def _batch(self, sub: Subscriber) -> _StepBatch | None:
        if sub.request_id is not None or self._step is None:
            return None
        return self._step.setdefault(id(sub), _StepBatch(sub))

    async def _deliver(self, sub: Subscriber, msg: HiddenMessage | EndMessage) -> None:
        batch = self._batch(sub)
        if batch is not None:
            batch.messages.append(msg)
        else:
            await sub.put(msg)

    async def _block(self, batch: _StepBatch) -> BlockMessage:
        rows = batch.rows
        shape = (len(rows), batch.width)
        emb = b"".join(r.embeddings for r in rows)
        st = b"".join(r.states for r in rows)
        if batch.sub.ring is not None:
            e, s = await self._to_ring(batch.sub, emb, st, shape, batch.dtype)
        else:
            e = TensorBytes(batch.dtype, shape, emb)
            s = TensorBytes(batch.dtype, shape, st)
        return BlockMessage(tuple(r.request_id for r in rows), tuple(r.seq for r in rows),
                            tuple(r.position for r in rows), tuple(r.token_id for r in rows),
                            e, s)

    def subscribe(self, request_id: str | None, use_shm: bool) -> Subscriber:
        sub = Subscriber(request_id, self.policy, self.buffer,
                         ShmRing(self.shm_ring_bytes) if use_shm else None)
        if sub.ring is not None:
            sub._items.append(RegionMessage(sub.ring.name, sub.ring.size))
        if request_id is None:
            self._all.append(sub)
        else:
            self._by_request.setdefault(request_id, []).append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub.request_id is None:
            if sub in self._all:
                self._all.remove(sub)
        else:
            subs = self._by_request.get(sub.request_id, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._by_request.pop(sub.request_id, None)
        if sub.ring is not None:
            sub.ring.close()
            sub.ring = None

    def _subscribers(self, request_id: str) -> list[Subscriber]:
        return [*self._by_request.get(request_id, ()), *self._all]

    async def publish(self, request_id: str, start_position: int, token_ids: list[int],
                      embeddings: Any, states: Any, is_prefill: bool) -> None:
        """One window [n, hidden] of one request, in chunks under the message limit."""
        subs = self._subscribers(request_id)
        n, hidden = states.shape
        row_bytes = 2 * hidden * states.dtype.itemsize
        step = max(1, min(n, self.max_payload_bytes // row_bytes))
        for lo in range(0, n, step):
            seq = self._next_seq(request_id)  # counted even with nobody listening
            if not subs:
                continue
            hi = min(n, lo + step)
            emb, st = embeddings[lo:hi].tobytes(), states[lo:hi].tobytes()
            self.num_bytes_published += len(emb) + len(st)
            self.num_messages_published += 1
            shape = (hi - lo, hidden)
            for sub in subs:
                if sub.is_closed:
                    continue
                batch = self._batch(sub)
                if batch is not None and hi - lo == 1 and not is_prefill:
                    batch.dtype, batch.width = states.dtype.name, hidden
                    batch.rows.append(_Row(request_id, seq, start_position + lo,
                                           token_ids[lo], emb, st))
                    continue
                if sub.ring is not None:
                    e, s = await self._to_ring(sub, emb, st, shape, states.dtype.name)
                else:
                    e = TensorBytes(states.dtype.name, shape, emb)
                    s = TensorBytes(states.dtype.name, shape, st)
                await self._deliver(sub, HiddenMessage(
                    request_id, seq, start_position + lo, tuple(token_ids[lo:hi]), e, s,
                    is_prefill))

    async def publish_rows(self, rows: list[tuple[str, int, int, Any, Any]]) -> None:
        """One decode step's single-row windows: (request_id, position, token_id,
        embeddings [1, hidden], states [1, hidden]). Whole-stage subscribers get them stacked
        in the step's block; per-request subscribers one message each."""
        seqs = {rid: self._next_seq(rid) for rid, *_ in rows}  # counted with nobody listening
        if not rows or not (self._all or self._by_request):
            return
        encoded = []
        for rid, pos, tok, emb, st in rows:
            e, s = emb.tobytes(), st.tobytes()
            encoded.append((rid, pos, tok, e, s))
            self.num_bytes_published += len(e) + len(s)
        self.num_messages_published += len(rows)
        dtype, width = rows[0][4].dtype.name, rows[0][4].shape[1]
        for sub in self._all:
            batch = self._batch(sub)
            if sub.is_closed:
                continue
            if batch is None:
                for rid, pos, tok, e, s in encoded:
                    await self._deliver_row(sub, rid, seqs[rid], pos, tok, e, s, dtype,
                                            width)
                continue
            batch.dtype, batch.width = dtype, width
            batch.rows.extend(_Row(rid, seqs[rid], pos, tok, e, s)
                              for rid, pos, tok, e, s in encoded)
        for rid, pos, tok, e, s in encoded:
            for sub in self._by_request.get(rid, ()):
                await self._deliver_row(sub, rid, seqs[rid], pos, tok, e, s, dtype, width)

    async def _deliver_row(self, sub: Subscriber, rid: str, seq: int, pos: int, tok: int,
                           emb: bytes, st: bytes, dtype: str, width: int) -> None:
        if sub.is_closed:
            return
        shape = (1, width)
        if sub.ring is not None:
            e, s = await self._to_ring(sub, emb, st, shape, dtype)
        else:
            e, s = TensorBytes(dtype, shape, emb), TensorBytes(dtype, shape, st)
        await sub.put(HiddenMessage(rid, seq, pos, (tok,), e, s, False))

    async def end(self, request_id: str, finish_reason: str, error: str | None) -> None:
        """The terminal message of a request; a per-request subscription then completes."""
        seq = self._next_seq(request_id)
        self._seqs.pop(request_id, None)
        for sub in self._subscribers(request_id):
            await self._deliver(sub, EndMessage(request_id, seq, finish_reason, error or ""))
            if sub.request_id is not None:
                await sub.close()

    async def close(self) -> None:
        for sub in [*self._all, *(s for subs in self._by_request.values() for s in subs)]:
            await sub.close(None)

    async def _to_ring(self, sub: Subscriber, emb: bytes, st: bytes, shape: tuple[int, ...],
                       dtype: str) -> tuple[TensorBytes, TensorBytes]:
        ring = sub.ring
        assert ring is not None
        out = []
        for data in (emb, st):
            while (start := ring.reserve(len(data))) is None:
                if sub.policy == "disconnect":
                    await sub.close(ResourceExhausted(
                        f"shared-memory subscriber fell behind: ring of {ring.capacity} bytes "
                        "full (policy disconnect)"))
                    return TensorBytes(dtype, shape, None), TensorBytes(dtype, shape, None)
                if sub.is_closed:
                    return TensorBytes(dtype, shape, None), TensorBytes(dtype, shape, None)
                await asyncio.sleep(_SHM_POLL_S)
            ring.write(start, data)
            out.append(TensorBytes(dtype, shape, None, start, len(data)))
        return out[0], out[1]
