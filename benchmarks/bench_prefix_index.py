"""The prefix cache's index: the keyed hash chain it uses against the plain hash chain
it used before and a compact radix tree.

Both index full pages of token ids and answer the same two questions per request: which
leading pages of a prompt are cached (`match`), and, once computed, the request's new full
pages (`insert`, continuing from where its match stopped). Pool bookkeeping (reference
counts, LRU eviction) is the same for either and left out.

- keyed chain: what `runtime/prefix_cache.py` does: a dict from a page's key, (its
  parent's chained name, its packed token ids), to its record, which keeps the page's own
  name (blake2b-128 of the key, `page_name`, computed once on insert); a lookup hashes only
  dict keys, taking each hit's name as the next parent.
- hash chain: what the cache did before: a dict from a page's chained name to its record;
  a lookup names every full page of the prompt with `page_name`, then looks each name up.
- hash chain, ids one by one: the same with the ids turned into bytes by one
  `int.to_bytes` each, as `page_name` did before that (the same names).
- radix: a tree whose edges are runs of whole pages (token-id tuples), children keyed by
  their edge's first page, split where prompts diverge; a lookup compares tuples, no hashing.

Workloads (token ids drawn at random, pages of 16):
- system prompt: a 2,000-token system prompt shared by every user, plus each user's own
  50-token turn; every user's request is looked up, then inserted;
- multi-turn: conversations of 8 turns, each turn the previous prompt + a 16-token answer +
  a 50-token user turn, looked up and inserted turn after turn (conversations interleaved).
Time is the median of --rounds runs of the whole workload; memory is the filled index's
objects as sys.getsizeof counts them (token-id tuples included, which both keep; the ids'
int objects left out).

Usage: python benchmarks/bench_prefix_index.py [--users 200] [--conversations 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from llm_runner_svc.runtime.prefix_cache import packed, page_name

PS = 16


class Index(Protocol):
    next_page: int  # pages inserted so far

    def match(self, tokens: Sequence[int]) -> tuple[int, Any]: ...
    def insert(self, tokens: Sequence[int], where: Any) -> None: ...


def chain_name(parent: bytes, tokens: Sequence[int]) -> bytes:
    """`page_name` of a page's ids packed on their own (one struct.pack a page)."""
    return page_name(parent, packed(tokens))


