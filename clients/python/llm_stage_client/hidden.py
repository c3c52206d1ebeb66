"""Consumer side of a stage's hidden-state port, over gRPC bytes or shared memory.

    for msg in subscribe_hidden("127.0.0.1:50051", request_id="r1"):
        if isinstance(msg, HiddenWindow): use(msg.states)   # np.ndarray [n, hidden]
        else: print(msg.finish_reason)                       # PortEnd: the last message

Messages come in order with their per-request `seq`; with shared memory the arrays are copies
taken before the ring space is released, so they stay valid.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import grpc
import numpy as np

from services.contract.llmstage.v1 import stage_pb2 as pb
from services.contract.llmstage.v1 import stage_pb2_grpc, tensor_pb2

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
class PortEnd:
    request_id: str
    seq: int
    finish_reason: str  # "max_length", "cancelled", ...
    error: str


def decode_tensor(dtype: int, shape: tuple[int, ...], data: bytes | memoryview) -> np.ndarray:
    """A Tensor's bytes as an array (a copy); bfloat16 widens to float32 exactly."""
    if dtype == tensor_pb2.DTYPE_BFLOAT16:
        raw = np.frombuffer(data, np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    if dtype not in _NP_DTYPES:
        raise ValueError(f"unsupported tensor dtype {dtype}")
    return np.frombuffer(data, _NP_DTYPES[dtype]).reshape(shape).copy()


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
                     timeout: float | None = None,
                     channel: grpc.Channel | None = None) -> Iterator[HiddenWindow | PortEnd]:
    """Subscribe to one request (or, with request_id None, every request) of the stage."""
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
                continue
            if kind == "region":
                ring = _Ring(outer.region.name)
                continue
            if outer.HasField("batch"):
                yield from _decode_block(outer.batch.decode_rows, ring)
                for ev in outer.batch.events:
                    yield from _decode(ev, ring, release=False)
                if ring is not None:
                    ring.release_all()
            else:
                yield from _decode(outer, ring)
    finally:
        if ring is not None:
            ring.close()
        if own:
            ch.close()


def _decode_block(block: pb.HiddenBlock, ring: _Ring | None) -> Iterator[HiddenWindow]:
    if not block.request_ids:
        return
    shape = tuple(block.states.shape)
    if ring is not None and block.HasField("states_shm"):
        emb = decode_tensor(block.embeddings.dtype, shape, ring.read(block.embeddings_shm))
        st = decode_tensor(block.states.dtype, shape, ring.read(block.states_shm))
        ring.seen(block.states_shm)
    else:
        emb = decode_tensor(block.embeddings.dtype, shape, block.embeddings.data)
        st = decode_tensor(block.states.dtype, shape, block.states.data)
    for i, rid in enumerate(block.request_ids):
        yield HiddenWindow(rid, block.seqs[i], block.positions[i], (block.token_ids[i],),
                           emb[i:i + 1], st[i:i + 1], False)


def _decode(ev: pb.SubscribeEvent, ring: _Ring | None,
            release: bool = True) -> Iterator[HiddenWindow | PortEnd]:
    kind = ev.WhichOneof("payload")
    if kind == "end":
        yield PortEnd(ev.request_id, ev.seq,
                      pb.FinishReason.Name(ev.end.finish_reason)[14:].lower(),
                      ev.end.error)
    elif kind == "hidden":
        h = ev.hidden
        shape = tuple(h.states.shape)
        if ring is not None and h.HasField("states_shm"):
            emb = decode_tensor(h.embeddings.dtype, shape, ring.read(h.embeddings_shm))
            st = decode_tensor(h.states.dtype, shape, ring.read(h.states_shm))
            ring.seen(h.states_shm)
            if release:
                ring.release_all()
        else:
            emb = decode_tensor(h.embeddings.dtype, shape, h.embeddings.data)
            st = decode_tensor(h.states.dtype, shape, h.states.data)
        yield HiddenWindow(ev.request_id, ev.seq, h.start_position, tuple(h.token_ids),
                           emb, st, h.is_prefill)
