"""docker-compose.yml and the Dockerfiles, checked without a Docker engine: the compose file
against the structure the Compose spec allows, and every path and command they name."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from services.orchestrator.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
TOP_KEYS = {"name", "services", "networks", "volumes", "configs", "secrets", "version"}
SERVICE_KEYS = {"image", "build", "command", "entrypoint", "environment", "ports", "depends_on",
                "volumes", "healthcheck", "restart", "networks", "expose", "working_dir"}
BUILD_KEYS = {"context", "dockerfile", "args", "target"}
SERVICES = COMPOSE["services"]


def console_scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def test_compose_structure() -> None:
    assert set(COMPOSE) <= TOP_KEYS
    assert set(SERVICES) == {"jaeger", "runner", "talker", "orchestrator", "gateway"}
    for name, svc in SERVICES.items():
        assert set(svc) <= SERVICE_KEYS, name
        assert ("image" in svc) != ("build" in svc), f"{name}: image or build, not both"
        for port in svc.get("ports", []):
            assert re.fullmatch(r"\d+:\d+", port), (name, port)
        for dep in svc.get("depends_on", []):
            assert dep in SERVICES, (name, dep)
        env = svc.get("environment", {})
        assert all(isinstance(v, str) for v in env.values()), name
        if "command" in svc:
            assert isinstance(svc["command"], list) and all(isinstance(c, str)
                                                            for c in svc["command"])
    jaeger = SERVICES["jaeger"]
    assert {"16686:16686", "4317:4317"} <= set(jaeger["ports"])
    for name in ("runner", "orchestrator", "gateway"):
        assert SERVICES[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == \
            "http://jaeger:4317"


@pytest.mark.parametrize("name", ["runner", "talker", "orchestrator", "gateway"])
def test_build_context_and_copies_exist(name: str) -> None:
    build = SERVICES[name]["build"]
    assert set(build) <= BUILD_KEYS
    context = ROOT / build["context"]
    dockerfile = context / build["dockerfile"]
    assert dockerfile.is_file()
    for line in dockerfile.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            for src in parts[1:-1]:
                assert (context / src).exists(), f"{dockerfile.name}: COPY {src}"


def test_commands_name_things_that_exist() -> None:
    scripts = console_scripts()
    runner = SERVICES["runner"]["command"]
    assert runner[0] in scripts
    cfg = runner[runner.index("--config") + 1]
    assert (ROOT / cfg).is_file()
    orch = SERVICES["orchestrator"]["command"]
    assert orch[:3] == ["python", "-m", "services.orchestrator"]
    assert (ROOT / "services" / "orchestrator" / "__main__.py").is_file()
    topology = load_topology(ROOT / orch[orch.index("--topology") + 1])
    for stage in topology.stages:  # every endpoint is a compose service on its port
        for endpoint in stage.endpoints:
            host, port = endpoint.split(":")
            assert host in SERVICES and port in shlex.join(SERVICES[host]["command"])
    gateway = SERVICES["gateway"]["command"]
    assert gateway[:3] == ["python", "-m", "services.gateway"]
    assert (ROOT / "services" / "gateway" / "__main__.py").is_file()
    host, port = gateway[gateway.index("--orchestrator") + 1].split(":")
    assert host in SERVICES and port in shlex.join(SERVICES[host]["command"])
    http_port = gateway[gateway.index("--port") + 1]
    assert f"{http_port}:{http_port}" in SERVICES["gateway"]["ports"]
    cmake = (ROOT / "clients" / "cpp" / "CMakeLists.txt").read_text()
    assert SERVICES["talker"]["command"][0] == "talker_stage"
    assert re.search(r"add_executable\(\s*talker_stage\b", cmake)
    talker_docker = (ROOT / "docker" / "talker.Dockerfile").read_text()
    assert "talker_stage" in talker_docker
