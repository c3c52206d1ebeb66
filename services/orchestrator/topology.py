"""The topology file: stages, their replicas, ports and inputs, and the sinks a caller may attach.

    {"stages": [{"id": "backbone", "runner": "llm.backbone",
                 "endpoints": ["127.0.0.1:50051"], "emits": ["text", "tokens"],
                 "inputs": ["request:prompt"], "onMissing": "fail",
                 "launch": {"config": "stage.json", "replicas": 2}}],
     "sinks": ["backbone:text"], "defaultSinks": ["backbone:text"],
     "maxRunning": 64, "maxQueued": 256}

`discover` (instead of `endpoints`) names a DNS target whose A records are the replicas,
`dns:///runner-headless.ns.svc:50051` (system resolver) or `dns://SERVER:PORT/NAME:PORT`; the
orchestrator re-resolves it while it runs (services/orchestrator/discovery.py).
`servedModelName` (optional) is the name the OpenAI gateway serves the stage's text under,
instead of its id (a Hugging Face repo id, say, that clients load its tokenizer by).
`launch` (optional) tells `llm-stage up` how to start the stage locally: `llm-runner serve` with
that stage config file (relative to the topology file; the embedded default without one), or
`command` (an executable and its arguments, e.g. the C++ talker; `--host H --port 0` are
appended and it must print "listening on H:PORT" first), `replicas` times, on free loopback ports
that replace `endpoints`. Validation at load names the
rule broken: unknown key or runner or port, duplicate id, an input
with no source, a cycle, a sink no stage emits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.errors import InvalidArgument, NotFound
from services.orchestrator.dns import parse_target

# Ports each known runner can emit.
RUNNER_PORTS: dict[str, frozenset[str]] = {
    "llm.backbone": frozenset({"text", "tokens", "hidden"}),
    "talker.codec": frozenset({"audio"}),  # the reference C++ talker (clients/cpp)
}
REQUEST_FIELDS = frozenset({"prompt", "text", "messages", "token_ids"})
_STAGE_KEYS = {"id", "runner", "endpoints", "discover", "emits", "inputs", "onMissing", "launch",
               "servedModelName"}
_LAUNCH_KEYS = {"config", "stage", "replicas", "command"}
_TOP_KEYS = {"stages", "sinks", "defaultSinks", "maxRunning", "maxQueued"}


@dataclass(frozen=True)
class StageSpec:
    stage_id: str
    runner: str
    endpoints: tuple[str, ...]
    emits: tuple[str, ...]
    inputs: tuple[str, ...]  # "request:field" or "stage:port"
    on_missing: str = "fail"  # or "skip"
    launch_config: str | None = None  # stage config file for `llm-stage up`
    launch_stage: str | None = None
    launch_replicas: int = 0  # 0 = not launched locally
    launch_command: tuple[str, ...] = ()  # a non-Python stage: its executable and arguments
    discover: str | None = None  # a DNS target listing the replicas (then no endpoints)
    # The name the OpenAI gateway serves its text under (e.g. the Hugging Face repo id its
    # tokenizer loads by); None: the stage id.
    served_model_name: str | None = None

    def upstream(self) -> list[str]:
        return [i.split(":", 1)[0] for i in self.inputs if not i.startswith("request:")]


@dataclass(frozen=True)
class Topology:
    stages: tuple[StageSpec, ...]  # topological order
    sinks: tuple[str, ...]
    default_sinks: tuple[str, ...]
    max_running: int = 64
    max_queued: int = 256

    def stage(self, stage_id: str) -> StageSpec:
        return next(s for s in self.stages if s.stage_id == stage_id)


def single_stage(endpoints: list[str], stage_id: str = "backbone") -> Topology:
    """The topology of one LLM backbone: text in, text and tokens out."""
    return parse_topology({
        "stages": [{"id": stage_id, "runner": "llm.backbone", "endpoints": endpoints,
                    "emits": ["text", "tokens"], "inputs": ["request:prompt"]}],
        "sinks": [f"{stage_id}:text", f"{stage_id}:tokens"],
        "defaultSinks": [f"{stage_id}:text"]})


def with_endpoints(topology: Topology, endpoints: dict[str, list[str]]) -> Topology:
    """The same topology with the given stages' endpoints replaced (after a local launch)."""
    stages = tuple(replace(s, endpoints=tuple(endpoints.get(s.stage_id, s.endpoints)))
                   for s in topology.stages)
    return replace(topology, stages=stages)


