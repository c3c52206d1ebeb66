"""The scheduler's steps: chunked prefill under the token budget, prompts prefilled together,
preemption when the KV pool runs short, held requests. Whatever the schedule, a request's
tokens (and captured states) are those of its solo run, and every page comes back."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_runtime

from llm_runner_svc.errors import InvalidArgument, ResourceExhausted
from llm_runner_svc.runtime import GenerationRequest, RuntimeConfig, resolve

STORY = ("Once upon a time, there was a little girl named Lily. She liked to play outside in "
         "the park with her big red ball. One day, she saw a small dog under a tree. The dog "
         "was sad because it was lost. Lily wanted to help the dog find its home, so she")


def _req(model, rid: str, text: str, capture: bool = False, **sampling) -> GenerationRequest:
    sp = dict(temperature=0.0, max_new_tokens=20)
    sp.update(sampling)
    return GenerationRequest(rid, model.tokenizer.encode(text),
                             resolve(RuntimeConfig().sampling, **sp), capture_hidden=capture)


def _run(rt, reqs) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Submit `reqs`, step until idle; each request's tokens and (position, states) rows."""
    for r in reqs:
        rt.submit(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    states: dict[str, list] = {r.request_id: [] for r in reqs}
    steps = 0
    while rt.has_work:
        for ev in rt.step():
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
            for hs in ev.hidden:
                states.setdefault(ev.request_id, []).extend([(hs.start_position + i, row)
                                             for i, row in enumerate(hs.states)])
        steps += 1
        assert steps < 2000
    assert rt.pages.num_free == rt.plan.num_pages  # every page back in the pool
    return tokens, states


def _spy(rt) -> list:
    """Record every batch the runtime launches."""
    batches: list = []
    launch = rt.engine.launch

    def spy(batch):
        batches.append(batch)
        return launch(batch)

    rt.engine.launch = spy
    return batches


@pytest.mark.parametrize("chunk", [1, 7, 64, 512])
def test_chunk_size_does_not_change_tokens_or_states(stories, chunk):
    """With a hidden port, the states of every position are bit for bit those of the run
    that prefilled the whole prompt in one step (512: the whole prompt again, in a runtime
    of its own), and so are the tokens."""
    req = _req(stories, "c", STORY, capture=True, max_new_tokens=12)
    assert len(req.prompt_ids) > 64
    whole = make_runtime(stories, max_batch=1, max_seq=256, hidden_layer=-1,
                         max_tokens_per_step=512)
    ref_batches = _spy(whole)
    ref_tokens, ref_states = _run(whole, [req])
    whole.close()
    assert ref_batches[0].num_tokens == len(req.prompt_ids)  # the prompt in one step
    rt = make_runtime(stories, max_batch=1, max_seq=256, hidden_layer=-1,
                      max_tokens_per_step=chunk)
    batches = _spy(rt)
    tokens, states = _run(rt, [req])
    rt.close()
    assert all(b.num_tokens <= chunk for b in batches)
    assert len(batches) >= len(req.prompt_ids) // chunk
    assert tokens == ref_tokens
    assert [p for p, _ in states["c"]] == list(range(len(req.prompt_ids) + 11))
    assert [p for p, _ in states["c"]] == [p for p, _ in ref_states["c"]]
    assert np.stack([s for _, s in states["c"]]).tobytes() == \
        np.stack([s for _, s in ref_states["c"]]).tobytes()


def test_a_long_prompt_is_chunked_between_decodes(stories):
    rt = make_runtime(stories, max_batch=4, max_seq=256, max_tokens_per_step=16)
    short = [_req(stories, f"d{i}", "Tim had a red ball", max_new_tokens=40, temperature=0.8,
                  seed=i) for i in range(3)]
    solo = {r.request_id: _run(rt, [r])[0][r.request_id] for r in short}
    batches = _spy(rt)
    got: dict[str, list[int]] = {}
    for r in short:
        rt.submit(r)
    for _ in range(3):
        for ev in rt.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    long = _req(stories, "long", STORY, max_new_tokens=5)
    for rid, toks in _run(rt, [long])[0].items():
        got.setdefault(rid, []).extend(toks)
    rt.close()
    chunked = [b for b in batches if any(r.length > 1 and r.start > 0 for r in b.rows)]
    assert len(chunked) >= len(long.prompt_ids) // 16 - 1  # the prompt took many steps
    assert all(b.num_tokens <= 16 for b in batches)
    assert all(sum(r.length == 1 for r in b.rows) == 3 for b in chunked)  # decodes ran on
    assert len(got["long"]) == 5
    assert {rid: got[rid] for rid in solo} == solo


def test_short_prompts_prefill_together_in_one_forward(stories):
    rt = make_runtime(stories, max_batch=4, max_seq=128)
    batches = _spy(rt)
    reqs = [_req(stories, f"s{i}", text, max_new_tokens=3)
            for i, text in enumerate(["Lily", "The sun was shining", "Mom said"])]
    _run(rt, reqs)
    rt.close()
    first = batches[0]
    assert len(first.rows) == 3 and all(r.start == 0 and r.sample for r in first.rows)
    assert first.num_tokens == sum(len(r.prompt_ids) for r in reqs)


def test_a_pool_too_small_for_everyone_preempts_and_outputs_match_solo(stories):
    specs = [dict(temperature=0.0), dict(temperature=0.8, seed=5),
             dict(temperature=1.0, top_k=20, seed=9), dict(temperature=0.7, top_p=0.9, seed=2)]
    reqs = [_req(stories, f"p{i}", text, capture=True, max_new_tokens=60, **sp)
            for i, (text, sp) in enumerate(zip(
                ["Once upon a time", "The cat sat on the mat and", "Lily went to the park",
                 "One day, a big dog"], specs, strict=True))]
    solo = {}
    for r in reqs:
        rt = make_runtime(stories, max_batch=1, max_seq=256, hidden_layer=-1)
        tokens, states = _run(rt, [r])
        solo[r.request_id] = (tokens[r.request_id], states[r.request_id])
        rt.close()
    page_bytes = rt.engine.kv_bytes_per_token() * 16
    rt = make_runtime(stories, max_batch=4, max_seq=256, hidden_layer=-1,
                      kv_memory_bytes=12 * page_bytes)  # 4 requests of ~5 pages each
    assert rt.plan.num_pages == 12
    tokens, states = _run(rt, reqs)
    assert rt.scheduler.preemptions > 0
    rt.close()
    for r in reqs:
        want_tokens, want_states = solo[r.request_id]
        assert tokens[r.request_id] == want_tokens, r.request_id
        got = states[r.request_id]
        assert [p for p, _ in got] == [p for p, _ in want_states]  # each position once
        np.testing.assert_allclose(np.stack([s for _, s in got]),
                                   np.stack([s for _, s in want_states]), rtol=1e-4, atol=1e-5)


def test_admission_refuses_what_the_pool_can_never_hold(stories):
    page_bytes = 2 * stories.config.num_layers * stories.config.kv_dim * 4 * 16
    rt = make_runtime(stories, max_batch=2, max_seq=256, kv_memory_bytes=3 * page_bytes)
    with pytest.raises(ResourceExhausted, match="3 KV pages|holds 3"):
        rt.submit(_req(stories, "big", STORY, max_new_tokens=100))
    rt.submit(_req(stories, "fits", "Lily", max_new_tokens=20))
    assert _run(rt, [])[0]["fits"]  # the pool serves what fits
    rt.close()


def test_held_requests_take_no_step_and_lose_nothing(stories):
    rt = make_runtime(stories, max_batch=2, max_seq=128)
    a, b = (_req(stories, rid, text, max_new_tokens=15, temperature=0.9, seed=4)
            for rid, text in (("a", "Lily"), ("b", "Tim had a red ball")))
    solo = {r.request_id: _run(rt, [r])[0][r.request_id] for r in (a, b)}
    rt.submit(a)
    rt.submit(b)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for i in range(40):
        held = {"a"} if 2 <= i < 8 else set()
        for ev in rt.step(frozenset(held)):
            got[ev.request_id] += ev.token_ids
            if 2 <= i < 8:
                assert ev.request_id != "a"  # nothing of a while it is held
    while rt.has_work:
        for ev in rt.step():
            got[ev.request_id] += ev.token_ids
    assert got == solo
    assert rt.pages.num_free == rt.plan.num_pages
    rt.close()


@pytest.mark.parametrize("kw, match", [
    (dict(max_tokens_per_step=-1), "max_tokens_per_step"),
    (dict(kv_memory_bytes=-5), "kv_memory_bytes"),
    (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
])
def test_bad_budgets_are_refused(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        RuntimeConfig(**kw)


def test_a_memory_fraction_needs_a_device_engine(stories):
    with pytest.raises(InvalidArgument, match="kvMemoryFraction"):
        make_runtime(stories, kv_memory_fraction=0.5)


def test_pages_are_reference_counted():
    from llm_runner_svc.errors import Internal
    from llm_runner_svc.runtime.kv import PagePool

    pool = PagePool(4, 16)
    mine = pool.allocate(2)
    theirs = pool.share(mine)
    assert pool.num_free == 2 and pool.refs(mine[0]) == 2
    pool.release(mine)
    assert mine == [] and pool.num_free == 2  # still held by the other holder
    pool.release(theirs)
    assert pool.num_free == 4
    with pytest.raises(Internal):
        pool.release([0])
    with pytest.raises(ResourceExhausted):
        pool.allocate(5)
