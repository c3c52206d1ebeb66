"""The torch engine's device path on a CUDA GPU (CUDA graphs, Triton kernels): the checks of
test_sampling_processors.py where the picks, masks, penalties, log-probabilities and prompt
scores are computed on the device and reach the host through pinned buffers, one step's
copies in flight while the next is launched. float32 weights against the numpy engine, bf16
against the engine's own logits. These tests need a GPU; CI has none."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_sampling_processors import (  # noqa: E402
    AllowSet,
    _log_softmax,
    _prompt,
    _rows,
    _specs,
    check_prompt_scores,
)

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import Engine, EnginePlan  # noqa: E402
from llm_runner_svc.engines.batch import Batch, Penalties, Row, SampleSpec  # noqa: E402
from llm_runner_svc.engines.numpy_processors import pick_rows, process_rows  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PLAN = EnginePlan(max_batch=4, max_seq=128, page_size=8, num_pages=64, prefill_chunk=5)
TOLERANCE = 1e-3  # float32 on the GPU against the numpy engine


def _cuda(stories, dtype: str, plan: EnginePlan = PLAN) -> Engine:
    engine = create_engine("torch", stories.config, stories.weights, device="cuda",
                           dtype=dtype)
    engine.preallocate(plan)
    return engine


def _decode_rows(specs: list[SampleSpec], starts: list[int]) -> tuple[Row, ...]:
    """Rows feeding the picks of the previous step's rows 0 .. len(specs)-1."""
    return tuple(Row((), start, tuple(range(16 * i, 16 * i + 16)), sample=spec, from_pick=i)
                 for i, (spec, start) in enumerate(zip(specs, starts, strict=True)))