class HashChain:
    """Chained page names -> (page, tokens), as the prefix cache keeps them."""

    def __init__(self, name: Callable[[bytes, Sequence[int]], bytes] = chain_name) -> None:
        self.root = hashlib.blake2b(b"model", digest_size=16).digest()
        self.names: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        self.name = name
        self.next_page = 0

    def match(self, tokens: Sequence[int]) -> tuple[int, list[bytes]]:
        names: list[bytes] = []
        name = self.root
        for i in range((len(tokens) - 1) // PS):
            chunk = tuple(tokens[i * PS:(i + 1) * PS])
            name = self.name(name, chunk)
            rec = self.names.get(name)
            if rec is None or rec[1] != chunk:
                break
            names.append(name)
        return len(names), names

    def insert(self, tokens: Sequence[int], where: list[bytes]) -> None:
        parent = where[-1] if where else self.root
        for i in range(len(where), len(tokens) // PS):
            chunk = tuple(tokens[i * PS:(i + 1) * PS])
            parent = self.name(parent, chunk)
            if parent not in self.names:
                self.names[parent] = (self.next_page, chunk)
                self.next_page += 1


class KeyedChain:
    """(parent name, packed ids) -> (page, name), as the prefix cache keeps them."""

    def __init__(self) -> None:
        self.root = hashlib.blake2b(b"model", digest_size=16).digest()
        self.keys: dict[tuple[bytes, bytes], tuple[int, bytes]] = {}
        self.next_page = 0

    def match(self, tokens: Sequence[int]) -> tuple[int, list[tuple[bytes, bytes]]]:
        full = (len(tokens) - 1) // PS
        ids, width = packed(tokens[:full * PS]), 4 * PS
        keys: list[tuple[bytes, bytes]] = []
        parent = self.root
        for i in range(full):
            key = (parent, ids[i * width:(i + 1) * width])
            rec = self.keys.get(key)
            if rec is None:
                break
            keys.append(key)
            parent = rec[1]
        return len(keys), keys

    def insert(self, tokens: Sequence[int], where: list[tuple[bytes, bytes]]) -> None:
        parent = self.keys[where[-1]][1] if where else self.root
        for i in range(len(where), len(tokens) // PS):
            key = (parent, packed(tokens[i * PS:(i + 1) * PS]))
            parent = page_name(*key)
            if key not in self.keys:
                self.keys[key] = (self.next_page, parent)
                self.next_page += 1


def one_by_one_name(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class _Node:
    __slots__ = ("edge", "pages", "children")

    def __init__(self, edge: list[tuple[int, ...]], pages: list[int]) -> None:
        self.edge = edge  # the pages' token ids along the edge into this node
        self.pages = pages  # their page ids
        self.children: dict[tuple[int, ...], _Node] = {}


class Radix:
    """A radix tree over whole pages; `match` answers (pages, (node, pages matched on the
    edge into it))."""

    def __init__(self) -> None:
        self.root = _Node([], [])
        self.next_page = 0

    def match(self, tokens: Sequence[int]) -> tuple[int, tuple[_Node, int, int]]:
        node, i = self.root, 0
        last = (len(tokens) - 1) // PS
        while i < last:
            child = node.children.get(tuple(tokens[i * PS:(i + 1) * PS]))
            if child is None:
                break
            j = 1
            while j < len(child.edge) and i + j < last and \
                    child.edge[j] == tuple(tokens[(i + j) * PS:(i + j + 1) * PS]):
                j += 1
            i += j
            if j < len(child.edge):
                return i, (child, j, i)
            node = child
        return i, (node, len(node.edge), i)

    def insert(self, tokens: Sequence[int], where: tuple[_Node, int, int]) -> None:
        node, j, i = where
        n = len(tokens) // PS
        if i >= n:
            return
        if j < len(node.edge):  # split the edge: node keeps its head, a new child the tail
            tail = _Node(node.edge[j:], node.pages[j:])
            tail.children = node.children
            node.edge, node.pages = node.edge[:j], node.pages[:j]
            node.children = {tail.edge[0]: tail}
        edge = [tuple(tokens[k * PS:(k + 1) * PS]) for k in range(i, n)]
        pages = list(range(self.next_page, self.next_page + len(edge)))
        self.next_page += len(edge)
        node.children[edge[0]] = _Node(edge, pages)


def system_prompt(rng: random.Random, users: int) -> list[list[int]]:
    system = [rng.randrange(49152) for _ in range(2000)]
    return [system + [rng.randrange(49152) for _ in range(50)] for _ in range(users)]


def multi_turn(rng: random.Random, conversations: int, turns: int = 8) -> list[list[int]]:
    convs: list[list[int]] = [[] for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for c in convs:
            c += [rng.randrange(49152) for _ in range(16 if c else 0)]  # the last answer
            c += [rng.randrange(49152) for _ in range(50)]
            out.append(list(c))
    return out


def run(make: Callable[[], Index], prompts: list[list[int]]) -> tuple[int, int, int]:
    """Pages reused, pages cached, bytes of the filled index."""
    idx = make()
    reused = 0
    for p in prompts:
        n, where = idx.match(p)
        reused += n
        idx.insert(p, where)
    return reused, idx.next_page, deep_size(idx)


def deep_size(obj: object, seen: set[int] | None = None) -> int:
    """Bytes of `obj` and the containers it reaches (ints left out: the token ids are the
    prompts' objects, shared with the requests)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, int) or callable(obj):
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        size += sum(deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(deep_size(getattr(obj, a), seen) for a in obj.__slots__)
    elif hasattr(obj, "__dict__"):
        size += deep_size(vars(obj), seen)
    return size


def timed(make: Callable[[], Index], prompts: list[list[int]]) -> float:
    idx = make()
    t0 = time.perf_counter()
    for p in prompts:
        idx.insert(p, idx.match(p)[1])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=200)
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    loads = {"system prompt": system_prompt(rng, args.users),
             "multi-turn": multi_turn(rng, args.conversations)}
    kinds: dict[str, Callable[[], Index]] = {
        "keyed chain (the cache)": KeyedChain,
        "hash chain (page_name)": HashChain,
        "hash chain, ids one by one": lambda: HashChain(one_by_one_name),
        "radix": Radix,
    }
    print("| workload | requests | pages looked up | index | us per request "
          "(match + insert) | vs keyed chain | KiB of index | bytes per cached page |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for load, prompts in loads.items():
        looked = sum((len(p) - 1) // PS for p in prompts)
        base = None
        for kind, make in kinds.items():
            reused, pages, size = run(make, prompts)
            secs = statistics.median(timed(make, prompts) for _ in range(args.rounds))
            us = secs / len(prompts) * 1e6
            base = base or us
            print(f"| {load} | {len(prompts)} | {looked} ({reused} hit) | {kind} | {us:,.1f} | "
                  f"{us / base:.2f}x | {size / 1024:,.0f} | {size / pages:,.0f} |")


if __name__ == "__main__":
    main()
