"""`engine.json`: what a build directory holds, readable without a GPU.

A plan cannot be inspected without a GPU, so the build writes down everything a runner needs
to check before deserializing it: the source model, dtype, hidden layer, limits, the IO
tensors, the profiles, the builder and its targets.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llm_runner_svc.errors import InvalidArgument, NotFound
from llm_runner_svc.export.profiles import PlanLimits
from llm_runner_svc.export.signature import GraphDtype

SIDECAR = "engine.json"
ONNX_FILE = "model.onnx"
PLAN_FILE = "model.plan"
FORMAT = 1


@dataclass(frozen=True)
class EngineSidecar:
    model: str  # the source checkpoint: a built-in name or an absolute path
    dtype: str
    hidden_layer: int | None
    limits: PlanLimits
    io: list[dict[str, Any]]  # name, dtype, dims (symbolic), mode
    onnx: str = ONNX_FILE
    plan: str | None = None  # None when only the ONNX was written
    builder: dict[str, Any] = field(default_factory=dict)  # module, version
    targets: list[str] = field(default_factory=list)
    profiles: list[dict[str, Any]] = field(default_factory=list)
    network_io: list[dict[str, Any]] = field(default_factory=list)
    build_s: float | None = None
    plan_bytes: int | None = None
    onnx_bytes: int = 0
    num_nodes: int = 0

    @property
    def graph_dtype(self) -> GraphDtype:
        return GraphDtype.parse(self.dtype)

    def to_json(self) -> str:
        doc = {"format": FORMAT, **asdict(self)}
        return json.dumps(doc, indent=1)

    def write(self, out_dir: Path) -> Path:
        path = out_dir / SIDECAR
        path.write_text(self.to_json())
        return path


def is_build_dir(path: str | Path) -> bool:
    return (Path(path) / SIDECAR).is_file()


def load_sidecar(build_dir: str | Path) -> EngineSidecar:
    """Read and check `build_dir/engine.json`; NotFound or InvalidArgument naming the field."""
    path = Path(build_dir) / SIDECAR
    if not path.is_file():
        raise NotFound(f"{build_dir}: no {SIDECAR} (not an llm-runner build-engine directory)")
    try:
        doc = json.loads(path.read_text())
        if doc.pop("format") != FORMAT:
            raise InvalidArgument(f"{path}: format {doc.get('format')} is not {FORMAT}")
        limits = PlanLimits(**doc.pop("limits"))
        sidecar = EngineSidecar(limits=limits, **doc)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"{path}: not a valid engine sidecar: {exc}") from exc
    sidecar.graph_dtype  # noqa: B018 - validates the dtype name
    return sidecar
