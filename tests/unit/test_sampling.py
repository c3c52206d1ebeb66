"""Token selection on crafted logits, and the seeded draw."""

from __future__ import annotations

import numpy as np
import pytest

from llm_runner_svc.engines.base import SampleSpec
from llm_runner_svc.engines.numpy_sampling import apply_logit_bias, sample_rows
from llm_runner_svc.runtime.sampling import uniform_draw

LOGITS = np.log(np.array([[0.05, 0.4, 0.3, 0.2, 0.05]], dtype=np.float32))


def _draws(spec_kw, n=2000):
    return [sample_rows(LOGITS.copy(), [SampleSpec(uniform=uniform_draw(7, i), **spec_kw)])[0]
            for i in range(n)]


def test_greedy_when_temperature_tiny_or_top_k_one():
    assert _draws(dict(temperature=0.0, top_k=50, top_p=1.0), 20) == [1] * 20
    assert _draws(dict(temperature=1.0, top_k=1, top_p=1.0), 20) == [1] * 20


def test_top_k_keeps_only_the_k_best():
    assert set(_draws(dict(temperature=1.0, top_k=2, top_p=1.0))) == {1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # 0.4 + 0.3 = 0.7 >= 0.65, so ids 1 and 2 only
    assert set(_draws(dict(temperature=1.0, top_k=0, top_p=0.65))) == {1, 2}
    assert set(_draws(dict(temperature=1.0, top_k=0, top_p=0.3))) == {1}


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(_draws(dict(temperature=1.0, top_k=0, top_p=1.0), 4000), minlength=5)
    np.testing.assert_allclose(counts / 4000, [0.05, 0.4, 0.3, 0.2, 0.05], atol=0.03)


def test_high_temperature_flattens():
    counts = np.bincount(_draws(dict(temperature=100.0, top_k=0, top_p=1.0), 4000), minlength=5)
    assert counts.min() > 600  # close to uniform (800 each)


def test_rows_are_independent_of_batch_mates():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 300)).astype(np.float32)
    specs = [SampleSpec(0.8, 40, 0.9, uniform_draw(s, 3)) for s in range(6)]
    together = sample_rows(logits.copy(), specs)
    alone = [sample_rows(logits[i:i + 1].copy(), [specs[i]])[0] for i in range(6)]
    assert together == alone


def test_logit_bias_is_added_in_place():
    logits = np.zeros((2, 4), np.float32)
    apply_logit_bias(logits, [SampleSpec(1.0, 0, 1.0, logit_bias={3: 2.5, 0: -1.0}),
                              SampleSpec(1.0, 0, 1.0)])
    assert logits.tolist() == [[-1.0, 0.0, 0.0, 2.5], [0.0, 0.0, 0.0, 0.0]]


def test_uniform_draw_is_deterministic_and_spread():
    a = [uniform_draw(42, i) for i in range(1000)]
    assert a == [uniform_draw(42, i) for i in range(1000)]
    assert a != [uniform_draw(43, i) for i in range(1000)]
    assert all(0.0 <= u < 1.0 for u in a)
    assert np.mean(a) == pytest.approx(0.5, abs=0.05)
