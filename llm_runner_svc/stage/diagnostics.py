"""What Diagnostics reports: per slot after Finish, and stage-wide counters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llm_runner_svc.stage.admission import is_queued, tokens_in_flight
from llm_runner_svc.stage.config import StageConfig
from llm_runner_svc.stage.slots import Slot, SlotState

if TYPE_CHECKING:
    from llm_runner_svc.stage.llm_stage import LlmStage


def slot_diagnostics(slot: Slot, config: StageConfig) -> dict[str, Any]:
    """Keys owned by this stage; filled whether or not any profiling was on."""
    req = slot.runtime_request
    out: dict[str, Any] = {
        "request_id": slot.request.request_id,
        "finish_reason": slot.ended.value if slot.ended else None,
        "tokens_in": len(slot.prompt_ids),
        "tokens_out": len(slot.output_ids),
        "prefix_cache_hits": 0,
        "engine": config.engine,
        "admit_ms": round(slot.admit_ms, 3),
        "prepare_ms": round(slot.prepare_ms, 3),
        "decode_steps": slot.num_steps,
        "max_batch_size": slot.max_batch_size,
        "mean_batch_size": round(slot.batch_size_sum / slot.num_steps, 3)
        if slot.num_steps else 0.0,
    }
    if slot.error:
        out["error"] = slot.error
    if slot.request.wants_hidden:
        out["hidden_windows"] = slot.num_hidden_windows
        out["hidden_states_crc32"] = slot.hidden_crc32
    if req is not None:
        sp = req.sampling
        out["sampling"] = {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
                           "max_tokens": sp.max_new_tokens, "seed": str(slot.seed)}
    if slot.metrics is not None:
        out["timings"] = slot.metrics.as_dict()
    return out


def stage_diagnostics(stage: LlmStage) -> dict[str, Any]:
    """Stage-wide state. Every count here returns to its idle value (0, or all pages free)
    once no request is left, however the requests ended: the reliability suite checks that."""
    slots, cfg = stage.slots, stage.config
    return {
        "stage_id": stage.config.stage_id,
        "slots": len(slots),
        "slots_by_state": {s.value: slots.count(s) for s in SlotState},
        "kv_pages_total": stage.runtime.pages.num_pages,
        "kv_pages_free": stage.runtime.pages.num_free,
        "running": stage.runtime.num_running,
        "waiting": stage.runtime.num_waiting,
        "cohorts": len(stage.loop.cohorts),
        "steps": stage.loop.num_steps,
        "draining": stage.is_draining,
        "hidden_subscriptions": stage.hidden.num_subscriptions,
        "hidden_messages_published": stage.hidden.num_messages_published,
        "hidden_bytes_published": stage.hidden.num_bytes_published,
        "hidden_max_lag": stage.hidden.max_lag,
        "queued": sum(1 for s in slots if is_queued(s)) + stage.runtime.num_waiting,
        "tokens_in_flight": tokens_in_flight(cfg, stage.runtime.max_seq, slots),
        "runs_indexed": stage.num_runs_indexed,
        "cohort_slots": sum(len(c.joined) for c in stage.loop.cohorts),
        "max_queued": cfg.max_queued,
        "max_tokens_in_flight": cfg.max_tokens_in_flight,
    }
