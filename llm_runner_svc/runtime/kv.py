"""The KV page pool's bookkeeping: which page ids are free. Pure Python; the pages
themselves live in the engine."""

from __future__ import annotations

from llm_runner_svc.errors import ResourceExhausted


class PagePool:
    """Fixed set of page ids. `can_allocate` / `allocate` are an ask-then-commit pair."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise ResourceExhausted(
                f"KV pool exhausted: {num_pages} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(num_pages)]

    def release(self, pages: list[int]) -> None:
        """Return pages; the caller's list is emptied so a double release is impossible."""
        self._free.extend(reversed(pages))
        pages.clear()