def test_float32_matches_numpy_with_steps_in_flight(stories):
    """A prefill step with every feature, then a decode step launched before the first is
    read (its masks and copies in the other turn's buffers): the numpy engine's picks,
    log-probabilities and scores."""
    ids = _prompt(stories)
    specs = _specs(ids)
    starts = [len(ids) - 3 + i for i in range(4)]
    then = [SampleSpec(0.0, 0, 1.0, logprobs=4, mask=AllowSet([9, 10, 11])),
            SampleSpec(0.7, 0, 0.95, uniform=0.6, logprobs=1),
            SampleSpec(0.0, 0, 1.0, penalties=Penalties(1.0, 0.5, 1.5, {3: 1}, frozenset(ids))),
            SampleSpec(0.0, 0, 1.0, logprobs=0)]
    numpy_engine = create_engine("numpy", stories.config, stories.weights)
    numpy_engine.preallocate(PLAN)
    want = [numpy_engine.read(numpy_engine.launch(Batch(_rows(ids, specs))))]
    want.append(numpy_engine.read(numpy_engine.launch(Batch(_decode_rows(then, starts)))))
    engine = _cuda(stories, "float32")
    try:
        first = engine.launch(Batch(_rows(ids, specs)))
        second = engine.launch(Batch(_decode_rows(then, starts)))
        got = [engine.read(first), engine.read(second)]
    finally:
        engine.close()
    for w, g in zip(want, got, strict=True):
        assert list(g.picks) == list(w.picks)
        for a, b in zip(w.logprobs, g.logprobs, strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOLERANCE
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    for a_row, b_row in zip(want[0].scores, got[0].scores, strict=True):
        assert (a_row is None) == (b_row is None)
        if a_row is not None and b_row is not None:
            assert [s.token_id for s in a_row] == [s.token_id for s in b_row]
            np.testing.assert_allclose([s.logprob for s in a_row],
                                       [s.logprob for s in b_row], atol=TOLERANCE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_masks_and_penalties_on_the_engines_own_logits(stories, dtype):
    """Each row's pick and log-probabilities against the host rules applied to the logits
    the same forward gave (taken by running the row again without processing), over steps
    that alternate the pinned buffers; decode steps replay the captured graphs."""
    ids = _prompt(stories)
    engine = _cuda(stories, dtype)
    try:
        allowed = [11, 40, 300, 301, 511]
        for step in range(4):
            prompt = tuple(ids[:6 + step])
            pen = Penalties(0.4, 0.2, 1.2, {prompt[-1]: 2, 40: 1}, frozenset(prompt))
            specs = [SampleSpec(0.0, 0, 1.0, mask=AllowSet(allowed), logprobs=3),
                     SampleSpec(1.0, 0, 1.0, uniform=0.25 * step + 0.1, penalties=pen,
                                min_p=0.02, logprobs=0),
                     SampleSpec(0.0, 0, 1.0, mask=AllowSet([])),
                     SampleSpec(0.8, 5, 1.0, uniform=0.5, logit_bias={300: 5.0},
                                mask=AllowSet(allowed[1:]), logprobs=2)]
            rows = tuple(Row(prompt, 0, tuple(range(16 * i, 16 * i + 16)))
                         for i in range(4))
            engine.read(engine.launch(Batch(rows, keep_logits=True)))
            raw = engine.logits(4).copy()
            sampled = tuple(Row(r.tokens, 0, r.pages, sample=s)
                            for r, s in zip(rows, specs, strict=True))
            out = engine.read(engine.launch(Batch(sampled)))
            picks, logprobs = pick_rows(raw.copy(), specs)
            assert list(out.picks) == picks
            assert out.picks[0] in allowed and out.picks[3] in allowed[1:]
            for a, b in zip(logprobs, out.logprobs, strict=True):
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert abs(a.logprob - b.logprob) < 1e-4
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]
            processed = raw.copy()
            process_rows(processed, specs)
            np.testing.assert_allclose(engine.logits(4), processed, rtol=1e-6)
            want = _log_softmax(raw[0])
            assert abs(out.logprobs[0].logprob - want[out.picks[0]]) < 1e-4
    finally:
        engine.close()


def test_plain_greedy_steps_keep_the_forwards_argmax(stories):
    ids = _prompt(stories)
    engine = _cuda(stories, "bfloat16")
    try:
        greedy = SampleSpec(0.0, 0, 1.0)
        out = engine.read(engine.launch(Batch(
            (Row(tuple(ids), 0, tuple(range(16)), sample=greedy),), keep_logits=True)))
        assert out.picks[0] == int(np.argmax(engine.logits(1)[0]))
        assert out.logprobs == [None] and out.scores == [None]
        for k in range(5):
            out = engine.read(engine.launch(Batch(
                (Row((), len(ids) + k, tuple(range(16)), sample=greedy, from_pick=0),),
                keep_logits=True)))
            assert out.picks[0] == int(np.argmax(engine.logits(1)[0]))
    finally:
        engine.close()


@pytest.mark.parametrize("dtype, chunk, tolerance", [("float32", 4, TOLERANCE),
                                                     ("bfloat16", 256, 0.1)])
def test_prompt_scores_against_one_position_at_a_time(stories, dtype, chunk, tolerance):
    """chunk 4: more scored positions in a step than the device holds (copied early)."""
    ids = _prompt(stories)
    plan = EnginePlan(max_batch=2, max_seq=64, page_size=8, num_pages=16, prefill_chunk=chunk)
    engine = _cuda(stories, dtype, plan)
    try:
        check_prompt_scores(engine, ids, tolerance)
    finally:
        engine.close()


def test_picking_waits_for_nothing_on_the_device(stories):
    """`Picks.start` with every feature queues its work and copies without a synchronising
    call (CUDA's sync debug mode raises at one); the step's one wait is `Picks.wait`."""
    ids = _prompt(stories)
    engine = _cuda(stories, "bfloat16")
    try:
        rows = tuple(Row(tuple(ids), 0, tuple(range(16 * i, 16 * i + 16))) for i in range(4))
        engine.read(engine.launch(Batch(rows, keep_logits=True)))
        specs = _specs(ids)
        picks = engine.picks  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            started = picks.start(specs, has_argmax=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        picked = picks.wait(started)
        assert picked.picks[3] == 77 and picked.logprobs[0] is not None
    finally:
        engine.close()
