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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llm_runner_svc.errors import ResourceExhausted
from llm_runner_svc.stage.hidden_messages import (
    BatchMessage,
    BlockMessage,
    EndMessage,
    HiddenMessage,
    RegionMessage,
    TensorBytes,
    raw,
)
from llm_runner_svc.stage.shm_budget import ShmBudget, max_payload_bytes
from llm_runner_svc.stage.subscriber import Subscriber, make_ring

log = logging.getLogger(__name__)

POLICIES = ("block", "disconnect")
_SHM_POLL_S = 0.0002


@dataclass
class _Columns:
    """Decode rows column by column; the arrays are the engine's, unchanged until flush_step."""

    request_ids: list[str] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    embeddings: list[np.ndarray] = field(default_factory=list)
    states: list[np.ndarray] = field(default_factory=list)

    def extend(self, other: _Columns) -> None:
        self.request_ids += other.request_ids
        self.seqs += other.seqs
        self.positions += other.positions
        self.token_ids += other.token_ids
        self.embeddings += other.embeddings
        self.states += other.states


@dataclass
class _StepBatch:
    """A whole-stage subscriber's share of one step."""

    sub: Subscriber
    messages: list[HiddenMessage | EndMessage] = field(default_factory=list)
    rows: _Columns = field(default_factory=_Columns)
    dtype: str = ""
    width: int = 0

    def add_rows(self, cols: _Columns, dtype: str, width: int) -> None:
        if self.rows.request_ids and (dtype, width) != (self.dtype, self.width):
            raise ValueError(f"a step mixes {self.dtype}[{self.width}] and {dtype}[{width}] "
                             "decode rows")
        self.dtype, self.width = dtype, width
        self.rows.extend(cols)


