"""The `llm-runner build-engine` subcommand: arguments and the report it prints."""

from __future__ import annotations

import argparse
import json

from llm_runner_svc.export.profiles import PlanLimits
from llm_runner_svc.export.signature import GraphDtype


def add_build_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-engine", help="export the ONNX step graph and build a TensorRT "
                                            "plan with its engine.json sidecar")
    p.add_argument("--model", default=None,
                   help="llama2.c .bin, .gguf, Hugging Face directory or built-in name "
                        "(default: the embedded stories260K)")
    p.add_argument("--out", required=True, help="directory for model.onnx, model.plan, "
                                                "engine.json")
    p.add_argument("--dtype", default="fp16", choices=[d.value for d in GraphDtype])
    p.add_argument("--targets", default="",
                   help="TensorRT-RTX compute capabilities, comma separated (sm75, sm80, sm86, "
                        "sm89, sm120, sm121; sm75 needs fp16); default sm80,sm86,sm89,sm120")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-seq", type=int, default=2048, help="capped at the model's context")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--hidden-layer", type=int, default=None,
                   help="accept_hidden_layer of the stages that will serve it (hidden outputs)")
    p.add_argument("--onnx-only", action="store_true", help="write the ONNX and sidecar only")


def run_build_engine(args: argparse.Namespace) -> int:
    from llm_runner_svc.export.build import build_engine_dir

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    sidecar = build_engine_dir(
        args.model, args.out, GraphDtype.parse(args.dtype),
        PlanLimits(args.max_batch, args.max_seq, args.prefill_chunk), targets,
        args.hidden_layer, args.onnx_only)
    print(json.dumps({"out": args.out, "plan": sidecar.plan, "targets": sidecar.targets,
                      "build_s": sidecar.build_s, "plan_bytes": sidecar.plan_bytes,
                      "onnx_bytes": sidecar.onnx_bytes, "onnx_nodes": sidecar.num_nodes}))
    return 0
