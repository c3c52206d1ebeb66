"""Engine registry. Backends are imported only when asked for, so `numpy` never pulls torch."""

from __future__ import annotations

import importlib
from typing import Any

from llm_runner_svc.engines.base import Engine
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.spec import ModelConfig, ModelWeights

_REGISTRY: dict[str, str] = {
    "numpy": "llm_runner_svc.engines.numpy_engine:NumpyEngine",
    "onnx": "llm_runner_svc.engines.onnx_engine:OnnxEngine",
    "onnx-fp16": "llm_runner_svc.engines.onnx_engine:OnnxFp16Engine",
    "synthetic": "llm_runner_svc.engines.synthetic_engine:SyntheticEngine",
    "tensorrt": "llm_runner_svc.engines.tensorrt_engine:TensorRTEngine",
    "torch": "llm_runner_svc.engines.torch_engine:TorchEngine",
}


# The vision tower's forward on each engine's device (the numpy one on the host engines).
_VISION: dict[str, str] = {
    "torch": "llm_runner_svc.engines.torch_vision:TorchVision",
}
_HOST_VISION = "llm_runner_svc.engines.numpy_vision:NumpyVision"


def create_vision(engine: Engine, vision: Any) -> Any:
    """The vision tower of `vision` (models.vision.VisionModel) for the engine `engine`:
    an object whose `encode(pixels [B, C, H, W] float32)` gives float32 host embeddings
    [B, tokens_per_image, hidden]."""
    module_name, cls_name = _VISION.get(engine.name, _HOST_VISION).split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if cls_name == "NumpyVision":  # in turns with the engine's steps at the BLAS threads
        return cls(vision.config, vision.weights, getattr(engine, "compute_lock", None))
    return cls(vision.config, vision.weights, engine)


def engine_names() -> list[str]:
    return sorted(_REGISTRY)


def create_engine(name: str, config: ModelConfig, weights: ModelWeights,
                  **options: Any) -> Engine:
    """Build the engine registered as `name`; an unknown name lists the valid ones.
    `options` go to engines that take them (tensorrt: build_dir, runtime_cache; synthetic:
    step_ms, token_us)."""
    cls: Any = engine_class(name)  # (the concrete classes take the model)
    engine: Engine = cls(config, weights, **options)
    return engine


def engine_class(name: str) -> type[Engine]:
    """The class registered as `name` (its supports_* flags say what it serves); an unknown
    name lists the valid ones."""
    target = _REGISTRY.get(name)
    if target is None:
        raise InvalidArgument(
            f"unknown engine {name!r}; valid engines: {', '.join(engine_names())}")
    module_name, cls_name = target.split(":")
    cls: type[Engine] = getattr(importlib.import_module(module_name), cls_name)
    return cls