class HiddenPublisher:
    """Fans the hidden port out to subscribers. Runs on the event loop thread."""

    def __init__(self, policy: str, buffer: int, max_message_bytes: int,
                 shm: ShmBudget) -> None:
        self.policy = policy
        self.buffer = buffer
        self.max_payload_bytes = max_payload_bytes(max_message_bytes)
        self.shm = shm
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
            block = await self._block(batch) if batch.rows.request_ids else None
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
        """The step's rows stacked: one copy into the ring, or one into the message."""
        rows = batch.rows
        shape = (len(rows.request_ids), batch.width)
        e, s = await self._tensors(batch.sub, rows.embeddings, rows.states, shape, batch.dtype)
        return BlockMessage(tuple(rows.request_ids), tuple(rows.seqs), tuple(rows.positions),
                            tuple(rows.token_ids), e, s)

    async def subscribe(self, request_id: str | None, use_shm: bool,
                        is_started: bool = True) -> Subscriber:
        """Register a subscriber; with shared memory its ring is made (and its pages faulted
        in, tens of ms for a large ring) on a worker thread, off the event loop, within the
        stage's shared-memory budget (ResourceExhausted beyond it). The ring of a request
        that has not started (`is_started` False) is faulted in by `request_started`."""
        ring = None
        if use_shm:
            self.shm.reserve()
            try:
                ring = await make_ring(self.shm.ring_bytes,
                                        is_started or request_id is None)
            except BaseException:
                self.shm.release()
                raise
        sub = Subscriber(request_id, self.policy, self.buffer, ring)
        if sub.ring is not None:
            sub._items.append(RegionMessage(sub.ring.name, sub.ring.size))
        if request_id is None:
            self._all.append(sub)
        else:
            self._by_request.setdefault(request_id, []).append(sub)
        return sub

    def request_started(self, request_id: str) -> None:
        """Fault in the rings of the request's subscribers that came before it existed."""
        for sub in self._by_request.get(request_id, ()):
            if sub.ring is not None:
                sub.ring.start_fault_in()

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
            self.shm.release()

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
            emb, st = raw(embeddings[lo:hi]), raw(states[lo:hi])
            self.num_bytes_published += emb.nbytes + st.nbytes
            self.num_messages_published += 1
            shape = (hi - lo, hidden)
            for sub in subs:
                if sub.is_closed:
                    continue
                batch = self._batch(sub)
                if batch is not None and hi - lo == 1 and not is_prefill:
                    batch.add_rows(_Columns([request_id], [seq], [start_position + lo],
                                            [token_ids[lo]], [emb], [st]),
                                   states.dtype.name, hidden)
                    continue
                e, s = await self._tensors(sub, [emb], [st], shape, states.dtype.name)
                await self._deliver(sub, HiddenMessage(
                    request_id, seq, start_position + lo, tuple(token_ids[lo:hi]), e, s,
                    is_prefill))

    async def publish_rows(self, rows: list[tuple[str, int, int, Any, Any]]) -> None:
        """One decode step's single-row windows: (request_id, position, token_id,
        embeddings [1, hidden], states [1, hidden]). Whole-stage subscribers get them stacked
        in the step's block; per-request subscribers one message each."""
        seqs = [self._next_seq(r[0]) for r in rows]  # counted with nobody listening
        if not rows or not (self._all or self._by_request):
            return
        first = rows[0][4]
        dtype, width = first.dtype.name, first.shape[1]
        if any(r[3].shape != (1, width) or r[4].shape != (1, width) for r in rows):
            raise ValueError(f"decode rows must all be [1, {width}]")
        cols = _Columns([r[0] for r in rows], seqs, [r[1] for r in rows],
                        [r[2] for r in rows], [raw(r[3]) for r in rows],
                        [raw(r[4]) for r in rows])
        self.num_bytes_published += 2 * len(rows) * width * first.dtype.itemsize
        self.num_messages_published += len(rows)
        for sub in self._all:
            batch = self._batch(sub)
            if sub.is_closed:
                continue
            if batch is not None:
                batch.add_rows(cols, dtype, width)
                continue
            for i, rid in enumerate(cols.request_ids):
                await self._deliver_row(sub, rid, seqs[i], cols.positions[i],
                                        cols.token_ids[i], cols.embeddings[i], cols.states[i],
                                        dtype, width)
        for i, rid in enumerate(cols.request_ids):
            for sub in self._by_request.get(rid, ()):
                await self._deliver_row(sub, rid, seqs[i], cols.positions[i], cols.token_ids[i],
                                        cols.embeddings[i], cols.states[i], dtype, width)

    async def _deliver_row(self, sub: Subscriber, rid: str, seq: int, pos: int, tok: int,
                           emb: np.ndarray, st: np.ndarray, dtype: str,
                           width: int) -> None:
        if sub.is_closed:
            return
        e, s = await self._tensors(sub, [emb], [st], (1, width), dtype)
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

    async def _tensors(self, sub: Subscriber, emb: Sequence[np.ndarray],
                       st: Sequence[np.ndarray], shape: tuple[int, ...], dtype: str
                       ) -> tuple[TensorBytes, TensorBytes]:
        """Embeddings and states for `sub`, each given as back-to-back parts: copied into its
        ring, or joined into the bytes a message carries."""
        if sub.ring is None:
            return (TensorBytes(dtype, shape, b"".join([p.data for p in emb])),
                    TensorBytes(dtype, shape, b"".join([p.data for p in st])))
        return await self._to_ring(sub, emb, st, shape, dtype)

    async def _to_ring(self, sub: Subscriber, emb: Sequence[np.ndarray],
                       st: Sequence[np.ndarray], shape: tuple[int, ...],
                       dtype: str) -> tuple[TensorBytes, TensorBytes]:
        ring = sub.ring
        assert ring is not None
        await ring.ready()
        out = []
        for parts in (emb, st):
            length = sum(p.nbytes for p in parts)
            while (start := ring.reserve(length)) is None:
                if sub.policy == "disconnect":
                    await sub.close(ResourceExhausted(
                        f"shared-memory subscriber fell behind: ring of {ring.capacity} bytes "
                        "full (policy disconnect)"))
                    return TensorBytes(dtype, shape, None), TensorBytes(dtype, shape, None)
                await asyncio.sleep(_SHM_POLL_S)
                if sub.is_closed or sub.ring is not ring:  # gone while we waited
                    return TensorBytes(dtype, shape, None), TensorBytes(dtype, shape, None)
            ring.write(start, parts)
            out.append(TensorBytes(dtype, shape, None, start, length))
        return out[0], out[1]
