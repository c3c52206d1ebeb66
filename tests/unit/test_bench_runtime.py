"""benchmarks/bench_runtime.py's breakdown of a decode step: the engine is timed on the path
the runtime's step takes (one launch + read of the batch), and the runtime and dispatch
shares are parts of the step, each and together within 0..100%."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_runtime import engine_step_time, step_shares  # noqa: E402
from helpers import make_runtime  # noqa: E402


@pytest.mark.parametrize(("step_s", "engine_s", "dispatch_s"), [
    (1.0, 0.6, 0.2),  # an ordinary step
    (1.06, 1.32, 3.56),  # engine and toy timed above the step: the figures that read 335.8%
    (2.0, 0.5, 0.9),  # a toy as costly as the model (tiny widths either way)
])
def test_shares_are_parts_of_the_step(step_s: float, engine_s: float, dispatch_s: float):
    shares = step_shares(step_s, engine_s, dispatch_s)
    assert 0.0 <= shares["runtime_share"] <= 1.0
    assert 0.0 <= shares["dispatch_share"] <= 1.0
    assert shares["runtime_share"] + shares["dispatch_share"] <= 1.0 + 1e-12


def test_ordinary_shares_are_the_plain_ratios():
    assert step_shares(1.0, 0.6, 0.2) == pytest.approx(
        {"runtime_share": 0.4, "dispatch_share": 0.2})


def test_engine_time_is_the_runtimes_step_path(stories):
    rt = make_runtime(stories, max_batch=4, max_seq=128)
    calls: list[str] = []
    engine: Any = rt.engine
    for name in ("launch", "read", "decode", "sample"):
        original = getattr(engine, name)

        def counted(*args: Any, _name: str = name, _original: Any = original) -> Any:
            calls.append(_name)
            return _original(*args)

        setattr(engine, name, counted)
    try:
        free = rt.pages.num_free
        assert engine_step_time(rt, batch=4, steps=3) > 0
        assert rt.pages.num_free == free  # its pages given back
    finally:
        rt.close()
    assert set(calls) == {"launch", "read"} and calls.count("launch") == 4  # a warm-up + 3
