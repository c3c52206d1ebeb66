"""The `llm-runner build-engine` subcommand: arguments, progress and the report it prints.

stdout carries the JSON report alone (pipe it into a JSON tool); the phases with their elapsed
time, the load progress bar and every library message (TensorRT's log included, which its
native code writes to file descriptor 1) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from llm_runner_svc.cli_common import HelpFormatter, load_progress


def add_build_engine(sub: argparse._SubParsersAction) -> None:
    from llm_runner_svc.export.signature import GraphDtype
    from llm_runner_svc.models import EMBEDDED_NAME, SMOLLM2_NAME

    p = sub.add_parser("build-engine", help="export the ONNX step graph and build a TensorRT "
                                            "plan with its engine.json sidecar",
                       formatter_class=HelpFormatter,
                       description="Exports the model's decoder step as ONNX and builds a "
                                   "TensorRT-RTX plan for the given targets (a machine without "
                                   "a GPU can build), writing model.onnx, model.plan and "
                                   "engine.json to --out. The phases go to stderr, one line of "
                                   "JSON describing the build to stdout.")
    p.add_argument("--model", default=None,
                   help=f"a built-in name ({EMBEDDED_NAME}, {SMOLLM2_NAME}), a llama2.c .bin, "
                        f".gguf file or Hugging Face directory (default: {EMBEDDED_NAME})")
    p.add_argument("--out", required=True, help="directory for model.onnx, model.plan, "
                                                "engine.json")
    p.add_argument("--dtype", default="fp16", choices=[d.value for d in GraphDtype],
                   help="weight and KV precision of the graph (norms and softmax stay fp32)")
    p.add_argument("--targets", default="",
                   help="TensorRT-RTX compute capabilities, comma separated (sm75, sm80, sm86, "
                        "sm89, sm120, sm121; sm75 needs fp16); default sm80,sm86,sm89,sm120")
    p.add_argument("--max-batch", type=int, default=8, help="largest batch the plan runs")
    p.add_argument("--max-seq", type=int, default=2048, help="positions per request, capped "
                                                             "at the model's context")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="most prompt tokens one prefill step takes")
    p.add_argument("--hidden-layer", type=int, default=None,
                   help="accept_hidden_layer of the stages that will serve it (hidden outputs)")
    p.add_argument("--onnx-only", action="store_true", help="write the ONNX and sidecar only")
    p.add_argument("--quiet", action="store_true", help="no phases or progress on stderr")


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Sends file descriptor 1 to stderr inside the block, for Python and native writers."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class _Phases:
    """Prints each phase as it starts, with the seconds since the build began."""

    def __init__(self, is_quiet: bool) -> None:
        self._t0 = time.monotonic()
        self._is_quiet = is_quiet

    def __call__(self, name: str) -> None:
        if not self._is_quiet:
            print(f"build-engine [{time.monotonic() - self._t0:6.1f} s] {name}",
                  file=sys.stderr, flush=True)


def run_build_engine(args: argparse.Namespace) -> int:
    from llm_runner_svc.export.build import build_engine_dir
    from llm_runner_svc.export.profiles import PlanLimits
    from llm_runner_svc.export.signature import GraphDtype

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    phases = _Phases(args.quiet)
    with _stdout_to_stderr(), load_progress(args.quiet):
        sidecar = build_engine_dir(
            args.model, args.out, GraphDtype.parse(args.dtype),
            PlanLimits(args.max_batch, args.max_seq, args.prefill_chunk), targets,
            args.hidden_layer, args.onnx_only, on_phase=phases)
    phases("done")
    print(json.dumps({"out": args.out, "plan": sidecar.plan, "targets": sidecar.targets,
                      "build_s": sidecar.build_s, "plan_bytes": sidecar.plan_bytes,
                      "onnx_bytes": sidecar.onnx_bytes, "onnx_nodes": sidecar.num_nodes}))
    return 0
