"""The encoder cache: LRU under a byte budget, whatever the stream of images."""

from __future__ import annotations

import numpy as np

from llm_runner_svc.runtime.encoder_cache import EncoderCache


def _emb(i: int, rows: int = 4) -> np.ndarray:
    return np.full((rows, 8), i, np.float32)  # 32 * rows bytes


def test_budget_holds_under_a_stream_of_distinct_images() -> None:
    cache = EncoderCache(budget_bytes=5 * 128)
    for i in range(50):
        assert cache.get(bytes([i])) is None
        cache.put(bytes([i]), _emb(i))
        assert cache.num_bytes <= cache.budget_bytes
        assert cache.num_bytes == sum(128 for _ in range(len(cache)))
    assert len(cache) == 5 and cache.stats.evictions == 45
    assert cache.stats.lookups == 50 and cache.stats.hits == 0


def test_least_recently_used_goes_first() -> None:
    cache = EncoderCache(budget_bytes=3 * 128)
    for i in range(3):
        cache.put(bytes([i]), _emb(i))
    assert cache.get(b"\0") is not None  # 0 is now the most recently used
    cache.put(b"\3", _emb(3))
    assert cache.get(b"\1") is None  # 1 was the least recently used
    assert all(cache.get(bytes([i])) is not None for i in (0, 2, 3))
    np.testing.assert_array_equal(cache.get(b"\3"), _emb(3))


def test_an_entry_larger_than_the_budget_is_not_kept() -> None:
    cache = EncoderCache(budget_bytes=100)
    cache.put(b"big", _emb(1))
    assert len(cache) == 0 and cache.num_bytes == 0
