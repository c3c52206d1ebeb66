"""The tensorrt engine up to where a GPU is needed: a build directory as the stage's artifact,
`runtime_cache` honoured only by this engine, the sidecar checked against the stage's plan, and
the plan handed to TensorRT-RTX for deserialization. On a machine without a supported GPU (this
project's CI) deserialization fails with FAILED_PRECONDITION; with one, the plan must produce
the numpy engine's greedy tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tensorrt_rtx", reason="the tensorrt extra")

from llm_runner_svc.engines import create_engine  # noqa: E402
from llm_runner_svc.engines.base import DecodeRow, EnginePlan  # noqa: E402
from llm_runner_svc.errors import FailedPrecondition, NotFound, Unimplemented  # noqa: E402
from llm_runner_svc.export.build import build_engine_dir  # noqa: E402
from llm_runner_svc.export.profiles import PlanLimits  # noqa: E402
from llm_runner_svc.export.sidecar import load_sidecar  # noqa: E402
from llm_runner_svc.export.signature import GraphDtype  # noqa: E402
from llm_runner_svc.stage.config import load_stage_config  # noqa: E402


def _has_cuda_device() -> bool:
    from cuda.bindings import runtime as cudart

    err, count = cudart.cudaGetDeviceCount()
    return int(err) == 0 and count > 0


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    build_engine_dir(None, out, GraphDtype.FP16, PlanLimits(4, 128, 32), hidden_layer=None)
    return out


def _stage_file(tmp_path, artifact: str, engine: str, **config) -> str:
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"stages": [{"id": "t", "runner": "llm.backbone",
                                            "artifact": artifact, "engine": engine,
                                            "config": config}]}))
    return str(path)


def test_stage_artifact_may_be_a_build_directory(tmp_path, build_dir):
    cfg = load_stage_config(_stage_file(tmp_path, str(build_dir), "tensorrt",
                                        runtime_cache="rt.cache"))
    assert cfg.artifact == "stories260K"  # the sidecar's source model
    assert cfg.engine_options() == {"build_dir": str(build_dir),
                                    "runtime_cache": str(build_dir / "rt.cache")}


def test_runtime_cache_and_build_dirs_are_refused_by_other_engines(tmp_path, build_dir):
    with pytest.raises(Unimplemented, match="config.runtime_cache"):
        load_stage_config(_stage_file(tmp_path, "stories260K", "onnx", runtime_cache="c"))
    with pytest.raises(Unimplemented, match="build-engine directory"):
        load_stage_config(_stage_file(tmp_path, str(build_dir), "numpy"))


def test_sidecar_is_checked_against_the_stage_plan(stories, build_dir):
    engine = create_engine("tensorrt", stories.config, stories.weights, build_dir=str(build_dir))
    assert engine.dtype is GraphDtype.FP16
    with pytest.raises(FailedPrecondition) as exc:
        engine.preallocate(EnginePlan(max_batch=8, max_seq=256, page_size=16, num_pages=128,
                                      prefill_chunk=32, hidden_layer=-1))
    msg = exc.value.message
    assert "hidden layer None" in msg and "max_batch is 4" in msg and "max_seq is 128" in msg
    with pytest.raises(NotFound, match="engine.json"):
        load_sidecar(build_dir / "missing")


def test_plan_goes_to_deserialization_and_runs_only_on_a_supported_gpu(stories, build_dir,
                                                                        tmp_path):
    cache = tmp_path / "rt.cache"
    plan = EnginePlan(max_batch=2, max_seq=128, page_size=16, num_pages=16, prefill_chunk=32)
    engine = create_engine("tensorrt", stories.config, stories.weights,
                           build_dir=str(build_dir), runtime_cache=str(cache))
    if not _has_cuda_device():
        with pytest.raises(FailedPrecondition, match="could not deserialize the plan"):
            engine.preallocate(plan)
        assert engine.memory_bytes() == 0 and not cache.exists()
        return
    ref = create_engine("numpy", stories.config, stories.weights)
    tokens: dict[str, list[int]] = {}
    for name, eng in (("numpy", ref), ("tensorrt", engine)):
        eng.preallocate(plan)
        eng.prefill([1, 403, 407], 0, [0, 1])
        out = [int(np.argmax(eng.logits(1)[0]))]
        for i in range(16):
            eng.decode([DecodeRow(out[-1], 3 + i, [0, 1])])
            out.append(int(np.argmax(eng.logits(1)[0])))
        eng.close()
        tokens[name] = out
    assert tokens["tensorrt"] == tokens["numpy"]
    assert cache.stat().st_size > 0  # saved at close