def topology_doc(topology: Topology) -> dict[str, Any]:
    """The document `parse_topology` reads back as `topology`, less `launch` (a launched
    stage's endpoints stand for it): how `llm-runner up` hands its topology to a process."""
    stages = []
    for s in topology.stages:
        where = {"discover": s.discover} if s.discover else {"endpoints": list(s.endpoints)}
        named = {"servedModelName": s.served_model_name} if s.served_model_name else {}
        stages.append({"id": s.stage_id, "runner": s.runner, **where, "emits": list(s.emits),
                       "inputs": list(s.inputs), "onMissing": s.on_missing, **named})
    return {"stages": stages, "sinks": list(topology.sinks),
            "defaultSinks": list(topology.default_sinks), "maxRunning": topology.max_running,
            "maxQueued": topology.max_queued}


def load_topology(path: str | Path) -> Topology:
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"topology file {str(p)!r} does not exist")
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{p}: not valid JSON: {exc}") from exc
    try:
        return parse_topology(doc, p.parent)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{p}: {exc.message}") from exc


def parse_topology(doc: Any, base: Path | None = None) -> Topology:
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), list):
        raise InvalidArgument("a topology is an object with a 'stages' list")
    _no_unknown(doc, _TOP_KEYS, "topology")
    stages = [_parse_stage(i, raw, base or Path.cwd()) for i, raw in enumerate(doc["stages"])]
    if not stages:
        raise InvalidArgument("stages: at least one stage is required")
    ids = [s.stage_id for s in stages]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise InvalidArgument(f"stages: duplicate id {dup!r}")
    by_id = {s.stage_id: s for s in stages}
    for s in stages:
        for inp in s.inputs:
            src, port = inp.split(":", 1)
            if src == "request":
                if port not in REQUEST_FIELDS:
                    raise InvalidArgument(f"stage {s.stage_id}: input {inp!r} names an unknown "
                                          f"request field (valid: {sorted(REQUEST_FIELDS)})")
            elif src not in by_id or port not in by_id[src].emits:
                raise InvalidArgument(f"stage {s.stage_id}: input {inp!r} has no source (no "
                                      "stage of that id emits that port)")
    ordered = _topological_order(by_id)
    sinks = tuple(_str_list(doc, "sinks", [f"{s.stage_id}:{p}" for s in stages for p in s.emits]))
    for sink in sinks:
        sid, _, port = sink.partition(":")
        if sid not in by_id or port not in by_id[sid].emits:
            raise InvalidArgument(f"sinks: {sink!r} is not a port any stage emits")
    if not sinks:
        raise InvalidArgument("sinks: at least one port a caller can attach to is required")
    defaults = tuple(_str_list(doc, "defaultSinks", list(sinks[:1])))
    if not defaults:
        raise InvalidArgument("defaultSinks: at least one sink is required")
    for sink in defaults:
        if sink not in sinks:
            raise InvalidArgument(f"defaultSinks: {sink!r} is not one of the sinks")
    limits = {k: doc.get(k, d) for k, d in (("maxRunning", 64), ("maxQueued", 256))}
    for k, v in limits.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if k == "maxRunning" else 0):
            raise InvalidArgument(f"{k}: must be an integer >= "
                                  f"{1 if k == 'maxRunning' else 0}, got {v!r}")
    return Topology(tuple(ordered), sinks, defaults, limits["maxRunning"], limits["maxQueued"])


