"""A small append-only ONNX graph builder over `onnx.helper`: unique names, constants,
and the handful of composite ops the decoder needs (RMSNorm in float32, casts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from llm_runner_svc.export.signature import GraphDtype

OPSET = 17
ELEM = {GraphDtype.FP32: TensorProto.FLOAT, GraphDtype.FP16: TensorProto.FLOAT16,
        GraphDtype.BF16: TensorProto.BFLOAT16}
FLOAT = TensorProto.FLOAT


def _bf16_tensor(name: str, array: np.ndarray) -> onnx.TensorProto:
    """float32 -> bfloat16 with round-to-nearest-even, stored as raw bytes."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    t = onnx.TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(array.shape))
    t.raw_data = rounded.tobytes()
    return t


class GraphBuilder:
    """Collects nodes and initializers; `node()` returns its output names."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def _fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def node(self, op: str, inputs: Sequence[str], num_outputs: int = 1,
             outputs: Sequence[str] | None = None, **attrs: Any) -> list[str]:
        outs = list(outputs) if outputs is not None else [
            self._fresh(op.lower()) for _ in range(num_outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=self._fresh(op),
                                           **attrs))
        return outs

    def op(self, op: str, *inputs: str, **attrs: Any) -> str:
        return self.node(op, inputs, **attrs)[0]

    def weight(self, hint: str, array: np.ndarray, dtype: GraphDtype = GraphDtype.FP32) -> str:
        """A float initializer stored in `dtype`."""
        name = self._fresh(hint)
        if dtype is GraphDtype.BF16:
            self.initializers.append(_bf16_tensor(name, array))
        else:
            np_dtype = np.float16 if dtype is GraphDtype.FP16 else np.float32
            self.initializers.append(
                numpy_helper.from_array(np.ascontiguousarray(array, dtype=np_dtype), name))
        return name

    def ints(self, hint: str, values: Sequence[int]) -> str:
        """An int64 1-D constant (shapes, axes, split sizes)."""
        name = self._fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    def scalar(self, hint: str, value: float) -> str:
        name = self._fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def cast(self, x: str, to: int, src: int) -> str:
        return x if to == src else self.op("Cast", x, to=to)

    def rms_norm(self, x: str, weight: np.ndarray, eps: float) -> str:
        """x * weight / sqrt(mean(x^2) + eps) over the last axis; x and result float32."""
        ms = self.op("ReduceMean", self.op("Mul", x, x), axes=[-1], keepdims=1)
        inv = self.op("Reciprocal", self.op("Sqrt", self.op("Add", ms, self.scalar("eps", eps))))
        return self.op("Mul", self.op("Mul", x, inv), self.weight("norm", weight))

    def model(self, inputs: list[onnx.ValueInfoProto],
              outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="llm-runner-svc")
        model.ir_version = 8  # readable by every onnxruntime and TensorRT parser we target
        return model
