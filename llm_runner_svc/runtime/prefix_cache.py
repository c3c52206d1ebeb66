"""Content-addressed reuse of full KV pages across requests. Pure Python.

A full page (page_size positions) is named by a hash chain: the digest of the previous
page's name and this page's token ids, seeded by a key for everything else that changes the
KV (the model, the page size). Equal names mean equal token prefixes, so equal KV; the token
ids are stored beside the name and compared on a hit, so a hash collision can only miss.

`match` finds a request's longest cached prefix of full pages and makes it a holder of
them; `commit` names the full pages a request has computed. A named page stays in the pool
after its holders end (the pool keeps it idle) until the pool needs the room: `allocate`
evicts the least recently released idle page, and the cache forgets its name. `max_records`
bounds the names held (0: only the pool bounds them); beyond it the least recently used name
is forgotten, and its page is freed once no request holds it.

A page named while the batch that writes it is being built must not be read by a row of
that same batch: every name carries the launch that writes it, and `match` only takes names
whose launch is before the one being built.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from llm_runner_svc.runtime.kv import PagePool


@dataclass
class _Record:
    page: int
    tokens: tuple[int, ...]
    launch: int  # the launch whose forward writes the page


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one page
    hit_tokens: int = 0
    evictions: int = 0  # named pages taken back by the pool for new requests


def page_name(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained name of a page holding `tokens`, after the page named `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class PrefixCache:
    def __init__(self, pool: PagePool, key: str, max_records: int = 0) -> None:
        self.pool = pool
        self.root = hashlib.blake2b(key.encode(), digest_size=16).digest()
        self.max_records = max_records
        self.stats = CacheStats()
        self._names: OrderedDict[bytes, _Record] = OrderedDict()  # least recently used first
        self._by_page: dict[int, bytes] = {}
        pool.on_evict = self._evicted

    @property
    def num_pages(self) -> int:
        """Pages named by the cache (held by requests or idle)."""
        return len(self._names)

    def match(self, tokens: Sequence[int], launches: int) -> tuple[list[int], bytes]:
        """The pages of the longest cached prefix of `tokens`, each with a new holder, and
        the name of the last one. At least one token is left out (its logits give the first
        pick), so a prompt of whole pages reuses all but its last page. Only names written
        by launches up to `launches` count."""
        ps = self.pool.page_size
        pages: list[int] = []
        name = self.root
        for i in range((len(tokens) - 1) // ps):
            chunk = tuple(tokens[i * ps:(i + 1) * ps])
            nxt = page_name(name, chunk)
            rec = self._names.get(nxt)
            if rec is None or rec.tokens != chunk or rec.launch > launches:
                break
            self._names.move_to_end(nxt)
            self.pool.revive(rec.page)
            pages.append(rec.page)
            name = nxt
        return pages, name

    def count(self, tokens: int) -> None:
        """Record one admitted lookup that reused `tokens` positions."""
        self.stats.lookups += 1
        if tokens:
            self.stats.hits += 1
            self.stats.hit_tokens += tokens

    def commit(self, tokens: Sequence[int], pages: Sequence[int], done: int, parent: bytes,
               upto: int, launch: int) -> tuple[int, bytes]:
        """Name the full pages `done` .. of `pages` whose positions are all below `upto`
        (their KV written by `launch` or earlier), chained after `parent`, the name of page
        `done - 1`. Returns the new (done, parent). A page whose content is named already
        (another request's page) stays the request's own."""
        ps = self.pool.page_size
        if done == 0:
            parent = self.root
        while done < min(upto // ps, len(pages)):
            chunk = tuple(tokens[done * ps:(done + 1) * ps])
            parent = page_name(parent, chunk)
            page = pages[done]
            if parent not in self._names and page not in self._by_page:
                self._names[parent] = _Record(page, chunk, launch)
                self._by_page[page] = parent
                self.pool.keep(page)
                self._bound()
            done += 1
        return done, parent

    def clear(self) -> None:
        """Forget every name; idle pages are free again, held ones when released."""
        for rec in list(self._names.values()):
            self._forget(rec.page)

    # ---- internals -------------------------------------------------------------------
    def _bound(self) -> None:
        while self.max_records and len(self._names) > self.max_records:
            _, rec = next(iter(self._names.items()))
            self._forget(rec.page)

    def _forget(self, page: int) -> None:
        name = self._by_page.pop(page)
        del self._names[name]
        self.pool.unkeep(page)

    def _evicted(self, page: int) -> None:
        name = self._by_page.pop(page)
        del self._names[name]
        self.stats.evictions += 1
