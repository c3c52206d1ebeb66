"""deploy/k8s, rendered by `kubectl kustomize` for each overlay, validated against the
Kubernetes schemas (kubernetes-validate, its newest bundled version) and checked against the
code: the ports, probes and grace periods agree with the commands' flags, the topology's
discovery target is the runners' headless Service, Services select pods that name their target
ports."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from llm_runner_svc.stage.config import load_stage_config
from services.orchestrator.dns import parse_target
from services.orchestrator.topology import parse_topology
from services.workers import DEFAULT_WORKERS

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    version = kubernetes_validate.latest_version()
    docs = render(overlay)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap",
                                         "PodDisruptionBudget", "HorizontalPodAutoscaler"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    broken = copy.deepcopy(by_kind(docs, "Deployment")["runner"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_and_grace_agree_with_the_commands(overlay: str) -> None:
    docs = render(overlay)
    assert all(d["metadata"].get("namespace") == "llm" for d in docs if d["kind"] != "Namespace")
    for name, dep in by_kind(docs, "Deployment").items():
        spec = dep["spec"]["template"]["spec"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= \
            dep["spec"]["template"]["metadata"]["labels"].items(), name
        (c,) = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if name != "talker":  # the C++ talker exports no metrics
            assert int(flag(c["args"], "--metrics-port")) == ports["metrics"], name
            annotations = dep["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(ports["metrics"]), name
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], name
        if name == "gateway":
            assert int(flag(c["args"], "--port")) == ports["http"]
            continue
        assert int(flag(c["args"], "--port")) == ports["grpc"], name
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == ports["grpc"], (name, probe)
        sleep_s = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        grace_s = 5.0 if name == "talker" else float(flag(c["args"], "--grace-s"))
        assert spec["terminationGracePeriodSeconds"] > sleep_s + grace_s, name
    runner = by_kind(docs, "Deployment")["runner"]["spec"]["template"]["spec"]["containers"][0]
    startup = runner["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # load + preallocation


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_discovery_targets_are_the_headless_services(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    services = by_kind(docs, "Service")
    deployments = by_kind(docs, "Deployment")
    for name, svc in services.items():
        owner = next(d for d in deployments.values() if svc["spec"]["selector"].items()
                     <= d["spec"]["template"]["metadata"]["labels"].items())
        names = {p["name"] for p in owner["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert all(p["targetPort"] in names for p in svc["spec"]["ports"]), name
    config = by_kind(docs, "ConfigMap")["llm-config"]["data"]
    topology = parse_topology(json.loads(config["topology.json"]))
    thinker, talker = topology.stages
    for stage, service in ((thinker, "runner-headless"), (talker, "talker-headless")):
        target = parse_target(stage.discover or "")
        assert target.name == f"{service}.llm.svc.cluster.local"
        assert target.port == services[service]["spec"]["ports"][0]["port"]
        assert services[service]["spec"]["clusterIP"] == "None"
    talker_args = deployments["talker"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(talker_args, "--stage-id") == talker.stage_id
    stage = thinker
    (tmp_path / "stage.json").write_text(config["stage.json"])
    served = load_stage_config(tmp_path / "stage.json")  # the runners' config loads as is
    assert served.stage_id == stage.stage_id and set(stage.emits) <= set(served.emits)
    orch = deployments["orchestrator"]
    assert orch["spec"]["replicas"] >= 2
    args = orch["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--topology") == "/etc/llm/topology.json"
    peers = parse_target(flag(args, "--peers"))
    assert peers.name == "orchestrator-headless.llm.svc.cluster.local"
    assert peers.port == services["orchestrator"]["spec"]["ports"][0]["port"]
    gateway_args = deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(gateway_args, "--orchestrator") == f"orchestrator:{peers.port}"


def test_autoscaler_reads_a_gauge_the_stage_exports() -> None:
    docs = render("cpu")
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["runner"]["spec"]
    assert hpa["scaleTargetRef"]["name"] in by_kind(docs, "Deployment")
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    exported = (ROOT / "llm_runner_svc/stage/metrics.py").read_text()
    assert f'"{metric}"' in exported
    assert set(by_kind(docs, "PodDisruptionBudget")) == {"runner", "orchestrator"}


def test_gpu_overlay_runs_the_torch_engine_on_one_gpu_per_runner() -> None:
    docs = render("gpu")
    runner = by_kind(docs, "Deployment")["runner"]["spec"]["template"]["spec"]["containers"][0]
    assert runner["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert runner["image"] == "llm-runner-svc-gpu:latest"
    stage = json.loads(by_kind(docs, "ConfigMap")["llm-config"]["data"]["stage.json"])
    assert stage["stages"][0]["engine"] == "torch"
    cpu_stage = json.loads(by_kind(render("cpu"), "ConfigMap")["llm-config"]["data"]["stage.json"])
    assert cpu_stage["stages"][0].get("engine", "numpy") == "numpy"
    dockerfile = (ROOT / "docker/gpu.Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:", dockerfile, re.M)
    assert 'pip install ".[torch]"' in dockerfile
    for src in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (ROOT / src).exists(), src


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_front_door_runs_the_measured_number_of_workers(overlay: str) -> None:
    deployments = by_kind(render(overlay), "Deployment")
    for name in ("orchestrator", "gateway"):
        (c,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert flag(c["args"], "--workers") == "$(WORKERS)", name  # Kubernetes expands it
        assert int(env["WORKERS"]) == DEFAULT_WORKERS, name
