"""How much shared memory the hidden port may hold: the size of one subscription's ring and
the stage-wide limits on rings and their bytes.

A ring is sized from the port's width: room for two of the largest slices the port writes
(a prefill window's embeddings and states, chunked under the message limit), so the producer
can fill one while the consumer reads the other. Beyond `max_rings` rings or `max_bytes`
bytes a shared-memory Subscribe is RESOURCE_EXHAUSTED before anything is allocated.
"""

from __future__ import annotations

from llm_runner_svc.errors import ResourceExhausted
from llm_runner_svc.stage.shm_ring import HEADER_BYTES

MAX_ITEM_BYTES = 4  # float32, the widest dtype an engine publishes hidden states in
_MIN_RING_BYTES = 4096


def max_payload_bytes(max_message_bytes: int) -> int:
    """Tensor bytes one port message may carry under the gRPC message limit."""
    return max(4096, int(max_message_bytes * 0.9) - 4096)


def ring_bytes_for(width: int, max_seq: int, max_message_bytes: int) -> int:
    """A ring's data capacity for a port of `width` values per row on a stage of `max_seq`."""
    row_bytes = 2 * width * MAX_ITEM_BYTES  # embeddings + states of one position
    rows = max(1, min(max_seq, max_payload_bytes(max_message_bytes) // row_bytes))
    return max(_MIN_RING_BYTES, 2 * rows * row_bytes)


class ShmBudget:
    """The port's shared-memory accounting. Runs on the event loop thread."""

    def __init__(self, ring_bytes: int, max_rings: int, max_bytes: int) -> None:
        self.ring_bytes = ring_bytes  # data capacity of each ring
        self.max_rings = max_rings
        self.max_bytes = max_bytes
        self.num_rings = 0  # rings held or being made
        self.num_bytes = 0  # their segment sizes (header included)

    @property
    def segment_bytes(self) -> int:
        return HEADER_BYTES + self.ring_bytes

    def reserve(self) -> None:
        """Count one more ring, or raise ResourceExhausted when it would pass a limit."""
        if self.num_rings + 1 > self.max_rings:
            raise ResourceExhausted(
                f"shared-memory subscriptions: {self.num_rings} open, the stage's limit "
                f"(ports.hidden.maxShmSubscriptions) is {self.max_rings}")
        if self.num_bytes + self.segment_bytes > self.max_bytes:
            raise ResourceExhausted(
                f"shared-memory subscriptions hold {self.num_bytes} bytes; another ring of "
                f"{self.segment_bytes} would pass the stage's limit "
                f"(ports.hidden.maxShmBytes) of {self.max_bytes}")
        self.num_rings += 1
        self.num_bytes += self.segment_bytes

    def release(self) -> None:
        """One ring counted by `reserve` is gone (or was never made)."""
        self.num_rings -= 1
        self.num_bytes -= self.segment_bytes
