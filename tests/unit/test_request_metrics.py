"""tokens_per_s is the request's generation rate: every generated token over prefill_ms +
decode_ms. A short run must not read faster than its engine can compute, whatever the
launch-ahead does to where the first token's time falls. The README shows the line
`llm-runner generate` prints."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import make_runtime

from llm_runner_svc.runtime import GenerationRequest, RequestMetrics, resolve

STEP_S = 0.01  # each forward of the slowed engine takes at least this long


def test_rate_is_tokens_over_prefill_and_decode() -> None:
    m = RequestMetrics(generated_tokens=2, prefill_ms=2.0, decode_ms=0.1)
    assert m.tokens_per_s == pytest.approx(2 / 0.0021)
    assert RequestMetrics(generated_tokens=1, prefill_ms=4.0).tokens_per_s == pytest.approx(250)
    assert RequestMetrics(prefill_ms=4.0).tokens_per_s == 0.0
    assert RequestMetrics(generated_tokens=3).tokens_per_s == 0.0  # no time measured


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_a_short_run_reads_no_faster_than_its_forwards(stories, max_tokens: int) -> None:
    rt = make_runtime(stories, max_batch=1, max_seq=128)
    launch = rt.engine.launch

    def slow_launch(batch: Any) -> Any:  # the numpy engine computes at launch
        handle = launch(batch)
        time.sleep(STEP_S)
        return handle

    rt.engine.launch = slow_launch  # type: ignore[method-assign]
    try:
        ids = stories.tokenizer.encode("Once upon a time", add_bos=True)
        request = GenerationRequest("r", ids, resolve(rt.config.sampling, temperature=0.0,
                                                      max_new_tokens=max_tokens),
                                    ignore_eos=True)
        metrics = None
        for ev in rt.generate(request):
            metrics = ev.metrics or metrics
    finally:
        rt.close()
    assert metrics is not None and metrics.generated_tokens == max_tokens
    # N tokens took N forwards (a prefill, then N - 1 decodes), each at least STEP_S.
    assert 0 < metrics.tokens_per_s <= 1 / STEP_S


def _fields(line: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in line.split()[1:])


def test_the_readmes_metrics_line_is_what_generate_prints() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    shown = next(line for line in readme.splitlines() if line.startswith("[max_length] seed="))
    res = subprocess.run([sys.executable, "-m", "llm_runner_svc", "generate", "--max-tokens", "3",
                          "--seed", "1", "Once upon a time"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    printed = res.stderr.splitlines()[-1]
    assert list(_fields(shown)) == list(_fields(printed)), (shown, printed)
    # and its rate is the one its own times give
    f = _fields(shown)
    m = RequestMetrics(generated_tokens=int(f["generated_tokens"]),
                       prefill_ms=float(f["prefill_ms"]), decode_ms=float(f["decode_ms"]))
    assert float(f["tokens_per_s"]) == m.as_dict()["tokens_per_s"]
