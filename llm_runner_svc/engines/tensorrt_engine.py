"""The TensorRT graph engine: a TensorRT or TensorRT-RTX plan of our ONNX export.

The plan comes from a `llm-runner build-engine` directory (`build_dir`, checked against its
`engine.json` before anything touches the GPU) or, without one, is built at `preallocate()`
for the GPU in this machine. The executor (`trt_executor`) deserializes it, claims one device
buffer per IO tensor sized for the plan's largest step, and runs each step with
set_input_shape / set_tensor_address / execute_async_v3 on its own CUDA stream, switching
between the prefill and decode optimization profiles. With TensorRT-RTX, the runtime cache
named by the `runtime_cache` key is loaded at start and saved at close.

TensorRT-RTX plans run on RTX-class GPUs (SM75 .. SM121) and not on Hopper (H100/H200),
which needs full TensorRT.
"""

from __future__ import annotations

from pathlib import Path

from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.engines.graph_engine import GraphEngine, StepExecutor
from llm_runner_svc.errors import FailedPrecondition
from llm_runner_svc.export.profiles import PlanLimits
from llm_runner_svc.export.sidecar import EngineSidecar, load_sidecar
from llm_runner_svc.export.signature import GraphDtype
from llm_runner_svc.models.spec import ModelConfig, ModelWeights


def check_sidecar(sidecar: EngineSidecar, plan: EnginePlan, build_dir: Path) -> None:
    """Refuse a build whose plan cannot serve `plan` (FailedPrecondition naming the field)."""
    lim = sidecar.limits
    problems = []
    if sidecar.plan is None:
        problems.append("it holds no plan (built with --onnx-only)")
    if sidecar.hidden_layer != plan.hidden_layer:
        problems.append(f"it was built with hidden layer {sidecar.hidden_layer}, the stage "
                        f"asks for {plan.hidden_layer}")
    for field, have, want in (("max_batch", lim.max_batch, plan.max_batch),
                              ("max_seq", lim.max_seq, plan.max_seq),
                              ("prefill_chunk", lim.prefill_chunk, plan.prefill_chunk)):
        if have < want:
            problems.append(f"its {field} is {have}, the stage needs {want}")
    if sidecar.graph_dtype not in (GraphDtype.FP32, GraphDtype.FP16):
        problems.append(f"dtype {sidecar.dtype} has no host KV type in this engine")
    if problems:
        raise FailedPrecondition(f"build {build_dir} cannot serve this stage: "
                                 + "; ".join(problems))


class TensorRTEngine(GraphEngine):
    name = "tensorrt"

    def __init__(self, config: ModelConfig, weights: ModelWeights,
                 build_dir: str | Path | None = None, runtime_cache: str | Path | None = None
                 ) -> None:
        self.build_dir = Path(build_dir) if build_dir else None
        self.sidecar = load_sidecar(self.build_dir) if self.build_dir else None
        if self.sidecar is not None:
            self.dtype = self.sidecar.graph_dtype
        self.runtime_cache = Path(runtime_cache) if runtime_cache else None
        super().__init__(config, weights)

    def _open_executor(self, plan: EnginePlan) -> StepExecutor:
        from llm_runner_svc.engines.trt_executor import TrtExecutor
        from llm_runner_svc.export.trt_module import import_tensorrt

        trt = import_tensorrt()
        if self.sidecar is not None and self.build_dir is not None:
            check_sidecar(self.sidecar, plan, self.build_dir)
            plan_bytes = (self.build_dir / str(self.sidecar.plan)).read_bytes()
        else:
            plan_bytes = self._build_here(trt, plan)
        return TrtExecutor(trt, plan_bytes, self.config, self.dtype, plan,
                           self.runtime_cache)

    def _build_here(self, trt: object, plan: EnginePlan) -> bytes:
        """No build directory: export and build for this machine's GPU."""
        from llm_runner_svc.export.decoder import ExportOptions, export_decoder
        from llm_runner_svc.export.plan import build_plan
        from llm_runner_svc.export.signature import io_tensors
        from llm_runner_svc.export.trt_module import TensorRT

        assert isinstance(trt, TensorRT)
        graph = export_decoder(self.config, self.weights, ExportOptions(
            self.dtype, plan.hidden_layer, max_positions=plan.max_seq))
        inputs = [t for t in io_tensors(self.config, self.dtype, plan.hidden_layer is not None)
                  if t.is_input]
        limits = PlanLimits(plan.max_batch, plan.max_seq, plan.prefill_chunk)
        targets = ("current",) if trt.is_rtx else ()
        return build_plan(trt, graph.SerializeToString(), inputs, limits, targets).plan
