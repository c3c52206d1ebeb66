"""`llm-runner build-engine`: export the ONNX step graph, build the plan, write the sidecar."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from llm_runner_svc.export.decoder import ExportOptions, export_decoder
from llm_runner_svc.export.profiles import PlanLimits
from llm_runner_svc.export.sidecar import ONNX_FILE, PLAN_FILE, EngineSidecar
from llm_runner_svc.export.signature import GraphDtype, io_tensors
from llm_runner_svc.models import EMBEDDED_NAME, SMOLLM2_NAME, load_model

log = logging.getLogger(__name__)


def build_engine_dir(model: str | None, out_dir: str | Path, dtype: GraphDtype,
                     limits: PlanLimits, targets: Sequence[str] = (),
                     hidden_layer: int | None = None, is_onnx_only: bool = False,
                     on_phase: Callable[[str], None] | None = None) -> EngineSidecar:
    """Write model.onnx, model.plan (unless `is_onnx_only`) and engine.json into `out_dir`.
    `on_phase(name)` is called as each phase starts (a CLI shows progress with it)."""
    phase = on_phase or (lambda _name: None)
    if not is_onnx_only:  # refuse a bad target list before the export's work
        from llm_runner_svc.export.plan import check_targets
        from llm_runner_svc.export.trt_module import import_tensorrt

        trt = import_tensorrt()
        chosen = check_targets(targets, dtype, trt)
    name = model or EMBEDDED_NAME
    phase(f"load {name}")
    loaded = load_model(name)
    source = name if name in (EMBEDDED_NAME, SMOLLM2_NAME) else str(Path(name).resolve())
    max_seq = min(limits.max_seq, loaded.config.max_position)
    limits = PlanLimits(limits.max_batch, max_seq, min(limits.prefill_chunk, max_seq))
    phase(f"export the {dtype.value} ONNX step graph")
    graph = export_decoder(loaded.config, loaded.weights,
                           ExportOptions(dtype, hidden_layer, max_positions=max_seq,
                                         is_attention_low="sm75" in map(str.lower, targets)))
    onnx_bytes = graph.SerializeToString()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / ONNX_FILE).write_bytes(onnx_bytes)
    descs = io_tensors(loaded.config, dtype, hidden_layer is not None)
    sidecar = EngineSidecar(
        model=source, dtype=dtype.value, hidden_layer=hidden_layer, limits=limits,
        io=[t.as_dict() for t in descs], onnx_bytes=len(onnx_bytes),
        num_nodes=len(graph.graph.node))
    if not is_onnx_only:
        from llm_runner_svc.export.plan import build_plan

        phase(f"parse and build the plan for {', '.join(chosen) or 'this GPU'}")
        built = build_plan(trt, onnx_bytes, [t for t in descs if t.is_input], limits, chosen)
        (out / PLAN_FILE).write_bytes(built.plan)
        inputs = [t for t in descs if t.is_input]
        sidecar = EngineSidecar(
            **{**sidecar.__dict__, "plan": PLAN_FILE,
               "builder": {"module": trt.name, "version": trt.version},
               "targets": list(built.targets), "network_io": list(built.network_io),
               "profiles": [p.as_dict(inputs) for p in built.profiles],
               "build_s": round(built.build_s, 3), "plan_bytes": len(built.plan)})
    sidecar.write(out)
    return sidecar
