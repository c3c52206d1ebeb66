"""benchmarks/bench_serving.py reads the load generator's files: the JSON summary into the
table's figures (a metric missing is a typed error, not a zero), and the requests it sent
into Generate requests for the direct comparison."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_serving import Point, ToolError, row_of, sent_requests, table  # noqa: E402


def _summary() -> dict:
    def dist(p50: float, p99: float) -> dict:
        return {"unit": "ms", "avg": p50, "p50": p50, "p99": p99}

    return {"request_count": {"avg": 64.0}, "error_summary": [{"count": 2}],
            "time_to_first_token": dist(120.0, 400.0), "inter_token_latency": dist(4.0, 9.5),
            "output_token_throughput": {"avg": 900.0}, "output_sequence_length": {"avg": 32.0},
            "goodput": {"avg": 10.5}, "good_request_fraction": {"avg": 0.75}}


def test_row_of_reads_percentiles_throughput_and_goodput() -> None:
    row = row_of(_summary())
    assert row["requests"] == 64 and row["errors"] == 2
    assert (row["ttft_p50"], row["ttft_p99"], row["itl_p50"], row["itl_p99"]) == (
        120.0, 400.0, 4.0, 9.5)
    assert (row["tokens_per_s"], row["goodput"], row["good_share"]) == (900.0, 10.5, 0.75)
    row.update(generate_tokens_per_s=1000.0, other_load=0.1)
    line = table([(Point(concurrency=8), row)]).splitlines()[-1]
    assert line.startswith("| c=8 | 64 (2) | 120.0 / 400.0 | 4.00 / 9.50 | 900.0 |")
    assert "| 0.90 |" in line  # gateway / Generate


def test_a_missing_metric_is_a_tool_error() -> None:
    summary = _summary()
    del summary["inter_token_latency"]["p99"]
    with pytest.raises(ToolError, match="inter_token_latency.p99"):
        row_of(summary)


def test_sent_requests_become_generate_requests(tmp_path: Path) -> None:
    (tmp_path / "inputs.json").write_text(json.dumps({"data": [
        {"payloads": [{"prompt": "Once upon", "max_tokens": 16, "ignore_eos": True}]},
        {"payloads": [{"messages": [{"role": "user", "content": "Hi"}],
                       "max_completion_tokens": 8}]}]}))
    text, chat = sent_requests(tmp_path, osl=32)
    assert (text.text, text.sampling.max_tokens, text.ignore_eos) == ("Once upon", 16, True)
    assert [(m.role, m.content) for m in chat.messages.messages] == [("user", "Hi")]
    assert (chat.sampling.max_tokens, chat.ignore_eos) == (8, True)
