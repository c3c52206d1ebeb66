"""Content-addressed reuse of full KV pages across requests. Pure Python.

A full page (page_size positions) is named by a hash chain: the digest of the previous
page's name and this page's token ids, seeded by a key for everything else that changes the
KV (the model, the page size) and by the request's LoRA adapter: requests on different
adapters compute different KV for the same tokens, so they never share a page. Equal names
mean equal token prefixes, so equal KV. A page holding positions whose embeddings came from
an image (a request's `EmbedSpan`s) is named by that image's key and the positions it
covers too: the placeholder tokens are the same for every image.

A page's record is filed under its key, (its parent's name, its packed token ids), and
keeps its own name, which `commit` computes once. So `match` hashes nothing but dict keys:
it looks up (root, first page's ids), takes the record's name as the next parent, and so
on; the token ids are part of the key, so a hit is exact whatever the digests do.

`match` finds a request's longest cached prefix of full pages and makes it a holder of
them; `commit` names the full pages a request has computed. A named page stays in the pool
after its holders end (the pool keeps it idle) until the pool needs the room: `allocate`
evicts the least recently released idle page, and the cache forgets its name. `max_records`
bounds the names held (0: only the pool bounds them); beyond it the least recently used name
is forgotten, and its page is freed once no request holds it.

A page named while the batch that writes it is being built must not be read by a row of
that same batch: every name carries the launch that writes it, and `match` only takes names
whose launch is before the one being built.

Hidden co-cache: with `max_snapshots` > 0, a named page also keeps the captured states of
its positions (`attach`, as a request that captures them receives them), up to that many
pages, least recently used dropped first. A request that captures hidden states only reuses
pages that kept theirs, and receives them (`pieces`) as if its prefill had produced them.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from llm_runner_svc.engines.batch import EmbedSpan, HiddenStates
from llm_runner_svc.runtime.kv import PagePool

Key = tuple[bytes, bytes]  # (the parent's name and the page's media marks, packed ids)


@dataclass
class _Record:
    page: int
    name: bytes  # `page_name` of the key: its children's parent
    launch: int  # the launch whose forward writes the page
    hidden: list[HiddenStates] | None = None  # the page's captured states, in order


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one page
    hit_tokens: int = 0
    evictions: int = 0  # named pages taken back by the pool for new requests
    hidden_bytes: int = 0  # bytes of the captured states kept beside named pages


def media_marks(media: Sequence[EmbedSpan], lo: int, hi: int) -> bytes:
    """What of `media` lies in positions lo .. hi-1: each span's key and covered range."""
    out = b""
    for span in media:
        a, b = max(span.start, lo), min(span.end, hi)
        if a < b:
            out += struct.pack("<III", a - lo, b - lo, a - span.start) + span.key
    return out


if array("I").itemsize != 4:  # (C's unsigned int is 4 bytes wherever CPython runs here)
    raise ImportError("the prefix cache packs token ids as 4-byte unsigned ints")
_SWAP = sys.byteorder != "little"


