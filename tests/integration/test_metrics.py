"""Prometheus metrics of the runner and the orchestrator after a short load run."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from deployment import Deployment, collect, generate_request
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_count_what_was_sent(tmp) -> None:
    dep = Deployment(tmp, {"backbone": {"maxSeq": 512}}, metrics=True)
    try:
        runner = dep.all_stages[0]
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: collect(dep.stub.Generate(generate_request(
                "Once upon a time", max_tokens=10 + i, seed=i), timeout=30)), range(12)))
        for _ in range(3):  # refused by the stage: top_p out of range
            with pytest.raises(grpc.RpcError):
                collect(dep.stub.Generate(generate_request("Hi", top_p=2.0), timeout=30))
        generated = sum(len(r[0]) for r in results)
        assert generated == sum(10 + i for i in range(12))
        m = scrape(runner.metrics_url)
        assert m[("llmstage_requests_finished_total", (("finish_reason", "max_length"),))] == 12
        assert m[("llmstage_generation_tokens_total", ())] == generated
        assert m[("llmstage_prompt_tokens_total", ())] == 12 * 5
        for hist in ("llmstage_time_to_first_token_seconds", "llmstage_queue_time_seconds",
                     "llmstage_e2e_request_latency_seconds",
                     "llmstage_inter_token_latency_seconds"):
            assert m[(f"{hist}_count", ())] == 12, hist
            assert 0 < m[(f"{hist}_sum", ())] < 12 * 30, hist
        assert m[("llmstage_admissions_refused_total",
                  (("reason", "sampling_out_of_range"),))] == 3
        assert m[("llmstage_requests_running", ())] == 0
        assert m[("llmstage_kv_pages_used", ())] == 0
        assert m[("llmstage_kv_pages_free", ())] > 0
        assert m[("llmstage_hidden_bytes_published", ())] == 0  # no request asked for it
        assert m[("llmstage_hidden_subscriber_lag_messages", ())] == 0
        o = scrape(dep.metrics_url)
        assert o[("llmstage_orchestrator_requests_total", (("outcome", "max_length"),))] == 12
        assert o[("llmstage_orchestrator_requests_total",
                  (("outcome", "INVALID_ARGUMENT"),))] == 3
        assert o[("llmstage_orchestrator_time_to_first_token_seconds_count", ())] == 12
        assert o[("llmstage_orchestrator_e2e_request_latency_seconds_count", ())] == 12
        assert o[("llmstage_orchestrator_requests_running", ())] == 0
    finally:
        dep.close()
