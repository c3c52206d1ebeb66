"""The torch engine under the runtime's step loop: step n+1 is launched before step n is read,
its decode rows taking step n's picks on the device, and a step with a prompt chunk runs its
decode rows in the same forward. Whatever joins, leaves, is cancelled, prefills in chunks
beside decodes or is preempted, every request's tokens must be those it gets alone, and every
page comes back."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import drain

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.engines.batch import Batch, Row, SampleSpec
from llm_runner_svc.errors import FailedPrecondition
from llm_runner_svc.runtime import (
    FinishReason,
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    resolve,
)

SPECS = [dict(temperature=0.0, max_new_tokens=40),
         dict(temperature=0.9, top_k=40, seed=7, max_new_tokens=25),
         dict(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=60),
         dict(temperature=0.0, max_new_tokens=5),
         dict(temperature=1.0, seed=11, max_new_tokens=33)]


def _runtime(stories, mixed_steps: str = "split", **cfg) -> InferenceRuntime:
    eng = create_engine("torch", stories.config, stories.weights, device="cpu",
                        mixed_steps=mixed_steps)
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(**{"max_seq": 256, **cfg}))
    rt.preallocate()
    return rt


def _requests(rt: InferenceRuntime) -> list[GenerationRequest]:
    """Greedy and seeded sampling, different lengths, one stop string, prompts of several
    lengths; more requests than batch rows, so rows leave and others join."""
    reqs = [GenerationRequest(f"r{i}", [1, *range(300 + i, 300 + i + 3 * i), 40 + i],
                              resolve(rt.config.sampling, **sp))
            for i, sp in enumerate(SPECS)]
    reqs.append(GenerationRequest("stop", [1, 400], resolve(
        rt.config.sampling, temperature=0.0, max_new_tokens=80), stop=("the",)))
    return reqs


def _alone(stories) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in range(len(SPECS) + 1):
        rt = _runtime(stories, max_batch=1)
        rt.submit(_requests(rt)[i])
        out.update(drain(rt))
        rt.close()
    return out


class Spy:
    """Counts the batches the runtime launches by kind."""

    def __init__(self, rt: InferenceRuntime) -> None:
        self.fed = self.mixed = 0
        self._launch = rt.engine.launch
        rt.engine.launch = self  # type: ignore[method-assign]

    def __call__(self, batch: Batch):
        self.fed += any(r.from_pick is not None for r in batch.rows)
        lengths = {r.length > 1 for r in batch.rows}
        self.mixed += len(lengths) == 2
        return self._launch(batch)


@pytest.mark.parametrize(("step_tokens", "mixed_steps"),
                         [(0, "split"), (8, "split"), (8, "joined")])
def test_batched_steps_give_each_request_its_solo_tokens(stories, step_tokens, mixed_steps):
    rt = _runtime(stories, mixed_steps, max_batch=3, max_tokens_per_step=step_tokens)
    spy = Spy(rt)
    for req in _requests(rt):
        rt.submit(req)
    out = drain(rt)
    assert rt.pages.num_free == rt.plan.num_pages
    rt.close()
    assert spy.fed > 50 and spy.mixed > 0
    assert out == _alone(stories)


def test_chunked_prefill_and_preemption_give_the_solo_tokens(stories):
    """Prompts in 5-token chunks beside decodes, in a pool too small for every request at
    once (three requests of 4 pages each in a pool of 6)."""
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(
        max_batch=3, max_seq=256, max_tokens_per_step=5,
        kv_memory_bytes=6 * 16 * eng.kv_bytes_per_token()))
    rt.preallocate()
    specs = [dict(temperature=0.0), dict(temperature=0.9, seed=7),
             dict(temperature=0.8, top_p=0.9, seed=3)]
    reqs = [GenerationRequest(f"q{i}", [1, 300 + i, 40 + i, 7, 9 + i, 11, 13], resolve(
        rt.config.sampling, max_new_tokens=56, **sp), ignore_eos=True)
        for i, sp in enumerate(specs)]
    for req in reqs:
        rt.submit(req)
    out = drain(rt)
    assert rt.scheduler.preemptions > 0
    assert rt.pages.num_free == rt.plan.num_pages
    rt.close()
    for req in reqs:
        alone = _runtime(stories, max_batch=1)
        alone.submit(req)
        assert out[req.request_id] == drain(alone)[req.request_id]
        alone.close()


def test_a_cancel_lands_at_the_next_step_and_the_rest_run_on(stories):
    rt = _runtime(stories, max_batch=3)
    reqs = _requests(rt)[:2]
    for req in reqs:
        rt.submit(req)
    got: dict[str, list[int]] = {}
    for _ in range(6):
        for ev in rt.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    rt.cancel("r0")
    events = {ev.request_id: ev for ev in rt.step()}
    assert events["r0"].finish_reason is FinishReason.CANCELLED
    got["r1"] += events["r1"].token_ids
    for rid, toks in drain(rt).items():
        got[rid] += toks
    assert rt.pages.num_free == rt.plan.num_pages
    rt.close()
    assert got["r1"] == _alone(stories)["r1"]


def test_hidden_states_arrive_for_every_position(stories):
    rt = _runtime(stories, max_batch=2, max_seq=128, hidden_layer=-1)
    rt.submit(GenerationRequest("h", [1, 300, 301], resolve(
        rt.config.sampling, temperature=0.0, max_new_tokens=10), capture_hidden=True))
    windows = []
    while rt.has_work:
        for ev in rt.step():
            windows += ev.hidden
    rt.close()
    assert [w.start_position for w in windows] == [0, *range(3, 12)]
    assert [len(w.states) for w in windows] == [3] + [1] * 9


def _plan() -> EnginePlan:
    return EnginePlan(max_batch=2, max_seq=64, page_size=16, num_pages=8)


def test_a_row_takes_the_previous_pick_before_it_is_read(stories):
    """Launch a prompt, then a row feeding its pick, and only then read the first: the same
    tokens and logits as feeding the pick by hand."""
    greedy = SampleSpec(0.0, 0, 1.0)
    prompt = (1, 300, 301, 302)
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    eng.preallocate(_plan())
    first = eng.launch(Batch([Row(prompt, 0, [0], greedy)]))
    second = eng.launch(Batch([Row((), 4, [0], greedy, from_pick=0)]))
    picks = [eng.read(first).picks[0], eng.read(second).picks[0]]
    logits = np.array(eng.logits(1))
    eng.close()
    ref = create_engine("torch", stories.config, stories.weights, device="cpu")
    ref.preallocate(_plan())
    want = [ref.read(ref.launch(Batch([Row(prompt, 0, [0], greedy)]))).picks[0]]
    want.append(ref.read(ref.launch(Batch([Row((want[0],), 4, [0], greedy)]))).picks[0])
    assert picks == want
    np.testing.assert_array_equal(logits, ref.logits(1))
    ref.close()


def test_a_row_cannot_feed_a_pick_that_was_not_made(stories):
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    eng.preallocate(_plan())
    with pytest.raises(FailedPrecondition, match="made none"):
        eng.launch(Batch([Row((), 3, [0], from_pick=0)]))  # no forward before it
    eng.read(eng.launch(Batch([Row((5, 6), 0, [0])])))  # no sample spec: no pick
    with pytest.raises(FailedPrecondition, match="made none"):
        eng.launch(Batch([Row((), 2, [0], from_pick=0)]))
    eng.read(eng.launch(Batch([Row((5,), 2, [0], SampleSpec(0.0, 0, 1.0))])))
    with pytest.raises(FailedPrecondition, match="made none"):
        eng.launch(Batch([Row((), 3, [0], from_pick=1)]))  # beyond the last batch
    eng.close()