def packed(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, what page names hash and records compare.
    OverflowError for an id outside 0 .. 2**32 - 1, TypeError for one that is no int."""
    ids = array("I", tokens)
    if _SWAP:
        ids.byteswap()
    return ids.tobytes()


def packed_range(tokens: Sequence[int], head: bytes, lo: int, hi: int) -> bytes:
    """`packed(tokens[lo:hi])`, taken from `head` (the `packed` ids of a prefix of `tokens`:
    the prompt's, packed at admission) as far as it reaches."""
    if len(head) >= 4 * hi:
        return head[4 * lo:4 * hi]
    if len(head) <= 4 * lo:
        return packed(tokens[lo:hi])
    return head[4 * lo:] + packed(tokens[len(head) // 4:hi])


def page_name(parent: bytes, ids: bytes) -> bytes:
    """The chained name of a page holding the `packed` ids `ids`, after the page named
    `parent` (and its media marks)."""
    return hashlib.blake2b(parent + ids, digest_size=16).digest()


class PrefixCache:
    def __init__(self, pool: PagePool, key: str, max_records: int = 0,
                 max_snapshots: int = 0) -> None:
        self.pool = pool
        self.root = hashlib.blake2b(key.encode(), digest_size=16).digest()
        self.max_records = max_records
        self.max_snapshots = max_snapshots
        self._snapshots: OrderedDict[Key, None] = OrderedDict()  # records keeping states
        self.stats = CacheStats()
        self._names: OrderedDict[Key, _Record] = OrderedDict()  # least recently used first
        self._by_page: dict[int, Key] = {}
        self._adapter_loads: dict[int, int] = {}  # adapter slot -> adapters it has held
        pool.on_evict = self._evicted

    @property
    def num_pages(self) -> int:
        """Pages named by the cache (held by requests or idle)."""
        return len(self._names)

    @property
    def num_snapshots(self) -> int:
        """Named pages that keep their captured states."""
        return len(self._snapshots)

    def retire_adapter(self, adapter: int) -> None:
        """Adapter slot `adapter` now holds other weights: its pages are never matched again
        (they go idle and are evicted like any other)."""
        self._adapter_loads[adapter] = self._adapter_loads.get(adapter, 0) + 1

    def adapter_root(self, adapter: int) -> bytes:
        """The chain's seed for requests on LoRA adapter slot `adapter` (0 = the base model),
        as loaded now (`retire_adapter`)."""
        if adapter == 0:
            return self.root
        return page_name(self.root + b"lora",
                         packed((adapter, self._adapter_loads.get(adapter, 0))))

    def match(self, tokens: Sequence[int], launches: int, hidden: bool = False,
              adapter: int = 0, media: Sequence[EmbedSpan] = (),
              head: bytes = b"") -> tuple[list[int], list[Key]]:
        """The pages of the longest cached prefix of `tokens`, each with a new holder, and
        their keys. At least one token is left out (its logits give the first pick), so a
        prompt of whole pages reuses all but its last page. Only pages written by launches
        up to `launches` count; with `hidden`, only pages that keep their states. `head`:
        the `packed` ids of a prefix of `tokens` (`packed_range`)."""
        ps = self.pool.page_size
        pages: list[int] = []
        keys: list[Key] = []
        parent = self.adapter_root(adapter)
        full = (len(tokens) - 1) // ps
        width = 4 * ps
        ids = packed_range(tokens, head, 0, full * ps)
        get, touch = self._names.get, self._names.move_to_end  # (125 pages: a 2,000-token
        for lo in range(0, full * width, width):  # prompt; this loop is most of a lookup)
            if media:
                parent += media_marks(media, lo // 4, lo // 4 + ps)
            key = (parent, ids[lo:lo + width])
            rec = get(key)
            if rec is None or rec.launch > launches or (hidden and rec.hidden is None):
                break
            touch(key)
            pages.append(rec.page)
            keys.append(key)
            parent = rec.name
        self.pool.revive(pages)
        return pages, keys

    def pieces(self, keys: Sequence[Key]) -> list[HiddenStates]:
        """The kept states of the pages `keys` (each must keep them), in position order."""
        out: list[HiddenStates] = []
        for key in keys:
            hidden = self._names[key].hidden
            assert hidden is not None
            out += hidden
        return out

    def attach(self, key: Key, pieces: list[HiddenStates]) -> None:
        """Keep `pieces`, the captured states of the page filed under `key`, beside it
        (unless it keeps some already, or the record is gone)."""
        rec = self._names.get(key)
        if not self.max_snapshots or rec is None or rec.hidden is not None:
            return
        rec.hidden = pieces
        self.stats.hidden_bytes += _nbytes(pieces)
        self._snapshots[key] = None
        while len(self._snapshots) > self.max_snapshots:
            self._drop_hidden(next(iter(self._snapshots)))

    def count(self, tokens: int) -> None:
        """Record one admitted lookup that reused `tokens` positions."""
        self.stats.lookups += 1
        if tokens:
            self.stats.hits += 1
            self.stats.hit_tokens += tokens

    def commit(self, tokens: Sequence[int], pages: Sequence[int], keys: list[Key],
               upto: int, launch: int, adapter: int = 0,
               media: Sequence[EmbedSpan] = (), head: bytes = b"") -> None:
        """File the full pages of `pages` past the `keys` they have, whose positions are all
        below `upto` (their KV written by `launch` or earlier); their keys are appended to
        `keys`. A page whose content is cached already (another request's page) stays the
        request's own, and `keys` holds the existing record's key. `head`: as `match`'s."""
        ps = self.pool.page_size
        end = min(upto // ps, len(pages))  # the full pages to file
        if len(keys) >= end:
            return
        if keys:
            rec = self._names.get(keys[-1])
            parent = rec.name if rec is not None else page_name(*keys[-1])
        else:
            parent = self.adapter_root(adapter)
        first, width = len(keys), 4 * ps
        ids = packed_range(tokens, head, first * ps, end * ps)
        for done in range(first, end):
            if media:
                parent += media_marks(media, done * ps, (done + 1) * ps)
            key = (parent, ids[(done - first) * width:(done - first + 1) * width])
            parent = page_name(*key)
            page = pages[done]
            if key not in self._names and page not in self._by_page:
                self._names[key] = _Record(page, parent, launch)
                self._by_page[page] = key
                self.pool.keep(page)
                self._bound()
            keys.append(key)

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
        self._drop(page)
        self.pool.unkeep(page)

    def _evicted(self, page: int) -> None:
        self._drop(page)
        self.stats.evictions += 1

    def _drop(self, page: int) -> None:
        key = self._by_page.pop(page)
        self._drop_hidden(key)
        del self._names[key]

    def _drop_hidden(self, key: Key) -> None:
        rec = self._names[key]
        if rec.hidden is not None:
            self.stats.hidden_bytes -= _nbytes(rec.hidden)
            rec.hidden = None
            del self._snapshots[key]


def _nbytes(pieces: list[HiddenStates]) -> int:
    return sum(int(p.embeddings.nbytes) + int(p.states.nbytes) for p in pieces)


def window(pieces: Sequence[HiddenStates], lo: int, hi: int) -> list[HiddenStates]:
    """The parts of `pieces` (captured states, each of consecutive positions) that cover
    positions lo .. hi-1, sliced, in order."""
    out: list[HiddenStates] = []
    for hs in pieces:
        s = hs.start_position
        a, b = max(lo, s), min(hi, s + len(hs.states))
        if a < b:
            out.append(HiddenStates(hs.embeddings[a - s:b - s], hs.states[a - s:b - s], a))
    return out
