"""The KV page pool's bookkeeping: which page ids are free, and how many holders each page
has. Pure Python; the pages themselves live in the engine."""

from __future__ import annotations

from collections.abc import Sequence

from llm_runner_svc.errors import Internal, ResourceExhausted


class PagePool:
    """A fixed set of page ids, each with a reference count.

    `allocate` hands out free pages with one reference each; `share` adds a holder to pages
    already held (requests sharing a prefix); `release` drops one reference per page and a
    page is free again when its count reaches zero. `can_allocate` / `allocate` are an
    ask-then-commit pair.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        self._refs = [0] * num_pages

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
        pages = [self._free.pop() for _ in range(num_pages)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Sequence[int]) -> list[int]:
        """Another holder for `pages` (each must be held); returns them as a new list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise Internal(f"page {p} is shared but not held")
            self._refs[p] += 1
        return list(pages)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; the caller's list is emptied so a double release is
        impossible."""
        for p in reversed(pages):
            if self._refs[p] <= 0:
                raise Internal(f"page {p} released but not held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        pages.clear()
