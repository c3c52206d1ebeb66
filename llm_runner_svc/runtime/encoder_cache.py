"""Image embeddings kept across requests and turns, keyed by the content hash of the encoded
image, least recently used dropped first under a byte budget. Pure Python: the values are an
engine's host arrays, only their `nbytes` is read.

A hit means the bytes were decoded, preprocessed and encoded before, so a request whose
images all hit runs no decoder and no encoder. An entry larger than the whole budget is not
kept. Thread-safe: Admit's worker thread fills it, Diagnostics reads its counters.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class EncoderCacheStats:
    lookups: int = 0
    hits: int = 0
    evictions: int = 0


class EncoderCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self.stats = EncoderCacheStats()
        self._entries: OrderedDict[bytes, Any] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Any | None:
        """The embeddings stored under `key` (now the most recently used), or None."""
        with self._lock:
            self.stats.lookups += 1
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
            return value

    def put(self, key: bytes, value: Any) -> None:
        """Keep `value` under `key`, dropping the least recently used entries until the
        budget holds it; a value larger than the budget is not kept."""
        size = int(value.nbytes)
        with self._lock:
            if key in self._entries or size > self.budget_bytes:
                return
            while self.num_bytes + size > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.num_bytes -= int(old.nbytes)
                self.stats.evictions += 1
            self._entries[key] = value
            self.num_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0
