"""The packages' import graph has no cycles, and its one-way rules hold: `services` never
imports `llm_runner_svc`, the stage kit imports no model code, and nothing in `engines/` or
`runtime/` imports grpc."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"llm_runner_svc": ROOT / "llm_runner_svc", "services": ROOT / "services",
            "llm_stage_client": ROOT / "clients" / "python" / "llm_stage_client"}


def modules() -> dict[str, Path]:
    out = {}
    for base in PACKAGES.values():
        for path in base.rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(base.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(path: Path) -> set[str]:
    """Every absolute module name `path` imports (TYPE_CHECKING blocks included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports(p) if i in mods and i != m} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_dependencies_point_one_way() -> None:
    mods = modules()
    for name, path in mods.items():
        found = imports(path)
        if name.startswith("services"):
            assert not any(i.startswith("llm_runner_svc") for i in found), name
        if name.startswith("services.stage"):
            assert "numpy" not in found, name
        if name.startswith(("llm_runner_svc.engines", "llm_runner_svc.runtime",
                            "llm_runner_svc.stage")):
            assert not any(i == "grpc" or i.startswith("grpc.") for i in found), name
