"""Build a TensorRT / TensorRT-RTX plan from an exported step graph (no GPU needed for RTX).

The network is strongly typed (the ONNX graph already says which tensors are fp16/bf16), so
no precision flags are set. TensorRT-RTX compiles for the compute capabilities it is given:
SM75/80/86/89/120/121, never SM90 (Hopper needs full TensorRT); SM75 has no fp32 or bf16 GEMM,
so an SM75 plan needs the fp16 export.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_runner_svc.errors import FailedPrecondition, InvalidArgument
from llm_runner_svc.export.profiles import PlanLimits, Profile, plan_profiles
from llm_runner_svc.export.signature import GraphDtype, TensorDesc
from llm_runner_svc.export.trt_module import TensorRT

log = logging.getLogger(__name__)

RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
DEFAULT_TARGETS = ("sm80", "sm86", "sm89", "sm120")  # every RTX target that runs fp32 GEMMs


@dataclass(frozen=True)
class PlanBuild:
    """A built plan and what the build saw."""

    plan: bytes
    parse_errors: tuple[str, ...]
    network_io: tuple[dict[str, Any], ...]  # name, dtype, shape (-1 = dynamic), mode
    targets: tuple[str, ...]
    profiles: tuple[Profile, ...]
    build_s: float
    warnings: list[str] = field(default_factory=list)


def check_targets(targets: Sequence[str], dtype: GraphDtype, trt: TensorRT) -> tuple[str, ...]:
    """Validate target names for this module and dtype; () for full TensorRT (its own GPU)."""
    if not trt.is_rtx:
        if targets:
            raise InvalidArgument("--targets is a TensorRT-RTX option; full TensorRT builds for "
                                  "the GPU it runs on")
        return ()
    chosen = tuple(t.lower() for t in targets) or DEFAULT_TARGETS
    unknown = [t for t in chosen if t not in RTX_TARGETS]
    if unknown:
        raise InvalidArgument(f"target {unknown[0]!r} is not one TensorRT-RTX builds for "
                              f"(valid: {', '.join(RTX_TARGETS)}; Hopper SM90 is not among them)")
    if "sm75" in chosen and dtype is not GraphDtype.FP16:
        raise InvalidArgument(f"target sm75 (Turing) needs --dtype fp16, got {dtype.value}")
    return chosen


def build_plan(trt: TensorRT, onnx_bytes: bytes, inputs: Sequence[TensorDesc],
               limits: PlanLimits, targets: tuple[str, ...]) -> PlanBuild:
    """Parse the graph, add the prefill and decode profiles, build the serialized plan."""
    m = trt.module
    logger = m.Logger(m.Logger.WARNING)
    builder = m.Builder(logger)
    flags = 0
    if not trt.is_rtx:  # full TensorRT: ask for strong typing as RTX always does
        flags = 1 << int(m.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = m.OnnxParser(network, logger)
    is_parsed = parser.parse(onnx_bytes)
    errors = tuple(str(parser.get_error(i)) for i in range(parser.num_errors))
    if not is_parsed or errors:
        raise FailedPrecondition(f"the TensorRT ONNX parser refused the graph: {list(errors)}")
    io = tuple(_tensor_info(network.get_input(i), "input") for i in range(network.num_inputs)) + \
        tuple(_tensor_info(network.get_output(i), "output") for i in range(network.num_outputs))
    config = builder.create_builder_config()
    if targets:
        config.num_compute_capabilities = len(targets)
        for i, name in enumerate(targets):
            if not config.set_compute_capability(getattr(m.ComputeCapability, name.upper()), i):
                raise InvalidArgument(f"TensorRT-RTX refused compute capability {name}")
    profiles = tuple(plan_profiles(limits))
    for prof in profiles:
        p = builder.create_optimization_profile()
        for t in inputs:
            p.set_shape(t.name, *prof.shapes(t))
        config.add_optimization_profile(p)
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    if serialized is None:
        raise FailedPrecondition(f"{trt.name} could not build a plan for targets "
                                 f"{list(targets) or 'of this GPU'} (see its log above)")
    log.info("built a %d-byte plan in %.2f s for %s", serialized.nbytes, build_s, targets)
    return PlanBuild(bytes(serialized), errors, io, targets, profiles, build_s)


def _tensor_info(t: Any, mode: str) -> dict[str, Any]:
    return {"name": t.name, "dtype": str(t.dtype).rsplit(".", 1)[-1].lower(),
            "shape": list(t.shape), "mode": mode}
