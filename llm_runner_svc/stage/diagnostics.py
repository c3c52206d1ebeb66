"""What Diagnostics reports: per slot after Finish, and the stage-wide state accounting
(from a snapshot the stage publishes, not from its internals)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llm_runner_svc.runtime.prefix_cache import PrefixCache
from llm_runner_svc.runtime.request import RequestMetrics
from llm_runner_svc.stage.admission import is_queued, tokens_in_flight
from llm_runner_svc.stage.config import StageConfig
from services.stage.slot import Slot
from services.stage.snapshot import CoreSnapshot, core_diagnostics


def slot_diagnostics(slot: Slot, config: StageConfig) -> dict[str, Any]:
    """Keys owned by this stage; filled whether or not any profiling was on."""
    run, tel = slot.run, slot.telemetry
    out: dict[str, Any] = {
        "request_id": slot.request.request_id,
        "finish_reason": run.ended.value if run.ended else None,
        "tokens_in": len(slot.admitted),
        "tokens_out": len(run.output_ids),
        "prefix_cache_hits": int(bool(run.metrics and run.metrics.cached_tokens)),
        "cached_tokens": run.metrics.cached_tokens if run.metrics else 0,
        "prefilled_tokens": run.metrics.prefilled_tokens if run.metrics else 0,
        "engine": config.engine,
        "adapter": slot.request.lora,  # "" = the base model
        "admit_ms": round(tel.admit_ms, 3),
        "prepare_ms": round(tel.prepare_ms, 3),
        "decode_steps": tel.num_steps,
        "max_batch_size": tel.max_batch_size,
        "mean_batch_size": round(tel.batch_size_sum / tel.num_steps, 3)
        if tel.num_steps else 0.0,
    }
    if run.error:
        out["error"] = run.error
    media = getattr(slot.admitted, "media", None)
    if media is not None and media.num_images:
        out["media"] = media.as_dict()
    if slot.request.wants_hidden:
        out["hidden_windows"] = tel.num_hidden_windows
        out["hidden_states_crc32"] = tel.hidden_crc32
    if slot.prepared is not None:
        sp = slot.prepared.request.sampling
        out["sampling"] = {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
                           "max_tokens": sp.max_new_tokens, "seed": str(slot.prepared.seed),
                           **{k: getattr(sp, k) for k, off in SAMPLING_EXTRAS
                              if getattr(sp, k) != off}}
        constraint = slot.prepared.request.constraint
        if constraint is not None:
            out["structured_output"] = constraint.kind
    if run.metrics is not None:
        out["timings"] = run.metrics.as_dict()
        if run.metrics.target_steps:  # a speculative request
            out.update({k: out["timings"][k] for k in SPEC_KEYS})
        if run.metrics.spec_disabled_reason:  # ... that stopped speculating
            out["spec_disabled_reason"] = run.metrics.spec_disabled_reason
            out["spec_disabled_at_token"] = run.metrics.spec_disabled_at_token
    return out


# Sampling values reported only when a request changed them from their default (off).
SAMPLING_EXTRAS = (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                   ("repetition_penalty", 1.0), ("min_p", 0.0), ("logprobs", None),
                   ("prompt_logprobs", None))
SPEC_KEYS = ("proposed_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_target_step")


@dataclass(frozen=True)
class StageSnapshot:
    """The stage-wide state at one moment. Every count returns to its idle value (0, or all
    pages free) once no request is left, however the requests ended."""

    stage_id: str
    core: CoreSnapshot
    kv_pages_total: int
    kv_pages_free: int
    num_running: int
    num_waiting: int
    num_queued: int  # slots not yet joined + requests waiting in the runtime
    tokens_in_flight: int
    max_queued: int
    max_tokens_in_flight: int
    hidden_subscriptions: int
    hidden_messages_published: int
    hidden_bytes_published: int
    hidden_max_lag: int
    hidden_shm_rings: int  # shared-memory rings the port holds
    hidden_shm_bytes: int  # and their bytes (of /dev/shm)
    admitting: int  # Admits still tokenizing
    hidden_prompt_held_bytes: int = 0  # prompt states held until the prompt is prefilled
    prefix_cache_hits: int = 0  # requests that reused a cached prefix, since start
    prefix_cache_hit_tokens: int = 0  # positions they reused
    prefix_cache_pages: int = 0  # pages the prefix cache names (held or idle)
    prefix_cache_evictions: int = 0  # named pages taken back for new requests, since start
    prefix_cache_hidden_bytes: int = 0  # captured states kept beside cached pages
    spec: RequestMetrics | None = None  # speculative counts since start (None: plain stage)
    encoder_cache_entries: int = 0  # images whose embeddings the encoder cache holds
    encoder_cache_bytes: int = 0  # and their bytes (at most encoder_cache_budget_bytes)
    encoder_cache_hits: int = 0  # images served from it, since start
    encoder_cache_evictions: int = 0  # entries dropped for the budget, since start
    images_encoded: int = 0  # images run through the vision tower, since start

    @classmethod
    def build(cls, core: CoreSnapshot, config: StageConfig, slots: Sequence[Slot], *,
              max_seq: int, num_waiting: int, spec: RequestMetrics | None = None,
              **values: int) -> StageSnapshot:
        return cls(stage_id=config.stage_id, core=core, num_waiting=num_waiting, spec=spec,
                   num_queued=sum(1 for s in slots if is_queued(s)) + num_waiting,
                   tokens_in_flight=tokens_in_flight(config, max_seq, slots),
                   max_queued=config.max_queued,
                   max_tokens_in_flight=config.max_tokens_in_flight, **values)


def prefix_cache_values(cache: PrefixCache | None) -> dict[str, int]:
    """The snapshot's prefix-cache fields (zeros without a cache)."""
    if cache is None:
        return {}
    st = cache.stats
    return {"prefix_cache_hits": st.hits, "prefix_cache_hit_tokens": st.hit_tokens,
            "prefix_cache_pages": cache.num_pages, "prefix_cache_evictions": st.evictions,
            "prefix_cache_hidden_bytes": st.hidden_bytes}