def _parse_stage(i: int, raw: Any, base: Path) -> StageSpec:
    where = f"stages[{i}]"
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{where}: must be an object")
    _no_unknown(raw, _STAGE_KEYS, where)
    sid = raw.get("id")
    if not isinstance(sid, str) or not sid or ":" in sid or sid == "request":
        raise InvalidArgument(f"{where}.id: a non-empty name without ':' (not 'request')")
    runner = raw.get("runner")
    if runner not in RUNNER_PORTS:
        raise InvalidArgument(f"{where}.runner: unknown runner {runner!r} "
                              f"(known: {sorted(RUNNER_PORTS)})")
    launch = raw.get("launch")
    if launch is not None:
        if not isinstance(launch, dict):
            raise InvalidArgument(f"{where}.launch: must be an object")
        _no_unknown(launch, _LAUNCH_KEYS, f"{where}.launch")
        replicas = launch.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise InvalidArgument(f"{where}.launch.replicas: an integer >= 1, got {replicas!r}")
        for key in ("config", "stage"):
            if not isinstance(launch.get(key, ""), str):
                raise InvalidArgument(f"{where}.launch.{key}: must be a string")
        command = launch.get("command", [])
        if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
            raise InvalidArgument(f"{where}.launch.command: must be a list of strings")
    discover = raw.get("discover")
    if discover is not None:
        if "endpoints" in raw or launch is not None:
            raise InvalidArgument(f"{where}.discover: replaces 'endpoints' and 'launch'; "
                                  "give only one")
        if not isinstance(discover, str):
            raise InvalidArgument(f"{where}.discover: must be a string (dns:///name:port)")
        try:
            parse_target(discover)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}.discover: {exc.message}") from None
    endpoints = _str_list(raw, "endpoints",
                          [] if launch is not None or discover is not None else None, where)
    if not endpoints and launch is None and discover is None:
        raise InvalidArgument(f"{where}.endpoints: at least one host:port is required")
    emits = _str_list(raw, "emits", None, where)
    if not emits:
        raise InvalidArgument(f"{where}.emits: a stage emits at least one port")
    for port in emits:
        if port not in RUNNER_PORTS[runner]:
            raise InvalidArgument(f"{where}.emits: runner {runner} has no port {port!r} "
                                  f"(it has {sorted(RUNNER_PORTS[runner])})")
    inputs = _str_list(raw, "inputs", ["request:prompt"], where)
    for inp in inputs:
        if inp.count(":") != 1:
            raise InvalidArgument(f"{where}.inputs: {inp!r} is not 'stage:port' or "
                                  "'request:field'")
    on_missing = raw.get("onMissing", "fail")
    if on_missing not in ("fail", "skip"):
        raise InvalidArgument(f"{where}.onMissing: 'fail' or 'skip', got {on_missing!r}")
    served = raw.get("servedModelName")
    if served is not None and not (isinstance(served, str) and served.strip()):
        raise InvalidArgument(f"{where}.servedModelName: a non-empty string, got {served!r}")
    config = (launch or {}).get("config")
    command = list((launch or {}).get("command", []))
    if command and "/" in command[0] and not Path(command[0]).is_absolute():
        command[0] = str(base / command[0])
    return StageSpec(sid, runner, tuple(endpoints), tuple(emits), tuple(inputs), on_missing,
                     launch_config=str(base / config) if config else None,
                     launch_stage=(launch or {}).get("stage"),
                     launch_replicas=(launch or {}).get("replicas", 1) if launch else 0,
                     launch_command=tuple(command), discover=discover,
                     served_model_name=served)


def _topological_order(by_id: dict[str, StageSpec]) -> list[StageSpec]:
    order: list[StageSpec] = []
    state: dict[str, int] = {}  # 1 = visiting, 2 = done

    def visit(sid: str, path: list[str]) -> None:
        if state.get(sid) == 2:
            return
        if state.get(sid) == 1:
            raise InvalidArgument("stages: cycle " + " -> ".join([*path, sid]))
        state[sid] = 1
        for up in by_id[sid].upstream():
            visit(up, [*path, sid])
        state[sid] = 2
        order.append(by_id[sid])

    for sid in by_id:
        visit(sid, [])
    return order


def _no_unknown(raw: dict[str, Any], valid: set[str], where: str) -> None:
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise InvalidArgument(f"{where}.{unknown[0]}: unknown key (valid: {sorted(valid)})")


def _str_list(raw: dict[str, Any], key: str, default: list[str] | None,
              where: str = "topology") -> list[str]:
    value = raw.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidArgument(f"{where}.{key}: must be a list of non-empty strings")
    return value
