"""How much of the in-process decode rate the Step stream delivers, on CPU, with a step that
leaves the interpreter free the way a GPU step does.

The engine is the numpy engine on the embedded stories260K model, and each forward pass also
sleeps S ms (`time.sleep` releases the GIL, as a thread waiting on an accelerator does):
  - at the start of the pass, before its math: like the torch engine on CUDA, where the step
    launches its graph and then waits, and the host work (token acceptance, text, events)
    follows the wait;
  - at its end, after the math: the host work comes before the wait, where it competes for
    the GIL with the event loop delivering the previous step.
For each placement, S and batch size, the median time of one decode step measured two ways:
  - in-process: `InferenceRuntime.step()` in a loop (`gpu_paths.in_process`);
  - gRPC: the runner's Stage service on a loopback port in this process, one Step stream with
    every member, read by `gpu_paths.grpc_direct` in a child process: the median gap between
    the stream's events.
in-process / gRPC is the share of the in-process token rate a Step-stream reader gets. Each
figure is the median of --rounds rounds. Prints one table.

Usage: python benchmarks/bench_step_stream.py [--sleeps 0.5,1.0,1.6] [--batches 1,8]
       [--sleep-at start,end] [--steps 200] [--rounds 3] [--no-math]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402
import numpy as np  # noqa: E402

from llm_runner_svc.engines.batch import Pass  # noqa: E402
from llm_runner_svc.engines.numpy_engine import NumpyEngine  # noqa: E402
from llm_runner_svc.models import Model, load_model  # noqa: E402
from llm_runner_svc.runtime import InferenceRuntime, RuntimeConfig  # noqa: E402
from llm_runner_svc.stage import StageConfig  # noqa: E402

PROMPT = [1, 403, 407, 261, 378, 365, 280, 314]  # a short story opening, as token ids


class SleepyEngine(NumpyEngine):
    """The numpy engine whose forward passes also wait `sleep_s` with the GIL released, before
    its math (`sleep_first`) or after it. Without `math`, a pass does no model math at
    all: each row's logits pick a token that moves on every step (from a range of ordinary
    text pieces), so what is measured is the host's own work per step."""

    def __init__(self, model: Model, sleep_s: float, sleep_first: bool,
                 math: bool = True) -> None:
        super().__init__(model.config, model.weights)
        self.sleep_s = sleep_s
        self.sleep_first = sleep_first
        self.math = math
        self._turn = 0

    def _run(self, p: Pass) -> tuple[np.ndarray, np.ndarray] | None:
        if self.sleep_first:
            time.sleep(self.sleep_s)
        states = None
        if self.math:
            states = super()._run(p)
        else:
            self._turn += 1
            for seg in p.segments:
                if seg.wants_logits:
                    row = self._logits[seg.row]
                    row.fill(0.0)
                    row[300 + (7 * self._turn + seg.row) % 150] = 1.0
        if not self.sleep_first:
            time.sleep(self.sleep_s)
        return states


@dataclass(frozen=True)
class Case:
    sleep_ms: float
    batch: int
    steps: int
    sleep_first: bool
    math: bool = True

    def runtime(self, model: Model) -> InferenceRuntime:
        config = RuntimeConfig(max_batch=self.batch, max_seq=len(PROMPT) + self.steps + 8)
        engine = SleepyEngine(model, self.sleep_ms / 1000, self.sleep_first, self.math)
        rt = InferenceRuntime(engine, model.tokenizer, config)
        rt.preallocate()
        return rt


async def served(rt: InferenceRuntime, model: Model, prompts: list[list[int]],
                 steps: int) -> float:
    """Median Step-stream event gap (seconds) seen by a client in a child process."""
    config = StageConfig(max_batch=rt.config.max_batch, max_seq=rt.max_seq)
    async with gpu_paths.stage_server(config, model, rt) as target:
        return await gpu_paths.client_process("grpc_direct", target, prompts, steps)


def measure(model: Model, case: Case) -> tuple[float, float]:
    """(in-process, gRPC) seconds per step, one round."""
    prompts = [PROMPT] * case.batch
    rt = case.runtime(model)
    local = gpu_paths.in_process(rt, prompts, case.steps)
    rt.close()
    remote = asyncio.run(served(case.runtime(model), model, prompts, case.steps))
    return local, remote


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sleeps", default="0.5,1.0,1.6")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sleep-at", default="start,end")
    ap.add_argument("--no-math", action="store_true",
                    help="decode steps without model math: the host's own work per step")
    args = ap.parse_args()
    model = load_model()
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()},"
          f" stories260K {'no math' if args.no_math else 'numpy'} + sleep, {args.steps} steps,"
          f" median of {args.rounds} rounds",
          flush=True)
    print("| sleep at | sleep ms | batch | in-process ms | gRPC ms | in-process/gRPC |")
    print("|---|---:|---:|---:|---:|---:|")
    for at in args.sleep_at.split(","):
        for sleep_ms in (float(s) for s in args.sleeps.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                case = Case(sleep_ms, batch, args.steps, at == "start", not args.no_math)
                rounds = [measure(model, case) for _ in range(args.rounds)]
                local = statistics.median(r[0] for r in rounds)
                remote = statistics.median(r[1] for r in rounds)
                print(f"| {at} | {sleep_ms:.1f} | {batch} | {1000 * local:.3f} | "
                      f"{1000 * remote:.3f} | {local / remote:.2f} |", flush=True)


if __name__ == "__main__":
    main()
