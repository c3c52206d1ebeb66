"""The LLM stage's Prometheus metrics (names follow the usual serving conventions)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llm_runner_svc.stage.diagnostics import StageSnapshot
from services.metrics import LATENCY_BUCKETS
from services.stage.slot import Slot


class StageMetrics:
    """Histograms and counters fed as runs end; gauges read the stage's snapshot."""

    def __init__(self, snapshot: Callable[[], StageSnapshot]) -> None:
        r = self.registry = CollectorRegistry()
        b = LATENCY_BUCKETS
        self.ttft = Histogram("llmstage_time_to_first_token_seconds",
                              "Join to first token, per request", registry=r, buckets=b)
        self.itl = Histogram("llmstage_inter_token_latency_seconds",
                             "Mean time between tokens, per request", registry=r, buckets=b)
        self.e2e = Histogram("llmstage_e2e_request_latency_seconds",
                             "Join to end, per request", registry=r, buckets=b)
        self.queue = Histogram("llmstage_queue_time_seconds",
                               "Join to start of prefill, per request", registry=r, buckets=b)
        self.finished = Counter("llmstage_requests_finished_total", "Runs ended, by reason",
                                ["finish_reason"], registry=r)
        self.refused = Counter("llmstage_admissions_refused_total", "Admit answered false",
                               ["reason"], registry=r)
        self.prompt_tokens = Counter("llmstage_prompt_tokens_total", "Prompt tokens run",
                                     registry=r)
        self.generated_tokens = Counter("llmstage_generation_tokens_total",
                                        "Tokens generated", registry=r)
        # labels are the deployment's adapter names (Admit refuses others) and "base"
        self.adapter_requests = Counter("llmstage_adapter_requests_total",
                                        "Runs ended, by LoRA adapter", ["adapter"], registry=r)
        # speculative decoding: acceptance = accepted / proposed, tokens per target step =
        # verified tokens / target steps (rates of these counters)
        self.spec = {name: Counter(f"llmstage_spec_{name}_total", doc, registry=r)
                     for name, doc in (
                         ("proposed_tokens", "Tokens proposed to verify rows"),
                         ("accepted_tokens", "Proposed tokens the target agreed with"),
                         ("target_steps",
                          "Decode rows of speculative requests (target forwards)"),
                         ("verified_tokens", "Tokens those decode rows yielded"))}
        gauges: dict[str, tuple[str, Callable[[StageSnapshot], float]]] = {
            "llmstage_requests_running": ("Requests decoding", lambda s: s.num_running),
            "llmstage_requests_waiting": ("Requests waiting for a batch row",
                                          lambda s: s.num_waiting),
            "llmstage_kv_pages_used": ("KV pages in use",
                                       lambda s: s.kv_pages_total - s.kv_pages_free),
            "llmstage_kv_pages_free": ("KV pages free", lambda s: s.kv_pages_free),
            "llmstage_hidden_bytes_published": ("Hidden-state tensor bytes published so far",
                                                lambda s: s.hidden_bytes_published),
            "llmstage_hidden_subscriber_lag_messages": (
                "Messages the furthest-behind hidden subscriber has not read",
                lambda s: s.hidden_max_lag),
            "llmstage_hidden_subscriptions": ("Open hidden-port subscriptions",
                                              lambda s: s.hidden_subscriptions),
            "llmstage_prefix_cache_hits": ("Requests that reused a cached prefix",
                                           lambda s: s.prefix_cache_hits),
            "llmstage_prefix_cache_hit_tokens": ("Prompt positions reused from the cache",
                                                 lambda s: s.prefix_cache_hit_tokens),
            "llmstage_prefix_cache_pages": ("KV pages the prefix cache names",
                                            lambda s: s.prefix_cache_pages),
            "llmstage_prefix_cache_evictions": ("Cached pages evicted for new requests",
                                                lambda s: s.prefix_cache_evictions),
            "llmstage_encoder_cache_bytes": ("Bytes of image embeddings the encoder cache holds",
                                             lambda s: s.encoder_cache_bytes),
            "llmstage_encoder_cache_hits": ("Images served from the encoder cache so far",
                                            lambda s: s.encoder_cache_hits),
            "llmstage_images_encoded": ("Images run through the vision tower so far",
                                        lambda s: s.images_encoded),
            "llmstage_spec_acceptance_rate": (
                "Proposed tokens accepted over proposed, every speculative step so far",
                lambda s: s.spec.acceptance_rate if s.spec is not None else 0.0),
            "llmstage_spec_tokens_per_target_step": (
                "Tokens per speculative target forward, every speculative step so far",
                lambda s: s.spec.tokens_per_target_step if s.spec is not None else 0.0),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(
                lambda read=read: read(snapshot()))  # type: ignore[misc]

    def run_ended(self, slot: Slot) -> None:
        m = slot.run.metrics
        reason = slot.run.ended.value if slot.run.ended else "unknown"
        self.finished.labels(reason).inc()
        self.adapter_requests.labels(slot.request.lora or "base").inc()
        if m is None or not slot.telemetry.t_join_ns:
            return
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generated_tokens.inc(m.generated_tokens)
        for name, counter in self.spec.items():
            counter.inc(getattr(m, name))
        self.queue.observe(m.queue_ms / 1000.0)
        if m.generated_tokens:
            self.ttft.observe(m.ttft_ms / 1000.0)
            self.e2e.observe((m.ttft_ms + m.decode_ms) / 1000.0)
        if m.generated_tokens > 1:
            self.itl.observe(m.decode_ms / 1000.0 / (m.generated_tokens - 1))
