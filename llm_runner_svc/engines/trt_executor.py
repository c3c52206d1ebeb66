"""Runs a TensorRT / TensorRT-RTX plan of the step graph with cuda-python.

Opening order (each step can fail on its own, with its own message): deserialize the plan,
create the CUDA stream, the runtime config (loading the runtime cache file when one is named),
the execution context, then one device buffer per IO tensor sized for the largest step the
plan accepts. Nothing is allocated on the device per step. `close()` saves the runtime cache
and frees everything in reverse order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.engines.graph_engine import StepExecutor
from llm_runner_svc.errors import FailedPrecondition, Unimplemented
from llm_runner_svc.export.profiles import DECODE, PREFILL
from llm_runner_svc.export.signature import GraphDtype, io_tensors
from llm_runner_svc.export.trt_module import TensorRT
from llm_runner_svc.models.spec import ModelConfig

log = logging.getLogger(__name__)
PROFILE_INDEX = {PREFILL: 0, DECODE: 1}


def _cuda(result: Any, what: str) -> Any:
    """cuda-python returns (error, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise FailedPrecondition(f"CUDA {what} failed: {err!r}")
    return values[0] if len(values) == 1 else values


class TrtExecutor(StepExecutor):
    def __init__(self, trt: TensorRT, plan_bytes: bytes, config: ModelConfig,
                 dtype: GraphDtype, plan: EnginePlan, runtime_cache: Path | None) -> None:
        m = trt.module
        self.trt = trt
        self.cache_path = runtime_cache
        self._logger = m.Logger(m.Logger.WARNING)
        self._runtime = m.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan_bytes)
        if self.engine is None:
            raise FailedPrecondition(
                f"{trt.name} {trt.version} could not deserialize the plan ({len(plan_bytes)} "
                "bytes); its log says why. A TensorRT-RTX plan runs only on an RTX-class GPU "
                "of a target it was built for (not on Hopper); a full TensorRT plan only on "
                "the GPU model and TensorRT version that built it")
        try:
            from cuda.bindings import runtime as cudart
        except ImportError as exc:
            raise Unimplemented("the tensorrt engine needs cuda-python: "
                                "pip install 'llm-runner-svc[tensorrt]'") from exc
        self._cudart = cudart
        self._buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)
        self._stream: Any = None
        self._cache: Any = None
        self.context: Any = None
        try:
            self._open(config, dtype, plan)
        except BaseException:
            self.close()
            raise

    def _open(self, config: ModelConfig, dtype: GraphDtype, plan: EnginePlan) -> None:
        m, cudart = self.trt.module, self._cudart
        self._stream = _cuda(cudart.cudaStreamCreate(), "stream creation")
        runtime_config = self._open_runtime_config()
        self.context = (self.engine.create_execution_context(runtime_config)
                        if runtime_config is not None
                        else self.engine.create_execution_context())
        self._profile = -1
        self._dtypes: dict[str, np.dtype] = {}
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        sizes = {"batch": max(plan.max_batch, 1), "seq": plan.prefill_chunk,
                 "past": plan.max_seq - 1, "total": plan.max_seq}
        descs = {t.name: t for t in io_tensors(config, dtype, plan.hidden_layer is not None)}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            is_input = self.engine.get_tensor_mode(name) == m.TensorIOMode.INPUT
            (self._inputs if is_input else self._outputs).append(name)
            self._dtypes[name] = np.dtype(m.nptype(self.engine.get_tensor_dtype(name)))
            dims = [d if isinstance(d, int) else sizes[d] for d in descs[name].dims]
            nbytes = int(np.prod(dims)) * self._dtypes[name].itemsize
            ptr = _cuda(cudart.cudaMalloc(max(nbytes, 1)), f"allocation of {name}")
            self._buffers[name] = (int(ptr), nbytes)
            self.context.set_tensor_address(name, int(ptr))

    def _open_runtime_config(self) -> Any:
        """TensorRT-RTX: a runtime config whose runtime cache is read from `cache_path`."""
        if not hasattr(self.engine, "create_runtime_config"):
            return None
        runtime_config = self.engine.create_runtime_config()
        if self.cache_path is not None and hasattr(runtime_config, "create_runtime_cache"):
            self._cache = runtime_config.create_runtime_cache()
            if self.cache_path.is_file() and not self._cache.deserialize(
                    self.cache_path.read_bytes()):
                log.warning("runtime cache %s does not match this GPU or TensorRT-RTX; "
                            "starting with an empty one", self.cache_path)
            runtime_config.set_runtime_cache(self._cache)
        return runtime_config

    def run(self, feeds: Mapping[str, np.ndarray], profile: str) -> dict[str, np.ndarray]:
        cudart, ctx = self._cudart, self.context
        index = PROFILE_INDEX[profile]
        if index != self._profile:
            if not ctx.set_optimization_profile_async(index, self._stream):
                raise FailedPrecondition(f"TensorRT refused optimization profile {profile}")
            self._profile = index
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        for name in self._inputs:
            arr = np.ascontiguousarray(feeds[name], dtype=self._dtypes[name])
            if not ctx.set_input_shape(name, arr.shape):
                raise FailedPrecondition(f"input {name} shape {arr.shape} is outside the plan's "
                                         f"{profile} profile")
            ptr, cap = self._buffers[name]
            if arr.nbytes > cap:
                raise FailedPrecondition(f"input {name} needs {arr.nbytes} bytes, buffer has {cap}")
            if arr.nbytes:
                _cuda(cudart.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, h2d,
                                             self._stream), f"copy of {name}")
        for name in self._outputs:  # buffers are fixed; rebinding is cheap and keeps order clear
            ctx.set_tensor_address(name, self._buffers[name][0])
        if not ctx.execute_async_v3(self._stream):
            raise FailedPrecondition(f"TensorRT execute_async_v3 failed ({profile} step)")
        outputs: dict[str, np.ndarray] = {}
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name in self._outputs:
            out = np.empty(tuple(ctx.get_tensor_shape(name)), self._dtypes[name])
            if out.nbytes:
                _cuda(cudart.cudaMemcpyAsync(out.ctypes.data, self._buffers[name][0], out.nbytes,
                                             d2h, self._stream), f"copy of {name}")
            outputs[name] = out
        _cuda(cudart.cudaStreamSynchronize(self._stream), "stream synchronize")
        return outputs

    def close(self) -> None:
        if self._cache is not None and self.cache_path is not None:
            self.cache_path.write_bytes(bytes(self._cache.serialize()))
            self._cache = None
        self.context = None
        for ptr, _ in self._buffers.values():
            self._cudart.cudaFree(ptr)
        self._buffers.clear()
        if self._stream is not None:
            self._cudart.cudaStreamDestroy(self._stream)
            self._stream = None
        self.engine = None