def encoder_values(images: Any) -> dict[str, int]:
    """The snapshot's images fields (zeros without a vision tower): `images` is the stage's
    ImageEncoder or None."""
    if images is None:
        return {}
    out = {"images_encoded": images.num_encoded}
    cache = images.cache
    if cache is not None:
        out |= {"encoder_cache_entries": len(cache), "encoder_cache_bytes": cache.num_bytes,
                "encoder_cache_hits": cache.stats.hits,
                "encoder_cache_evictions": cache.stats.evictions}
    return out


def stage_diagnostics(snap: StageSnapshot) -> dict[str, Any]:
    """Stage-wide Diagnostics (no slot)."""
    return {
        "stage_id": snap.stage_id, **core_diagnostics(snap.core),
        "kv_pages_total": snap.kv_pages_total, "kv_pages_free": snap.kv_pages_free,
        "running": snap.num_running, "waiting": snap.num_waiting,
        "hidden_subscriptions": snap.hidden_subscriptions,
        "hidden_messages_published": snap.hidden_messages_published,
        "hidden_bytes_published": snap.hidden_bytes_published,
        "hidden_max_lag": snap.hidden_max_lag,
        "hidden_shm_rings": snap.hidden_shm_rings, "hidden_shm_bytes": snap.hidden_shm_bytes,
        "hidden_prompt_held_bytes": snap.hidden_prompt_held_bytes,
        "admitting": snap.admitting,
        "prefix_cache_hits": snap.prefix_cache_hits,
        "prefix_cache_hit_tokens": snap.prefix_cache_hit_tokens,
        "prefix_cache_pages": snap.prefix_cache_pages,
        "prefix_cache_evictions": snap.prefix_cache_evictions,
        "prefix_cache_hidden_bytes": snap.prefix_cache_hidden_bytes,
        "encoder_cache_entries": snap.encoder_cache_entries,
        "encoder_cache_bytes": snap.encoder_cache_bytes,
        "encoder_cache_hits": snap.encoder_cache_hits,
        "encoder_cache_evictions": snap.encoder_cache_evictions,
        "images_encoded": snap.images_encoded,
        "queued": snap.num_queued, "tokens_in_flight": snap.tokens_in_flight,
        "max_queued": snap.max_queued, "max_tokens_in_flight": snap.max_tokens_in_flight,
        **({} if snap.spec is None else {
            f"spec_{k}": v for k, v in snap.spec.as_dict().items() if k in SPEC_KEYS}),
    }
