"""The onnxruntime graph engine: our ONNX export run by onnxruntime (CPU, or CUDA where
onnxruntime-gpu is installed). Engines `onnx` (float32) and `onnx-fp16` (fp16 weights and KV,
float32 norms, softmax and residual)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.engines.graph_engine import GraphEngine, StepExecutor
from llm_runner_svc.errors import FailedPrecondition, Unimplemented
from llm_runner_svc.export.signature import GraphDtype

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class OrtExecutor(StepExecutor):
    """One onnxruntime session over the serialized graph."""

    def __init__(self, graph_bytes: bytes) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise Unimplemented("the onnx engine needs onnxruntime: "
                                "pip install 'llm-runner-svc[onnx]'") from exc
        providers = [p for p in (CUDA, CPU) if p in ort.get_available_providers()]
        self.session: Any = ort.InferenceSession(graph_bytes, providers=providers)
        self.providers = providers
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, np.ndarray], profile: str) -> dict[str, np.ndarray]:
        if self.session is None:
            raise FailedPrecondition("onnxruntime session used after close()")
        values = self.session.run(self.output_names, dict(feeds))
        return dict(zip(self.output_names, values, strict=True))

    def close(self) -> None:
        self.session = None


class OnnxEngine(GraphEngine):
    name = "onnx"

    def _open_executor(self, plan: EnginePlan) -> StepExecutor:
        from llm_runner_svc.export.decoder import ExportOptions, export_decoder

        graph = export_decoder(self.config, self.weights, ExportOptions(
            self.dtype, plan.hidden_layer, max_positions=plan.max_seq))
        return OrtExecutor(graph.SerializeToString())


class OnnxFp16Engine(OnnxEngine):
    name = "onnx-fp16"
    dtype = GraphDtype.FP16
