"""The KV page pool's bookkeeping: which page ids are free, and how many holders each page
has. Pure Python; the pages themselves live in the engine.

A page may be *kept* (the prefix cache names its content): when its last holder releases it,
it is idle rather than free. Idle pages count as free; `allocate` takes truly free pages
first, then the least recently released idle ones, telling `on_evict` which it took, so
eviction never touches a page in use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

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
        self._kept: set[int] = set()
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept, no holder; oldest first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones and idle kept ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > self.num_free:
            raise ResourceExhausted(
                f"KV pool exhausted: {num_pages} pages wanted, {self.num_free} free")
        pages = [self._take() for _ in range(num_pages)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._idle.popitem(last=False)
        self._kept.discard(page)
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def keep(self, page: int) -> None:
        """Mark a held page as cached: it turns idle, not free, when its last holder goes."""
        if self._refs[page] <= 0:
            raise Internal(f"page {page} is kept but not held")
        self._kept.add(page)

    def unkeep(self, page: int) -> None:
        """The cache forgets `page`: free now if idle, else free when its holders go."""
        self._kept.discard(page)
        if page in self._idle:
            del self._idle[page]
            self._free.append(page)

    def revive(self, pages: Sequence[int]) -> None:
        """Another holder for each of `pages`, kept pages held or idle."""
        if not self._kept.issuperset(pages):
            page = next(p for p in pages if p not in self._kept)
            raise Internal(f"page {page} is revived but not kept")
        drop, refs = self._idle.pop, self._refs
        for page in pages:
            drop(page, None)
            refs[page] += 1

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
                if p in self._kept:
                    self._idle[p] = None
                else:
                    self._free.append(p)
        pages.clear()
