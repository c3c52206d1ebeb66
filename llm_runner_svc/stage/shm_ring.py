"""The shared-memory ring of one subscription (TRANSPORT_SHARED_MEMORY in stage.proto).

Layout: a 64-byte header of little-endian uint64 words ([0] data capacity, [1] bytes written,
[2] bytes consumed: the consumer's release mark), then the data area. Positions are absolute
byte counts; a slice lies at data[pos % capacity] and never wraps (the producer skips the tail
when a slice would not fit before the end). Single producer (this stage), single consumer.

The data area is written through once, so no write on the publishing path pays for
first-touch page faults (measured: 163 us vs 23 us for a 224 KiB slice): when the ring is made,
or, for a ring made for a request that has not started (it may never come), once it starts;
until then the segment holds only its header page of /dev/shm.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import uuid
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np

HEADER_BYTES = 64
_WORDS = struct.Struct("<3Q")


class ShmRing:
    def __init__(self, capacity: int, is_faulted_in: bool = True) -> None:
        """`is_faulted_in`: touch every data page now; else call `start_fault_in` later."""
        self.capacity = capacity
        self.name = f"llmstage-{uuid.uuid4().hex[:16]}"
        self._shm = shared_memory.SharedMemory(self.name, create=True,
                                               size=HEADER_BYTES + capacity)
        buf = self._shm.buf
        assert buf is not None
        self._buf: memoryview = buf
        self._written = 0
        self.is_faulted_in = False
        self._faulting: asyncio.Future[None] | None = None
        if is_faulted_in:
            self._fault_in()
        _WORDS.pack_into(self._buf, 0, capacity, 0, 0)

    def _fault_in(self) -> None:
        np.frombuffer(self._buf, np.uint8)[HEADER_BYTES:] = 0
        self.is_faulted_in = True

    def start_fault_in(self) -> None:
        """Fault the data area in on a worker thread (once; before the first write). Runs on
        the event loop, like every method below but `_fault_in`."""
        if not self.is_faulted_in and self._faulting is None:
            self._faulting = asyncio.get_running_loop().run_in_executor(None, self._fault_in)

    async def ready(self) -> None:
        """Wait for a fault-in in progress; the producer calls it before it writes."""
        if self._faulting is not None:
            await asyncio.shield(self._faulting)

    @property
    def size(self) -> int:
        return HEADER_BYTES + self.capacity

    @property
    def consumed(self) -> int:
        return int(_WORDS.unpack_from(self._buf, 0)[2])

    def reserve(self, length: int) -> int | None:
        """Where a slice of `length` bytes can go now, or None while the consumer lags."""
        if length > self.capacity:
            raise ValueError(f"a {length}-byte slice does not fit a {self.capacity}-byte ring")
        start = self._written
        if start % self.capacity + length > self.capacity:  # skip the tail: slices never wrap
            start += self.capacity - start % self.capacity
        if start + length - self.consumed > self.capacity:
            return None
        return start

    def write(self, start: int, parts: Sequence[np.ndarray]) -> int:
        """Copy `parts` (C-contiguous [rows, width] arrays of one dtype and width) back to back
        from `start` (from `reserve` for their total length) in one pass, publish the new write
        mark and return the number of bytes written."""
        rows = sum(p.shape[0] for p in parts)
        first = parts[0]
        dst = np.ndarray((rows, *first.shape[1:]), first.dtype, self._buf,
                         HEADER_BYTES + start % self.capacity)
        np.concatenate(parts, axis=0, out=dst)
        self._written = start + dst.nbytes
        struct.pack_into("<Q", self._buf, 8, self._written)
        return dst.nbytes

    def close(self) -> None:
        """Unlink the segment (a consumer that mapped it keeps its mapping); after a fault-in
        in progress, if any."""
        if self._faulting is not None and not self._faulting.done():
            self._faulting.add_done_callback(lambda _: self.close())
            return
        self._buf.release()
        self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()

