"""Decodes chained on the engine (`Engine.supports_chaining`, the torch engine): the runtime
starts step n+1 before it reads step n's picks. The outputs must be exactly those of plain
stepping, whatever joins, leaves or is cancelled on the way, and every page comes back."""

from __future__ import annotations

import pytest
from helpers import drain

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import CHAINED, DecodeRow, EnginePlan
from llm_runner_svc.errors import FailedPrecondition
from llm_runner_svc.runtime import (
    FinishReason,
    GenerationRequest,
    InferenceRuntime,
    RuntimeConfig,
    resolve,
)


class Counting:
    """Wraps an engine's decode to count the chained ones."""

    def __init__(self, engine) -> None:
        self.chained = 0
        self._decode = engine.decode
        engine.decode = self

    def __call__(self, rows):
        self.chained += rows[0].token_id == CHAINED
        return self._decode(rows)


def _runtime(stories, chains: bool) -> tuple[InferenceRuntime, Counting]:
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    eng.supports_chaining = chains
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(max_batch=3, max_seq=256))
    rt.preallocate()
    return rt, Counting(eng)


def _requests(rt: InferenceRuntime) -> list[GenerationRequest]:
    """Greedy and seeded sampling, different lengths, one stop string; more requests than
    batch rows, so rows leave and others join while decodes are chained."""
    specs = [dict(temperature=0.0, max_new_tokens=40),
             dict(temperature=0.9, top_k=40, seed=7, max_new_tokens=25),
             dict(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=60),
             dict(temperature=0.0, max_new_tokens=5),
             dict(temperature=1.0, seed=11, max_new_tokens=33)]
    reqs = [GenerationRequest(f"r{i}", [1, 300 + i, 40 + i], resolve(rt.config.sampling, **sp))
            for i, sp in enumerate(specs)]
    reqs.append(GenerationRequest("stop", [1, 400], resolve(
        rt.config.sampling, temperature=0.0, max_new_tokens=80), stop=("the",)))
    return reqs


def _outputs(stories, chains: bool) -> tuple[dict, int]:
    rt, counting = _runtime(stories, chains)
    for req in _requests(rt):
        rt.submit(req)
    out = drain(rt)
    assert rt.pages.num_free == rt.plan.num_pages
    rt.close()
    return out, counting.chained


def test_chained_decodes_give_the_plain_outputs(stories):
    chained, num_chained = _outputs(stories, chains=True)
    plain, none = _outputs(stories, chains=False)
    assert none == 0
    assert num_chained > 50
    assert chained == plain


def test_a_cancel_lands_at_the_next_step_and_the_rest_run_on(stories):
    rt, counting = _runtime(stories, chains=True)
    reqs = _requests(rt)[:2]
    for req in reqs:
        rt.submit(req)
    got: dict[str, list[int]] = {}
    for _ in range(6):
        for ev in rt.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
    assert counting.chained > 0
    rt.cancel("r0")
    events = {ev.request_id: ev for ev in rt.step()}
    assert events["r0"].finish_reason is FinishReason.CANCELLED
    got["r1"] += events["r1"].token_ids
    for rid, toks in drain(rt).items():
        got[rid] += toks
    rt.close()
    alone, _ = _runtime(stories, chains=False)
    alone.submit(_requests(alone)[1])
    assert got["r1"] == drain(alone)["r1"]
    alone.close()


def test_hidden_state_requests_are_not_run_ahead(stories):
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    counting = Counting(eng)
    rt = InferenceRuntime(eng, stories.tokenizer, RuntimeConfig(max_batch=2, max_seq=128,
                                                                hidden_layer=-1))
    rt.preallocate()
    rt.submit(GenerationRequest("h", [1, 300], resolve(rt.config.sampling, temperature=0.0,
                                                       max_new_tokens=10),
                                capture_hidden=True))
    windows = sum(len(ev.hidden) for ev in _steps(rt))
    rt.close()
    assert counting.chained == 0
    assert windows == 10  # the prefill window and one per decode step


def _steps(rt: InferenceRuntime):
    while rt.has_work:
        yield from rt.step()


def test_a_chained_decode_takes_the_previous_rows_only(stories):
    eng = create_engine("torch", stories.config, stories.weights, device="cpu")
    eng.preallocate(EnginePlan(max_batch=2, max_seq=64, page_size=16, num_pages=8))
    with pytest.raises(FailedPrecondition, match="chained"):
        eng.decode([DecodeRow(CHAINED, 3, [0])])  # no decode before it
    eng.decode([DecodeRow(5, 3, [0]), DecodeRow(6, 3, [1])])
    eng.sample([])
    with pytest.raises(FailedPrecondition, match="chained"):
        eng.decode([DecodeRow(CHAINED, 4, [0])])  # another batch size
    eng.prefill([1, 2], 0, [2])
    with pytest.raises(FailedPrecondition, match="chained"):
        eng.decode([DecodeRow(CHAINED, 4, [0]), DecodeRow(CHAINED, 4, [1])])
    eng.close()


def test_chunked_prefill_and_preemption_on_the_adapter_give_the_plain_outputs(stories):
    """The torch engine through the adapter: prompts in 5-token chunks beside chained
    decodes, and a pool too small for every request at once."""
    def run(chunked: bool) -> tuple[dict, int, int]:
        eng = create_engine("torch", stories.config, stories.weights, device="cpu")
        cfg = RuntimeConfig(max_batch=3, max_seq=256)
        if chunked:  # three requests of 4 pages each in a pool of 6
            cfg = RuntimeConfig(max_batch=3, max_seq=256, max_tokens_per_step=5,
                                kv_memory_bytes=6 * 16 * eng.kv_bytes_per_token())
        rt = InferenceRuntime(eng, stories.tokenizer, cfg)
        rt.preallocate()
        counting = Counting(eng)
        for i, sp in enumerate([dict(temperature=0.0), dict(temperature=0.9, seed=7),
                                dict(temperature=0.8, top_p=0.9, seed=3)]):
            rt.submit(GenerationRequest(f"q{i}", [1, 300 + i, 40 + i, 7, 9 + i, 11, 13], resolve(
                rt.config.sampling, max_new_tokens=56, **sp), ignore_eos=True))
        out = drain(rt)
        assert rt.pages.num_free == rt.plan.num_pages
        rt.close()
        return out, rt.scheduler.preemptions, counting.chained

    plain, _, _ = run(chunked=False)
    chunked, preemptions, chained = run(chunked=True)
    assert preemptions > 0 and chained > 0
    assert chunked == plain
