"""State accounting of every service, read over the wire, and the idle check of each.

A runner reports its counters in stage-wide Diagnostics; the orchestrator in Topology (and
the same counts on its Prometheus endpoint, `llmstage_orchestrator_state{kind=...}`); the C++
talker in its stage-wide Diagnostics. "Idle" is the value every counter must return to once no
request is in flight, however the requests ended.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any

from google.protobuf.json_format import MessageToDict
from prometheus_client.parser import text_string_to_metric_families

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import stage_pb2 as pb

# Runner counters that must be 0 when idle.
RUNNER_ZERO = ("slots", "running", "waiting", "queued", "tokens_in_flight", "runs_indexed",
               "cohort_slots", "hidden_subscriptions", "hidden_max_lag", "hidden_shm_rings",
               "hidden_shm_bytes", "hidden_prompt_held_bytes", "admitting")
ORCHESTRATOR_ZERO = ("runs", "running", "queued", "in_flight", "stream_members")


def stage_state(stub: Any) -> dict[str, Any]:
    """Stage-wide Diagnostics of a runner or the talker."""
    return MessageToDict(stub.Diagnostics(pb.DiagnosticsRequest(), timeout=5).values)


def runner_leftovers(s: dict[str, Any], max_cohorts: int = 0) -> dict[str, Any]:
    """The runner counters that are not at their idle value (empty when idle). `max_cohorts`:
    Step streams a live orchestrator keeps open between requests."""
    bad = {k: s[k] for k in RUNNER_ZERO if s[k] != 0}
    if s["kv_pages_free"] != s["kv_pages_total"]:
        bad["kv_pages_used"] = s["kv_pages_total"] - s["kv_pages_free"]
    if s["cohorts"] > max_cohorts:
        bad["cohorts"] = s["cohorts"]
    if any(s["slots_by_state"].values()):
        bad["slots_by_state"] = s["slots_by_state"]
    return bad


def talker_leftovers(s: dict[str, Any]) -> dict[str, Any]:
    bad = {k: s[k] for k in ("slots", "hidden_subscriptions") if s[k] != 0}
    if s["cohorts"] > 1:
        bad["cohorts"] = s["cohorts"]
    return bad


def orchestrator_state(metrics_url: str, stub: Any) -> dict[str, float]:
    """The orchestrator's accounting from Topology; its Prometheus gauges must agree."""
    topo = stub.Topology(opb.TopologyRequest(), timeout=5)
    out: dict[str, float] = {
        "runs": topo.runs, "running": topo.running, "queued": topo.queued,
        "step_streams": topo.step_streams, "stream_members": topo.stream_members,
        "in_flight": sum(r.in_flight for s in topo.stages for r in s.replicas)}
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "llmstage_orchestrator_state":
            for sample in family.samples:
                out[f"metric_{sample.labels['kind']}"] = sample.value
    return out


def orchestrator_leftovers(s: dict[str, float]) -> dict[str, float]:
    bad = {k: s[k] for k in ORCHESTRATOR_ZERO if s[k] != 0}
    bad.update({f"metric_{k}": s[f"metric_{k}"] for k in ORCHESTRATOR_ZERO
                if f"metric_{k}" in s and s[f"metric_{k}"] != 0})
    return bad


def wait_for(read: Callable[[], dict[str, Any]], leftovers: Callable[[dict[str, Any]], dict],
             timeout: float = 15.0) -> dict[str, Any]:
    """Poll `read` until `leftovers` of it is empty; return what was left at the timeout
    (empty on success), with the last full reading under "state"."""
    deadline = time.monotonic() + timeout
    while True:
        state = read()
        bad = leftovers(state)
        if not bad or time.monotonic() > deadline:
            return bad and {**bad, "state": state}
        time.sleep(0.05)
