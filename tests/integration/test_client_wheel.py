"""The client distribution (clients/python) on its own: its wheel carries the contract stubs and
imports nothing of the servers; unpacked alone, next to grpcio and protobuf (and what they need)
only, it streams a generation from a real `llm-runner up` deployment over a port, and its
`llm-stage up` says what to install instead of failing with a traceback."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import solo

from llm_runner_svc.models import Model

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = {"services", "llm_runner_svc"}
STUBS = [f"llm_stage_client/_contract/llmstage/v1/{proto}{suffix}"
         for proto in ("orchestrator", "stage", "tensor") for suffix in ("_pb2.py", "_pb2_grpc.py")]
# Runs inside the isolated interpreter: reports which server packages it can import, then runs
# the client's CLI with the remaining arguments.
ISOLATED = """
import importlib.util, sys
found = [n for n in ("services", "llm_runner_svc") if importlib.util.find_spec(n) is not None]
print("server packages importable:", found, file=sys.stderr)
from llm_stage_client.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel --no-deps clients/python`, built from a copy so the tree gets no build files
    (without build isolation: this environment's setuptools, no download)."""
    tmp = tmp_path_factory.mktemp("client-wheel")
    src = tmp / "src"
    shutil.copytree(ROOT / "clients" / "python", src,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(tmp / "dist")],
                   check=True, capture_output=True, timeout=120)
    (built,) = (tmp / "dist").glob("llm_stage_client-*.whl")
    return built


def _imported_packages(source: bytes) -> set[str]:
    """The top-level packages a module's import statements name (relative imports excluded)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_wheel_has_the_stubs_and_imports_nothing_of_the_servers(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert set(STUBS) <= set(names)
        modules = [n for n in names if n.endswith(".py")]
        imports = {n: _imported_packages(zf.read(n)) for n in modules}
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line.split(":", 1)[1].strip()
                    for line in zf.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    assert {n: i & SERVER_PACKAGES for n, i in imports.items() if i & SERVER_PACKAGES} == {}
    assert "llm_stage_client" in imports["llm_stage_client/client.py"]  # the scan sees imports
    base = sorted(re.match(r"[\w.-]+", r).group() for r in requires if "extra ==" not in r)
    assert base == ["grpcio", "protobuf"]


def _link_distribution(name: str, into: Path, seen: set[str]) -> None:
    """Symlink the top-level modules of installed distribution `name`, and of what it requires,
    into `into`."""
    dist = importlib.metadata.distribution(name)
    if dist.metadata["Name"].lower() in seen:
        return
    seen.add(dist.metadata["Name"].lower())
    for top in {f.parts[0] for f in dist.files or ()}:
        if top in ("..", "__pycache__") or top.endswith(".dist-info"):
            continue
        if not (into / top).exists():
            (into / top).symlink_to(Path(str(dist.locate_file(top))))
    for req in dist.requires or ():
        if "extra ==" not in req:
            _link_distribution(re.match(r"[\w.-]+", req).group(), into, seen)


def _run_isolated(args: list[str], wheel_dir: Path, deps: Path,
                  cwd: Path) -> subprocess.CompletedProcess[str]:
    """The client's CLI in an interpreter that sees only the standard library, the unpacked
    wheel and `deps`: no site-packages (-S), hence no editable install of this repository, and
    no current directory on the path (-P); it runs outside the repository."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{wheel_dir}:{deps}"}
    return subprocess.run([sys.executable, "-S", "-P", "-c", ISOLATED, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_installed_alone_the_client_talks_to_a_real_deployment(
        wheel: Path, tmp_path: Path, stories: Model) -> None:
    wheel_dir, deps = tmp_path / "wheel", tmp_path / "deps"
    zipfile.ZipFile(wheel).extractall(wheel_dir)
    deps.mkdir()
    seen: set[str] = set()
    for name in ("grpcio", "protobuf"):
        _link_distribution(name, deps, seen)

    up = subprocess.Popen([sys.executable, "-m", "llm_runner_svc", "up", "--port", "0"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline(), up.stdout.readline()]
        orch = re.search(r"orchestrator listening on ([\d.]+:\d+)", lines[1])
        assert re.search(r"stage process \d+ on", lines[0]) and orch, lines
        done = _run_isolated(["generate", "--target", orch.group(1), "--seed", "5",
                              "--temperature", "0.8", "--max-tokens", "12", "Once upon a time"],
                             wheel_dir, deps, tmp_path)
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
    assert "server packages importable: []" in done.stderr
    assert done.returncode == 0, done.stderr
    tokens, text, reason = solo(stories, dict(text="Once upon a time", seed=5, temperature=0.8,
                                              max_tokens=12))
    assert done.stdout == text + "\n"
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert (report["finish_reason"], report["completion_tokens"]) == (reason, len(tokens))

    alias = _run_isolated(["up", "--port", "0"], wheel_dir, deps, tmp_path)
    assert "server packages importable: []" in alias.stderr
    assert alias.returncode == 2 and "Traceback" not in alias.stderr, alias.stderr
    assert "pip install llm-runner-svc" in alias.stderr
