"""Consumer side of a stage's hidden-state port, over gRPC bytes or shared memory.

    for msg in subscribe_hidden("127.0.0.1:50051", request_id="r1"):
        if isinstance(msg, HiddenWindow): use(msg.states)   # np.ndarray [n, hidden]
        else: print(msg.finish_reason)                       # PortEnd: the last message

Messages come in order with their per-request `seq`. Arrays decoded from gRPC bytes are
read-only views of the received message; with shared memory they are copies taken before the
ring space is released, so either stays valid. A subscription to every request can ask for
`blocks=True`: each decode step's single-row windows then come as one HiddenBlock
([rows, hidden] arrays) instead of one HiddenWindow per row. `widen=False` keeps bfloat16 as
its bits (np.uint16) instead of widening it to float32.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import grpc
import numpy as np

from llm_stage_client._contract.llmstage.v1 import stage_pb2 as pb
from llm_stage_client._contract.llmstage.v1 import stage_pb2_grpc, tensor_pb2

_HEADER = 64
_NP_DTYPES: dict[int, type] = {
    tensor_pb2.DTYPE_FLOAT32: np.float32, tensor_pb2.DTYPE_FLOAT16: np.float16,
    tensor_pb2.DTYPE_INT32: np.int32, tensor_pb2.DTYPE_INT64: np.int64,
    tensor_pb2.DTYPE_UINT8: np.uint8}


@dataclass(frozen=True)
class HiddenWindow:
    request_id: str
    seq: int
    start_position: int
    token_ids: tuple[int, ...]
    embeddings: np.ndarray  # [n, hidden], float32 (bf16 widened) or the sent dtype
    states: np.ndarray
    is_prefill: bool


@dataclass(frozen=True)
class HiddenBlock:
    """One decode step's single-row windows stacked: row i belongs to request_ids[i]."""

    request_ids: tuple[str, ...]
    seqs: tuple[int, ...]
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    embeddings: np.ndarray  # [rows, hidden]
    states: np.ndarray

    def windows(self) -> Iterator[HiddenWindow]:
        """The rows as HiddenWindows (views of the block's arrays)."""
        for i, rid in enumerate(self.request_ids):
            yield HiddenWindow(rid, self.seqs[i], self.positions[i], (self.token_ids[i],),
                               self.embeddings[i:i + 1], self.states[i:i + 1], False)


@dataclass(frozen=True)
class PortEnd:
    request_id: str
    seq: int
    finish_reason: str  # "max_length", "cancelled", ...
    error: str


def decode_tensor(dtype: int, shape: tuple[int, ...], data: bytes | memoryview, *,
                  widen: bool = True, copy: bool = True) -> np.ndarray:
    """A Tensor's bytes as an array: a copy, or with copy=False a read-only view of `data`.
    bfloat16 widens to float32 exactly, or with widen=False stays as its bits (uint16)."""
    if dtype == tensor_pb2.DTYPE_BFLOAT16:
        bits = np.frombuffer(data, np.uint16).reshape(shape)
        if not widen:
            return bits.copy() if copy else bits
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype not in _NP_DTYPES:
        raise ValueError(f"unsupported tensor dtype {dtype}")
    out: np.ndarray = np.frombuffer(data, _NP_DTYPES[dtype]).reshape(shape)
    return out.copy() if copy else out


class _Ring:
    def __init__(self, name: str) -> None:
        self.shm = shared_memory.SharedMemory(name)
        # The producer owns the segment; keep Python's tracker from unlinking it at our exit.
        resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        buf = self.shm.buf
        assert buf is not None
        self.buf = buf
        self.capacity = struct.unpack_from("<Q", buf, 0)[0]
        self._end = 0
        # Touch a byte of every page now, so reads on the stream take no first-touch faults.
        np.frombuffer(buf, np.uint8)[_HEADER::4096].sum()

    def read(self, sl: pb.ShmSlice) -> memoryview:
        at = _HEADER + sl.offset % self.capacity
        return self.buf[at:at + sl.length]

    def seen(self, sl: pb.ShmSlice) -> None:
        self._end = max(self._end, sl.offset + sl.length)

    def release_all(self) -> None:
        """Hand every slice seen so far back to the producer."""
        struct.pack_into("<Q", self.buf, 16, self._end)

    def close(self) -> None:
        self.buf.release()
        self.shm.close()


