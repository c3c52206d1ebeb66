"""Routes: which stages one request runs through, computed once and frozen.

A stage is *required* when it is upstream of (or is) a sink the caller attached, and *available*
when all its inputs have a source: a request field that is present or an available stage's port.
A missing input fails the request when the stage says onMissing "fail", and drops the stage (and
whatever needed it) when it says "skip". The route is the required and available stages in
topological order; its fingerprint decides which requests may share a cohort.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.errors import InvalidArgument
from services.orchestrator.topology import Topology


@dataclass(frozen=True)
class Route:
    stages: tuple[str, ...]  # active stage ids, topological order
    sinks: tuple[str, ...]  # "stage:port" the caller receives

    @property
    def fingerprint(self) -> str:
        return "|".join(self.stages) + "=>" + ",".join(self.sinks)

    def sink_stages(self) -> list[str]:
        return list(dict.fromkeys(s.split(":", 1)[0] for s in self.sinks))


def compute_route(topology: Topology, sinks: Sequence[str], request_fields: Iterable[str]
                  ) -> Route:
    """The frozen route of one request; InvalidArgument when a sink cannot be served."""
    chosen = tuple(sinks) or topology.default_sinks
    for sink in chosen:
        if sink not in topology.sinks:
            raise InvalidArgument(f"sink {sink!r} is not offered (sinks: {list(topology.sinks)})")
    fields = set(request_fields) | {"prompt"}
    available: set[str] = set()
    for spec in topology.stages:
        missing = [i for i in spec.inputs if not _has_source(i, fields, available, topology)]
        if not missing:
            available.add(spec.stage_id)
        elif spec.on_missing == "fail" and _is_required(spec.stage_id, chosen, topology):
            raise InvalidArgument(f"stage {spec.stage_id} needs {missing[0]!r}, which this "
                                  "request does not provide")
    required = _upstream_closure([s.split(":", 1)[0] for s in chosen], topology)
    unserved = [s for s in chosen if s.split(":", 1)[0] not in available]
    if unserved:
        raise InvalidArgument(f"sink {unserved[0]!r} is skipped for this request (a stage it "
                              "needs has a missing input)")
    stages = tuple(s.stage_id for s in topology.stages
                   if s.stage_id in required and s.stage_id in available)
    return Route(stages, chosen)


def _has_source(inp: str, fields: set[str], available: set[str], topology: Topology) -> bool:
    src, port = inp.split(":", 1)
    if src == "request":
        return port in fields
    return src in available and port in topology.stage(src).emits


def _upstream_closure(stage_ids: list[str], topology: Topology) -> set[str]:
    seen: set[str] = set()
    todo = list(stage_ids)
    while todo:
        sid = todo.pop()
        if sid not in seen:
            seen.add(sid)
            todo.extend(topology.stage(sid).upstream())
    return seen


def _is_required(stage_id: str, sinks: Sequence[str], topology: Topology) -> bool:
    return stage_id in _upstream_closure([s.split(":", 1)[0] for s in sinks], topology)
