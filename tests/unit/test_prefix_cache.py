"""Prefix reuse across requests: a request whose prompt starts with cached full pages shares
them and prefills only the rest, and produces exactly the tokens it produces without the
cache. Pages named by the cache survive their requests, are evicted only when idle, and all
come back once the requests end and the cache is cleared."""

from __future__ import annotations

import pytest
from helpers import make_runtime

from llm_runner_svc.runtime import GenerationRequest, RuntimeConfig, resolve
from llm_runner_svc.runtime.kv import PagePool
from llm_runner_svc.runtime.prefix_cache import PrefixCache, packed, packed_range

PS = 16
STORY = ("Once upon a time, there was a little girl named Lily. She liked to play outside in "
         "the park with her big red ball. One day, she saw a small dog under a tree. The dog "
         "was sad because it was lost. Lily wanted to help the dog find its home, so she")


def _req(ids, rid: str, *, lookup: bool = True, **sampling) -> GenerationRequest:
    sp = dict(temperature=0.0, max_new_tokens=12)
    sp.update(sampling)
    return GenerationRequest(rid, list(ids), resolve(RuntimeConfig().sampling, **sp),
                             cache_lookup=lookup)


def _run(rt, reqs, cancel_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Submit `reqs` together, step until idle; each request's tokens. A request named in
    `cancel_after` is cancelled once it has that many tokens."""
    for r in reqs:
        rt.submit(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    cancel_after = dict(cancel_after or {})
    for _ in range(5000):
        if not rt.has_work:
            return out
        for ev in rt.step():
            out[ev.request_id].extend(ev.token_ids)
            n = cancel_after.get(ev.request_id)
            if n is not None and len(out[ev.request_id]) >= n:
                rt.cancel(ev.request_id)
                del cancel_after[ev.request_id]
    raise AssertionError("the runtime did not go idle")


def _metrics(rt, req) -> dict:
    rt.submit(req)
    while rt.has_work:
        for ev in rt.step():
            if ev.finish_reason is not None:
                return ev.metrics.as_dict()
    raise AssertionError("no finish")


@pytest.fixture(scope="module")
def prompt(stories) -> list[int]:
    ids = stories.tokenizer.encode(STORY)
    assert len(ids) > 3 * PS
    return ids


@pytest.fixture(scope="module")
def baseline(stories):
    rt = make_runtime(stories, max_batch=4, max_seq=256, page_size=PS)
    yield lambda reqs: _run(rt, reqs)
    rt.close()


@pytest.fixture
def cached(stories):
    rt = make_runtime(stories, max_batch=4, max_seq=256, page_size=PS, prefix_cache=True)
    yield rt
    rt.clear_prefix_cache()
    assert rt.pages.num_free == rt.plan.num_pages and rt.pages.num_idle == 0
    rt.close()


def _variants(prompt: list[int]) -> dict[str, list[int]]:
    """Second prompts sharing none, part of a page, exactly one page, or all of `prompt`."""
    return {
        "none": [prompt[1] + 1] + prompt[1:PS * 2 + 5],
        "partial_page": prompt[:PS + 7] + [prompt[2]] * 9,
        "one_page": prompt[:PS] + prompt[PS + 3:PS * 2 + 9],
        "whole_prompt": list(prompt),
        "whole_pages": prompt[:PS * 3],
    }


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["none", "partial_page", "one_page", "whole_prompt",
                                  "whole_pages"])
def test_tokens_match_the_uncached_run(cached, baseline, prompt, kind, sampling):
    second = _variants(prompt)[kind]
    want = baseline([_req(second, "b", **sampling)])["b"]
    first = _metrics(cached, _req(prompt, "a", **sampling))
    assert first["cached_tokens"] == 0 and first["prefilled_tokens"] == len(prompt)
    m = _metrics(cached, _req(second, "b", **sampling))
    shared = {"none": 0, "partial_page": PS, "one_page": PS,  # a page is left to prefill:
              "whole_prompt": (len(prompt) - 1) // PS * PS, "whole_pages": 2 * PS}[kind]
    assert m["cached_tokens"] == shared
    assert m["prefilled_tokens"] == len(second) - shared
    assert _run(cached, [_req(second, "c", **sampling)])["c"] == want


def test_bypass_and_stats(cached, prompt):
    _run(cached, [_req(prompt, "a")])
    assert _metrics(cached, _req(prompt, "b", lookup=False))["cached_tokens"] == 0
    hit = (len(prompt) - 1) // PS * PS
    assert _metrics(cached, _req(prompt, "c"))["cached_tokens"] == hit
    st = cached.prefix_cache.stats
    assert (st.hits, st.hit_tokens) == (1, hit)
    assert cached.prefix_cache.num_pages >= 3


def test_concurrent_requests_sharing_a_prefix(cached, baseline, prompt):
    reqs = [_req(prompt[:PS * 2 + i * 5] + [prompt[i]], f"r{i}", max_new_tokens=8 + i)
            for i in range(4)]
    want = baseline(reqs)
    assert _run(cached, reqs) == want  # cold: joined together, nothing to share yet
    assert _run(cached, reqs) == want  # warm: all share the cached pages at once
    assert cached.prefix_cache.stats.hit_tokens >= 4 * 2 * PS


def test_eviction_under_a_small_pool(stories, baseline, prompt):
    rt = make_runtime(stories, max_batch=2, max_seq=96, page_size=PS, prefix_cache=True)
    try:
        assert rt.plan.num_pages == 12
        reqs = [_req([prompt[i]] + prompt[i + 1:i + 40], f"e{i}") for i in range(6)]
        for r in reqs:
            assert _run(rt, [r]) == baseline([r])
        assert rt.prefix_cache.stats.evictions > 0
        assert rt.prefix_cache.num_pages <= rt.plan.num_pages
        assert _run(rt, [reqs[-1]]) == baseline([reqs[-1]])  # the newest is still cached
        assert rt.prefix_cache.stats.hits >= 1
        rt.clear_prefix_cache()
        assert rt.pages.num_free == rt.plan.num_pages and rt.pages.num_idle == 0
    finally:
        rt.close()


def test_preemption_under_a_small_pool_while_sharing(stories, baseline, prompt):
    """Four requests share a prefix in a pool too small for all of them: some are preempted
    (their pages released, named ones kept idle) and rejoin through the cache."""
    rt = make_runtime(stories, max_batch=4, max_seq=128, page_size=PS, prefix_cache=True,
                      kv_memory_bytes=9 * PS * rt_kv_bytes(stories))
    try:
        reqs = [_req(prompt[:PS * 2 + 3 * i] + [prompt[i]], f"p{i}", max_new_tokens=40)
                for i in range(4)]
        want = baseline(reqs)
        assert _run(rt, [reqs[0]]) == {"p0": want["p0"]}
        assert _run(rt, reqs) == want
        assert rt.scheduler.preemptions > 0 and rt.prefix_cache.stats.hits >= 4
        rt.clear_prefix_cache()
        assert rt.pages.num_free == rt.plan.num_pages and rt.pages.num_idle == 0
    finally:
        rt.close()


def rt_kv_bytes(model) -> int:
    """KV bytes of one position of `model` in the test engine's pool."""
    rt = make_runtime(model, max_batch=1, max_seq=16, page_size=PS)
    try:
        return rt.engine.kv_bytes_per_token()
    finally:
        rt.close()


def test_cancel_while_the_prefix_is_shared(cached, baseline, prompt):
    _run(cached, [_req(prompt, "warm")])
    reqs = [_req(prompt, "keep", max_new_tokens=20), _req(prompt, "gone", max_new_tokens=20)]
    want = baseline([reqs[0]])["keep"]
    got = _run(cached, reqs, cancel_after={"gone": 2})
    assert got["keep"] == want and len(got["gone"]) < 20
    assert cached.pages.num_free == cached.plan.num_pages  # idle pages count as free
    assert cached.pages.num_idle == cached.prefix_cache.num_pages


def test_max_records_bounds_the_named_pages(stories, prompt):
    rt = make_runtime(stories, max_batch=2, max_seq=128, page_size=PS, prefix_cache=True,
                      prefix_cache_records=2)
    try:
        _run(rt, [_req(prompt, "a")])
        assert rt.prefix_cache.num_pages == 2 and rt.pages.num_idle == 2
    finally:
        rt.clear_prefix_cache()
        rt.close()


def test_pool_evicts_only_idle_pages_oldest_first():
    pool = PagePool(4, 2)
    cache = PrefixCache(pool, "k")
    pages = pool.allocate(3)
    names: list[bytes] = []
    cache.commit([1, 2, 3, 4, 5, 6], pages, names, 6, 0)
    assert len(names) == 3
    assert cache.num_pages == 3
    pool.release(pages[2:3])
    pool.release(pages[:1])
    assert pool.num_free == 3 and pool.num_idle == 2
    got = pool.allocate(2)  # the free page, then the oldest idle one: the third page
    assert got == [3, pages[2]] and pool.num_free == 1
    assert cache.stats.evictions == 1 and cache.num_pages == 2
    again, _ = cache.match([1, 2, 3, 4, 5, 6, 7], 0)  # the chain ends where it was evicted
    assert again == pages[:2] and pool.refs(pages[0]) == 1 and pool.refs(pages[1]) == 2
    assert cache.match([1, 2, 3, 4, 5, 6, 7], -1)[0] == []  # named by a later launch
    pool.release(again)
    cache.clear()
    pool.release([pages[1], *got])
    assert pool.num_free == 4 and pool.num_idle == 0


@pytest.mark.parametrize("head", [0, 1, 3, 4, 9])
def test_a_packed_head_matches_as_the_tokens_do(head):
    """The prompt's ids packed at admission stand for that many leading tokens; whatever
    of the matched pages lies past them (a request preempted after generating) is packed
    from the tokens, and a head that differs from the tokens decides the match."""
    pool = PagePool(8, 2)
    cache = PrefixCache(pool, "k")
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    pages = pool.allocate(4)
    cache.commit(tokens, pages, [], 8, 0)
    got, keys = cache.match(tokens, 0, head=packed(tokens[:head]))
    assert got == pages and len(keys) == 4
    pool.release(got)
    other = packed([5, 6, 7, 99][:head])  # from its 4th id on, the second page differs
    got, _ = cache.match(tokens, 0, head=other)
    assert got == (pages[:1] if head >= 4 else pages)
    pool.release(got)
    cache.clear()
    pool.release(pages)
    assert pool.num_free == 8


def test_packed_range_takes_the_head_as_far_as_it_reaches():
    tokens = list(range(100, 140))
    for head in (0, 5, 16, 40):
        for lo, hi in ((0, 16), (4, 12), (16, 32), (30, 40)):
            assert packed_range(tokens, packed(tokens[:head]), lo, hi) == \
                packed(tokens[lo:hi]), (head, lo, hi)


@pytest.mark.parametrize("generated", [True, False])
def test_commit_policy_decides_whether_generated_tokens_are_kept(cached, prompt, generated):
    first = GenerationRequest("a", prompt, resolve(RuntimeConfig().sampling, temperature=0.0,
                                                   max_new_tokens=40), cache_generated=generated)
    out = _run(cached, [first])["a"]
    turn = prompt + out[:-1]
    m = _metrics(cached, _req(turn, "b"))
    kept = (len(turn) - 1) // PS if generated else len(prompt) // PS
    assert m["cached_tokens"] == kept * PS


def _states(rt, req) -> tuple[list[int], list[tuple[int, object, object]]]:
    """A capturing request's tokens and (position, embedding row, state row), in order."""
    rt.submit(req)
    toks: list[int] = []
    rows: list = []
    while rt.has_work:
        for ev in rt.step():
            toks += ev.token_ids
            for hs in ev.hidden:
                rows += [(hs.start_position + i, e, s)
                         for i, (e, s) in enumerate(zip(hs.embeddings, hs.states, strict=True))]
    return toks, rows


@pytest.mark.parametrize("kind", ["none", "partial_page", "one_page", "whole_prompt"])
def test_reused_prefix_delivers_the_same_hidden_states(stories, prompt, kind):
    """With max_snapshots, a capturing request that reuses a prefix still receives the
    states of every position, bit for bit those of a run without the cache."""
    second = _variants(prompt)[kind]

    def req(ids, rid):
        return GenerationRequest(rid, list(ids), resolve(RuntimeConfig().sampling,
                                                         temperature=0.0, max_new_tokens=6),
                                 capture_hidden=True)
    kw = dict(max_batch=2, max_seq=256, page_size=PS, hidden_layer=2)
    plain = make_runtime(stories, **kw)
    want = _states(plain, req(second, "w"))
    plain.close()
    rt = make_runtime(stories, prefix_cache=True, prefix_cache_snapshots=64, **kw)
    try:
        first = _states(rt, req(prompt, "a"))[1]
        assert rt.prefix_cache.num_snapshots > 0 and rt.prefix_cache.stats.hidden_bytes > 0
        got = _states(rt, req(second, "b"))
        assert rt.prefix_cache.stats.hits == (0 if kind == "none" else 1)
        assert got[0] == want[0]
        assert [p for p, _, _ in got[1]] == list(range(len(got[1])))
        assert [p for p, _, _ in got[1]] == [p for p, _, _ in want[1]]
        # Reused positions carry the bytes the first run captured; every position carries
        # those of the run without the cache (prompt tokens run by aligned blocks).
        shared = {"none": 0, "partial_page": PS, "one_page": PS,
                  "whole_prompt": (len(prompt) - 1) // PS * PS}[kind]
        for (p, e1, s1), (_, e2, s2) in zip(got[1], want[1], strict=True):
            if p < shared:
                assert e1.tobytes() == first[p][1].tobytes(), p
                assert s1.tobytes() == first[p][2].tobytes(), p
            assert e1.tobytes() == e2.tobytes(), p
            assert s1.tobytes() == s2.tobytes(), p
    finally:
        rt.clear_prefix_cache()
        assert rt.prefix_cache.num_snapshots == 0 and rt.prefix_cache.stats.hidden_bytes == 0
        rt.close()



def test_prompt_states_under_concurrency_are_those_of_a_solo_run(stories, prompt):
    """Capturing requests prefilled together, some reusing cached pages, each with its own
    chunking: every prompt position's states are the bytes of its solo run without the
    cache (generated positions share decode steps, so only the prompt is compared)."""
    def req(ids, rid):
        return GenerationRequest(rid, list(ids), resolve(RuntimeConfig().sampling,
                                                         temperature=0.0, max_new_tokens=4),
                                 capture_hidden=True)
    prompts = {f"r{i}": prompt[:PS + 9 * i] + [prompt[i]] * (i + 2) for i in range(4)}
    kw = dict(max_seq=256, page_size=PS, hidden_layer=3)
    plain = make_runtime(stories, max_batch=1, **kw)
    want = {rid: _states(plain, req(ids, rid))[1][:len(ids)] for rid, ids in prompts.items()}
    plain.close()
    rt = make_runtime(stories, max_batch=4, prefix_cache=True, prefix_cache_snapshots=64,
                      max_tokens_per_step=23, **kw)
    try:
        _states(rt, req(prompt, "fill"))
        got: dict[str, list] = {rid: [] for rid in prompts}
        for rid, ids in prompts.items():
            rt.submit(req(ids, rid))
        while rt.has_work:
            for ev in rt.step():
                got[ev.request_id] += [(hs.start_position + i, s)
                                       for hs in ev.hidden for i, s in enumerate(hs.states)]
        assert rt.prefix_cache.stats.hits >= 3
        for rid, ids in prompts.items():
            rows = sorted(got[rid], key=lambda r: r[0])[:len(ids)]
            assert [p for p, _ in rows] == list(range(len(ids)))
            for (p, s), (_, _, w) in zip(rows, want[rid], strict=True):
                assert s.tobytes() == w.tobytes(), (rid, p)
    finally:
        rt.clear_prefix_cache()
        rt.close()


def test_pages_holding_image_positions_are_named_by_the_image() -> None:
    """The same placeholder tokens with another image's embeddings are another prefix: a
    page holding any of its positions is not reused; pages before the image still are."""
    from llm_runner_svc.engines.batch import EmbedSpan

    pool = PagePool(8, 2)
    cache = PrefixCache(pool, "k")
    tokens = [1, 2, 9, 9, 9, 9, 3, 4]  # the image at positions 2..5
    cat, dog = (EmbedSpan(2, [[0.0]] * 4, b"cat"), EmbedSpan(2, [[0.0]] * 4, b"dog"))
    pages = pool.allocate(4)
    names: list[bytes] = []
    cache.commit(tokens, pages, names, 8, 0, media=(cat,))
    assert len(names) == 4
    same, _ = cache.match(tokens + [5], 1, media=(cat,))
    assert same == pages  # every page, the image's included
    other, _ = cache.match(tokens + [5], 1, media=(dog,))
    assert other == pages[:1]  # only the page before the image
    shifted, _ = cache.match(tokens + [5], 1, media=(EmbedSpan(3, [[0.0]] * 3, b"cat"),))
    assert shifted == pages[:1]  # the same image over other positions
