"""Topology validation (services.orchestrator.topology) and route computation (routes)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from services.errors import InvalidArgument, NotFound
from services.orchestrator.routes import compute_route
from services.orchestrator.topology import (
    RUNNER_PORTS,
    load_topology,
    parse_topology,
    single_stage,
    with_endpoints,
)


def stage(sid: str, emits: list[str] | None = None, inputs: list[str] | None = None,
          **extra: Any) -> dict[str, Any]:
    """A minimal valid stage dict."""
    return {"id": sid, "runner": "llm.backbone", "endpoints": ["127.0.0.1:1"],
            "emits": emits or ["text"], "inputs": inputs or ["request:prompt"], **extra}


def two_stage() -> dict[str, Any]:
    """'mirror' listed first although it consumes 'thinker'."""
    return {"stages": [stage("mirror", ["text"], ["request:prompt", "thinker:hidden"]),
                       stage("thinker", ["text", "tokens", "hidden"])]}


def captioner_doc(on_missing: str) -> dict[str, Any]:
    return {"stages": [stage("backbone"),
                       stage("captioner", inputs=["request:messages"], onMissing=on_missing)],
            "sinks": ["backbone:text", "captioner:text"]}


def test_two_stage_loads_in_topological_order_with_defaults() -> None:
    topo = parse_topology(two_stage())
    assert [s.stage_id for s in topo.stages] == ["thinker", "mirror"]
    assert topo.sinks == ("mirror:text", "thinker:text", "thinker:tokens", "thinker:hidden")
    assert topo.default_sinks == ("mirror:text",)
    assert (topo.max_running, topo.max_queued) == (64, 256)
    assert all(s.on_missing == "fail" for s in topo.stages)
    mirror = topo.stage("mirror")
    assert mirror.inputs == ("request:prompt", "thinker:hidden")
    assert mirror.upstream() == ["thinker"]
    assert mirror.endpoints == ("127.0.0.1:1",)
    assert mirror.launch_replicas == 0 and mirror.launch_config is None


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _del(path: tuple[Any, ...]) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


CYCLE = {"stages": [stage("a", inputs=["b:text"]), stage("b", inputs=["a:text"])]}

INVALID = [
    ("top_key", _set(("bogus",), 1), "topology.bogus: unknown key"),
    ("stage_key", _set(("stages", 0, "bogus"), 1), "stages[0].bogus: unknown key"),
    ("launch_key", _set(("stages", 0, "launch"), {"config": "s.json", "bogus": 1}),
     "stages[0].launch.bogus: unknown key"),
    ("runner", _set(("stages", 0, "runner"), "llm.nope"), "unknown runner 'llm.nope'"),
    ("port", _set(("stages", 1, "emits"), ["text", "audio"]), "has no port 'audio'"),
    ("duplicate", _set(("stages", 0, "id"), "thinker"), "duplicate id 'thinker'"),
    ("no_stage", _set(("stages", 0, "inputs"), ["ghost:text"]), "has no source"),
    ("no_port", _set(("stages", 0, "inputs"), ["thinker:audio"]), "has no source"),
    ("request_field", _set(("stages", 0, "inputs"), ["request:bogus"]),
     "unknown request field"),
    ("no_colon", _set(("stages", 0, "inputs"), ["prompt"]), "is not 'stage:port'"),
    ("sink", _set(("sinks",), ["thinker:text", "mirror:hidden"]),
     "sinks: 'mirror:hidden' is not a port any stage emits"),
    ("default_sink", lambda d: d.update(sinks=["thinker:text"], defaultSinks=["mirror:text"]),
     "defaultSinks: 'mirror:text' is not one of the sinks"),
    ("max_running_0", _set(("maxRunning",), 0), "maxRunning: must be an integer >= 1"),
    ("max_queued_neg", _set(("maxQueued",), -1), "maxQueued: must be an integer >= 0"),
    ("max_running_str", _set(("maxRunning",), "4"), "maxRunning: must be an integer"),
    ("on_missing", _set(("stages", 0, "onMissing"), "maybe"), "onMissing: 'fail' or 'skip'"),
    ("no_endpoints", _del(("stages", 0, "endpoints")), "stages[0].endpoints"),
    ("empty_endpoints", _set(("stages", 0, "endpoints"), []),
     "stages[0].endpoints: at least one host:port"),
    ("id_colon", _set(("stages", 0, "id"), "mi:rror"), "stages[0].id: a non-empty name"),
    ("id_request", _set(("stages", 0, "id"), "request"), "stages[0].id: a non-empty name"),
    ("stages_empty", _set(("stages",), []), "at least one stage is required"),
    ("replicas_0", _set(("stages", 0, "launch"), {"config": "s.json", "replicas": 0}),
     "launch.replicas: an integer >= 1"),
]


@pytest.mark.parametrize(("mutate", "needle"), [(m, n) for _, m, n in INVALID],
                         ids=[i for i, _, _ in INVALID])
def test_invalid_topology_names_the_rule(mutate: Any, needle: str) -> None:
    doc = two_stage()
    mutate(doc)
    with pytest.raises(InvalidArgument) as err:
        parse_topology(doc)
    assert err.value.code == "INVALID_ARGUMENT"
    assert needle in err.value.message


@pytest.mark.parametrize("doc", [CYCLE, [CYCLE], "stages", None], ids=["cycle", "list", "str",
                                                                       "none"])
def test_cycle_and_non_object(doc: Any) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_topology(copy.deepcopy(doc))
    needle = "cycle" if doc is CYCLE else "a topology is an object"
    assert needle in err.value.message


def test_unknown_runner_lists_known_runners() -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_topology({"stages": [dict(stage("x"), runner="bogus")]})
    assert all(name in err.value.message for name in RUNNER_PORTS)


def test_launch_resolves_config_and_replicas(tmp_path: Any) -> None:
    raw = stage("thinker", launch={"config": "stage.json", "replicas": 2})
    del raw["endpoints"]
    path = tmp_path / "topology.json"
    path.write_text(json.dumps({"stages": [raw]}))
    spec = load_topology(path).stage("thinker")
    assert spec.launch_replicas == 2
    assert spec.launch_config == str(tmp_path / "stage.json")
    assert spec.endpoints == ()


def test_load_topology_errors(tmp_path: Any) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(NotFound) as nf:
        load_topology(missing)
    assert nf.value.code == "NOT_FOUND" and str(missing) in nf.value.message
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument) as err:
        load_topology(bad)
    assert err.value.message.startswith(f"{bad}: ") and "JSON" in err.value.message
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps({"stages": [], "extra": 1}))
    with pytest.raises(InvalidArgument) as err:
        load_topology(invalid)
    assert err.value.message.startswith(f"{invalid}: topology.extra: unknown key")


def test_single_stage_and_with_endpoints() -> None:
    topo = single_stage(["h:1"])
    assert [s.stage_id for s in topo.stages] == ["backbone"]
    assert topo.sinks == ("backbone:text", "backbone:tokens")
    assert topo.default_sinks == ("backbone:text",)
    assert topo.stage("backbone").endpoints == ("h:1",)
    two = parse_topology(two_stage())
    moved = with_endpoints(two, {"mirror": ["h:2", "h:3"]})
    assert moved.stage("mirror").endpoints == ("h:2", "h:3")
    assert moved.stage("thinker").endpoints == ("127.0.0.1:1",)
    assert two.stage("mirror").endpoints == ("127.0.0.1:1",)  # the original is untouched


def test_route_prunes_stages_not_upstream_of_sinks() -> None:
    topo = parse_topology(two_stage())
    assert compute_route(topo, ["thinker:text"], ["prompt"]).stages == ("thinker",)
    route = compute_route(topo, ["mirror:text"], ["prompt"])
    assert route.stages == ("thinker", "mirror") and route.sinks == ("mirror:text",)
    default = compute_route(topo, [], ["prompt"])
    assert default.sinks == topo.default_sinks and default.stages == ("thinker", "mirror")


def test_route_fingerprints() -> None:
    topo = parse_topology(two_stage())
    a = compute_route(topo, ["mirror:text"], ["prompt"])
    b = compute_route(topo, ["mirror:text"], ["prompt", "text"])
    assert a.fingerprint == b.fingerprint
    c = compute_route(topo, ["thinker:text"], ["prompt"])
    d = compute_route(topo, ["thinker:tokens"], ["prompt"])
    assert c.stages == d.stages and c.fingerprint != d.fingerprint


def test_route_unknown_sink() -> None:
    with pytest.raises(InvalidArgument, match="not offered"):
        compute_route(parse_topology(two_stage()), ["ghost:text"], ["prompt"])


def test_route_on_missing_skip() -> None:
    topo = parse_topology(captioner_doc("skip"))
    with pytest.raises(InvalidArgument, match="skipped"):
        compute_route(topo, ["captioner:text"], ["text"])
    assert compute_route(topo, ["backbone:text"], ["text"]).stages == ("backbone",)
    assert compute_route(topo, ["captioner:text"], ["messages"]).stages == ("captioner",)


def test_route_on_missing_fail() -> None:
    topo = parse_topology(captioner_doc("fail"))
    with pytest.raises(InvalidArgument, match="needs"):
        compute_route(topo, ["captioner:text"], ["text"])
    assert compute_route(topo, ["backbone:text"], ["text"]).stages == ("backbone",)


@pytest.mark.parametrize("change,needle", [
    ({"sinks": []}, "sinks"), ({"defaultSinks": []}, "defaultSinks")])
def test_empty_sink_lists_are_refused(change: dict, needle: str) -> None:
    doc = {"stages": [{"id": "a", "runner": "llm.backbone", "endpoints": ["127.0.0.1:1"],
                       "emits": ["text"]}], **change}
    with pytest.raises(InvalidArgument) as err:
        parse_topology(doc)
    assert needle in err.value.message


def test_a_stage_without_ports_is_refused() -> None:
    doc = {"stages": [{"id": "a", "runner": "llm.backbone", "endpoints": ["127.0.0.1:1"],
                       "emits": []}]}
    with pytest.raises(InvalidArgument, match="emits"):
        parse_topology(doc)
