"""The hidden-state port's messages as the stage hands them to the wire: tensors as raw bytes
(or a shared-memory region), one message per request window, a step's batch for a whole-stage
subscriber, and consecutive steps coalesced for a reader that fell behind."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np


class WireArray:
    """Rows whose wire dtype numpy cannot name (bfloat16), held as same-width integers:
    `WireArray(bits_as_uint16, "bfloat16")`. Publishes like an array of that dtype."""

    __slots__ = ("bits", "dtype", "shape")

    def __init__(self, bits: np.ndarray, dtype: str) -> None:
        self.bits, self.shape = bits, bits.shape
        self.dtype = _wire_dtype(dtype, bits.dtype.itemsize)

    def __getitem__(self, rows: slice) -> WireArray:
        return WireArray(self.bits[rows], self.dtype.name)

    def tobytes(self) -> bytes:
        return self.bits.tobytes()


@functools.cache
def _wire_dtype(name: str, itemsize: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, itemsize=itemsize)


def raw(array: Any) -> np.ndarray:
    """The array (a WireArray's bits) as a C-contiguous ndarray: itself when it already is."""
    return np.ascontiguousarray(array.bits if isinstance(array, WireArray) else array)


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


@dataclass(frozen=True)
class StepsMessage:
    """Consecutive steps' batches taken together by a reader that fell behind."""

    steps: tuple[BatchMessage, ...]


PortMessage = HiddenMessage | EndMessage | RegionMessage | BatchMessage | StepsMessage

MAX_STEPS_PER_MESSAGE = 64
MAX_INLINE_BYTES_PER_MESSAGE = 256 << 10  # past this a message gains nothing by coalescing


def inline_bytes(msg: BatchMessage) -> int:
    """Tensor bytes the batch carries in the message itself (0 with shared memory)."""
    n = sum(len(m.embeddings.data or b"") + len(m.states.data or b"")
            for m in msg.messages if isinstance(m, HiddenMessage))
    if msg.block is not None:
        n += len(msg.block.embeddings.data or b"") + len(msg.block.states.data or b"")
    return n
