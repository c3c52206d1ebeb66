"""TensorRT-RTX on a CPU-only machine: it parses every export with zero errors and builds plans
for the default targets and for SM75 fp16; `llm-runner build-engine` writes the ONNX, the plan
and a sidecar listing the IO tensors. Build time and plan size are printed (pytest -s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx", reason="the onnx extra")
pytest.importorskip("tensorrt_rtx", reason="the tensorrt extra")

from parity.conftest import build_hf_model  # noqa: E402

from llm_runner_svc.errors import InvalidArgument  # noqa: E402
from llm_runner_svc.export import signature as sig  # noqa: E402
from llm_runner_svc.export.decoder import ExportOptions, export_decoder  # noqa: E402
from llm_runner_svc.export.plan import (  # noqa: E402
    DEFAULT_TARGETS,
    build_plan,
    check_targets,
)
from llm_runner_svc.export.profiles import PlanLimits  # noqa: E402
from llm_runner_svc.export.signature import GraphDtype, io_tensors  # noqa: E402
from llm_runner_svc.export.trt_module import import_tensorrt  # noqa: E402
from llm_runner_svc.models import load_model  # noqa: E402

LIMITS = PlanLimits(max_batch=4, max_seq=128, prefill_chunk=32)


def _build(model, dtype: GraphDtype, targets: tuple[str, ...], hidden: int | None = -1):
    trt = import_tensorrt()
    chosen = check_targets(targets, dtype, trt)
    graph = export_decoder(model.config, model.weights, ExportOptions(
        dtype, hidden, max_positions=LIMITS.max_seq, is_attention_low="sm75" in chosen))
    inputs = [t for t in io_tensors(model.config, dtype, hidden is not None) if t.is_input]
    built = build_plan(trt, graph.SerializeToString(), inputs, LIMITS, chosen)
    print(f"\n{model.name} {dtype.value} {','.join(chosen)}: {len(graph.graph.node)} nodes, "
          f"plan {len(built.plan) / 1e6:.1f} MB in {built.build_s:.2f} s")
    return built


@pytest.mark.parametrize("dtype", [GraphDtype.FP32, GraphDtype.FP16])
def test_stories260k_parses_without_errors_and_builds_default_targets(stories, dtype):
    built = _build(stories, dtype, ())
    assert built.parse_errors == ()
    assert built.targets == DEFAULT_TARGETS
    assert len(built.plan) > 100_000
    names = [t["name"] for t in built.network_io]
    assert names == [t.name for t in io_tensors(stories.config, dtype, True)]
    assert [p.name for p in built.profiles] == ["prefill", "decode"]


def test_sm75_builds_from_the_fp16_export_and_refuses_fp32(stories):
    built = _build(stories, GraphDtype.FP16, ("sm75",))
    assert built.targets == ("sm75",) and len(built.plan) > 100_000
    with pytest.raises(InvalidArgument, match="sm75"):
        check_targets(("sm75",), GraphDtype.FP32, import_tensorrt())


def test_hopper_is_not_a_tensorrt_rtx_target():
    with pytest.raises(InvalidArgument, match="SM90"):
        check_targets(("sm90",), GraphDtype.FP16, import_tensorrt())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_hf_exports_build(tmp_path, arch):
    build_hf_model(arch, tmp_path / arch)
    built = _build(load_model(tmp_path / arch), GraphDtype.FP16, (), hidden=1)
    assert built.parse_errors == () and len(built.plan) > 0


def test_build_engine_cli_writes_onnx_plan_and_sidecar(tmp_path):
    out = tmp_path / "smollm2"
    proc = subprocess.run(
        [sys.executable, "-m", "llm_runner_svc", "build-engine", "--model", "smollm2",
         "--out", str(out), "--dtype", "fp16", "--max-seq", "256", "--max-batch", "4",
         "--hidden-layer", "-1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nbuild-engine smollm2 fp16: {report}")
    side = json.loads((out / "engine.json").read_text())
    assert side["model"] == "smollm2" and side["dtype"] == "fp16" and side["hidden_layer"] == -1
    assert side["limits"] == {"max_batch": 4, "max_seq": 256, "prefill_chunk": 256}
    assert side["targets"] == list(DEFAULT_TARGETS)
    assert side["builder"]["module"] in ("tensorrt_rtx", "tensorrt_rtx_bindings")
    assert side["plan_bytes"] == (out / "model.plan").stat().st_size == report["plan_bytes"]
    assert side["build_s"] > 0
    io = {t["name"]: t for t in side["io"]}
    assert io[sig.past_key(29)]["dims"] == ["batch", 3, "past", 64]
    assert io[sig.LOGITS]["dims"] == ["batch", 49152] and io[sig.LOGITS]["mode"] == "output"
    assert {t["name"] for t in side["network_io"]} == set(io)
    decode = next(p for p in side["profiles"] if p["name"] == "decode")
    assert decode["shapes"][sig.ATTENTION_BIAS][2] == [4, 1, 1, 1, 256]
    graph = onnx.load(str(out / "model.onnx"))
    onnx.checker.check_model(graph)
    assert [i.name for i in graph.graph.input][:3] == [sig.INPUT_IDS, sig.POSITION_IDS,
                                                       sig.ATTENTION_BIAS]
    assert Path(out / "model.onnx").stat().st_size == side["onnx_bytes"]
