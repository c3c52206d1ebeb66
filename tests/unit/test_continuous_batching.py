"""Requests joining a running batch at different steps produce exactly their solo tokens."""

from __future__ import annotations

from helpers import make_runtime

from llm_runner_svc.runtime import FinishReason, GenerationRequest, SamplingDefaults, resolve

PROMPTS = [
    "Once upon a time",
    "The cat sat on the mat and",
    "Lily",
    "One day, a big dog named Max went to the park with his friend",
    "Tim had a red ball",
    "The sun was shining",
    "There was a little bird who wanted to fly high in the sky, but",
    "Mom said",
]


def _requests(stories):
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        sampling = resolve(
            SamplingDefaults(), temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
            top_k=[50, 0, 10, 200][i % 4], top_p=[0.8, 0.95, 1.0, 0.5][i % 4],
            max_new_tokens=20 + 7 * i, seed=1000 + 17 * i)
        reqs.append(GenerationRequest(f"r{i}", stories.tokenizer.encode(prompt), sampling))
    return reqs


def _solo(stories, req):
    rt = make_runtime(stories, max_batch=1, max_seq=512)
    try:
        events = list(rt.generate(req))
        return [t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events)
    finally:
        rt.close()


def test_eight_requests_joined_at_different_steps_match_solo(stories):
    reqs = _requests(stories)
    solo = {r.request_id: _solo(stories, r) for r in reqs}
    rt = make_runtime(stories, max_batch=8, max_seq=512)
    join_at = {0: [0], 1: [1, 2], 3: [3], 4: [4, 5, 6], 9: [7]}  # step -> request indexes
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    text: dict[str, str] = {r.request_id: "" for r in reqs}
    finished: dict[str, FinishReason] = {}
    max_batch_seen = 0
    step = 0
    while len(finished) < len(reqs):
        for i in join_at.get(step, []):
            rt.submit(reqs[i])
        for ev in rt.step():
            got[ev.request_id] += ev.token_ids
            text[ev.request_id] += ev.text
            if ev.finish_reason is not None:
                finished[ev.request_id] = ev.finish_reason
        max_batch_seen = max(max_batch_seen, rt.num_running)
        step += 1
        assert step < 1000
    assert max_batch_seen >= 6  # they really shared steps
    for r in reqs:
        assert got[r.request_id] == solo[r.request_id][0], r.request_id
        assert text[r.request_id] == solo[r.request_id][1], r.request_id
    assert rt.pages.num_free == rt.plan.num_pages
    rt.close()


def test_batch_position_does_not_change_seeded_output(stories):
    req = _requests(stories)[2]
    solo = _solo(stories, req)[0]
    rt = make_runtime(stories, max_batch=4, max_seq=512)
    sampling = req.sampling
    # the same request in last position, behind three different mates
    for i, prompt in enumerate(["A", "B c d", "Once"]):
        rt.submit(GenerationRequest(f"m{i}", stories.tokenizer.encode(prompt), sampling))
    rt.submit(req)
    got: list[int] = []
    while rt.has_work:
        for ev in rt.step():
            if ev.request_id == req.request_id:
                got += ev.token_ids
    assert got == solo
    rt.close()
