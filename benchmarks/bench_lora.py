"""Decode-step cost of LoRA adapters mixed in one batch, on the CPU engines.

For each engine (numpy, torch on the CPU) and batch size: the median time of one decode
step with every row on the base model, every row on one shared adapter, and every row on
a different adapter (row i on adapter i % N + 1, N adapters resident), all rank R on the
seven target modules, as a ratio against the base step measured side by side in the same
process. Adapters are random (non-zero B) in memory: the cost does not depend on values.

Usage: python benchmarks/bench_lora.py [--model smollm2] [--batches 1,8,32] [--rank 16]
                                       [--adapters 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llm_runner_svc.engines import create_engine
from llm_runner_svc.engines.base import Engine, EnginePlan
from llm_runner_svc.engines.batch import Batch, Row
from llm_runner_svc.models import load_model
from llm_runner_svc.models.lora import MODULES, LoraAdapter, module_shape
from llm_runner_svc.models.spec import ModelConfig

PROMPT = 16  # positions each row holds before the timed steps
PAGE = 16


def random_adapter(cfg: ModelConfig, name: str, rank: int, seed: int) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(cfg.num_layers):
        pairs = {}
        for m in MODULES:
            out_dim, in_dim = module_shape(cfg, m)
            pairs[m] = (rng.standard_normal((rank, in_dim), dtype=np.float32) * 0.01,
                        rng.standard_normal((out_dim, rank), dtype=np.float32) * 0.01)
        layers.append(pairs)
    return LoraAdapter(name, rank, 2.0, tuple(MODULES), tuple(layers))


def step_ms(engine: Engine, batch: int, adapters: list[int], steps: int) -> float:
    """Median ms of a decode step of `batch` rows on `adapters` (per row)."""
    pages_per_row = (PROMPT + steps + 1 + PAGE - 1) // PAGE
    tables = [tuple(range(r * pages_per_row, (r + 1) * pages_per_row)) for r in range(batch)]
    prompt = tuple(range(5, 5 + PROMPT))
    engine.read(engine.launch(Batch(tuple(Row(prompt, 0, tables[r], adapter=adapters[r])
                                          for r in range(batch)), keep_logits=True)))
    times = []
    for i in range(steps):
        rows = tuple(Row((7 + i,), PROMPT + i, tables[r], adapter=adapters[r])
                     for r in range(batch))
        t0 = time.perf_counter()
        engine.read(engine.launch(Batch(rows, keep_logits=True)))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engines", default="numpy,torch")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    model = load_model(args.model)
    cfg = model.config
    adapters = [random_adapter(cfg, f"a{i}", args.rank, i) for i in range(args.adapters)]
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{args.model}, rank {args.rank} on {len(MODULES)} modules, {args.adapters} "
          f"adapters resident, median of {args.steps} decode steps")
    print("| engine | batch | base ms | one shared adapter | every row its own adapter |")
    print("|---|---|---|---|---|")
    for name in args.engines.split(","):
        options = {"device": "cpu"} if name == "torch" else {}
        engine = create_engine(name, cfg, model.weights, adapters=adapters, **options)
        for b in batches:
            pages = b * ((PROMPT + args.steps + 1 + PAGE - 1) // PAGE)
            engine.preallocate(EnginePlan(max_batch=b, max_seq=PROMPT + args.steps + 1,
                                          page_size=PAGE, num_pages=pages, prefill_chunk=max(
                                              PROMPT * b, 16)))
            base = step_ms(engine, b, [0] * b, args.steps)
            shared = step_ms(engine, b, [1] * b, args.steps)
            mixed = step_ms(engine, b, [i % args.adapters + 1 for i in range(b)], args.steps)
            engine.close()
            print(f"| {name} | {b} | {base:.2f} | {shared:.2f} ({shared / base:.2f}x) | "
                  f"{mixed:.2f} ({mixed / base:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