def subscribe_hidden(target: str, request_id: str | None = None, *, shared_memory: bool = False,
                     timeout: float | None = None, channel: grpc.Channel | None = None,
                     blocks: bool = False, widen: bool = True,
                     on_subscribed: Callable[[], None] | None = None
                     ) -> Iterator[HiddenWindow | HiddenBlock | PortEnd]:
    """Subscribe to one request (or, with request_id None, every request) of the stage.
    HiddenBlocks come only with blocks=True (see the module docstring). `on_subscribed` is
    called when the stage acknowledges the subscription: from then on nothing it publishes
    for the request is missed, so a caller may start the request."""
    dec = _Decoder(widen)
    own = channel is None
    ch = channel or grpc.insecure_channel(target, options=[
        ("grpc.max_receive_message_length", 256 << 20)])
    req = pb.SubscribeRequest(port="hidden", transport=pb.TRANSPORT_SHARED_MEMORY
                              if shared_memory else pb.TRANSPORT_GRPC_BYTES)
    if request_id is None:
        req.all_requests = True
    else:
        req.request_id = request_id
    ring: _Ring | None = None
    try:
        for outer in stage_pb2_grpc.StageStub(ch).Subscribe(req, timeout=timeout):
            kind = outer.WhichOneof("payload")
            if kind == "subscribed":
                if on_subscribed is not None:
                    on_subscribed()
                continue
            if kind == "region":
                ring = _Ring(outer.region.name)
                continue
            if kind in ("batch", "steps"):
                for step in [outer.batch] if kind == "batch" else outer.steps.steps:
                    block = dec.block(step.decode_rows, ring)
                    if block is not None and blocks:
                        yield block
                    elif block is not None:
                        yield from block.windows()
                    for ev in step.events:
                        yield from dec.event(ev, ring, release=False)
                    if ring is not None:
                        ring.release_all()
            else:
                yield from dec.event(outer, ring)
    finally:
        if ring is not None:
            ring.close()
        if own:
            ch.close()


class _Decoder:
    def __init__(self, widen: bool) -> None:
        self.widen = widen

    def tensors(self, h: pb.HiddenStates | pb.HiddenBlock, ring: _Ring | None
                ) -> tuple[np.ndarray, np.ndarray]:
        shape = tuple(h.states.shape)
        if ring is not None and h.HasField("states_shm"):
            emb = decode_tensor(h.embeddings.dtype, shape, ring.read(h.embeddings_shm),
                                widen=self.widen)
            st = decode_tensor(h.states.dtype, shape, ring.read(h.states_shm),
                               widen=self.widen)
            ring.seen(h.states_shm)
            return emb, st
        return (decode_tensor(h.embeddings.dtype, shape, h.embeddings.data, widen=self.widen,
                              copy=False),
                decode_tensor(h.states.dtype, shape, h.states.data, widen=self.widen,
                              copy=False))

    def block(self, b: pb.HiddenBlock, ring: _Ring | None) -> HiddenBlock | None:
        if not b.request_ids:
            return None
        emb, st = self.tensors(b, ring)
        return HiddenBlock(tuple(b.request_ids), tuple(b.seqs), tuple(b.positions),
                           tuple(b.token_ids), emb, st)

    def event(self, ev: pb.SubscribeEvent, ring: _Ring | None,
              release: bool = True) -> Iterator[HiddenWindow | PortEnd]:
        kind = ev.WhichOneof("payload")
        if kind == "end":
            yield PortEnd(ev.request_id, ev.seq,
                          pb.FinishReason.Name(ev.end.finish_reason)[14:].lower(),
                          ev.end.error)
        elif kind == "hidden":
            h = ev.hidden
            emb, st = self.tensors(h, ring)
            if ring is not None and release:
                ring.release_all()
            yield HiddenWindow(ev.request_id, ev.seq, h.start_position, tuple(h.token_ids),
                               emb, st, h.is_prefill)
