"""One table of bench_gpu.py runs of several trees (benchmarks/gpu_ab.sh): per shape and batch,
each tree's in-process, Step-stream and orchestrator ms per step, every round in order, and each
service column's ratio to the same run's in-process figure.

Usage: python benchmarks/gpu_ab_table.py RUNS/NAME_ROUND_SHAPE.json ...
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(paths: list[str]) -> None:
    # (shape, batch) -> tree -> [(in-process, grpc, orchestrator) per round]
    cells: dict[tuple[str, int], dict[str, list[tuple[float, float, float]]]] = \
        defaultdict(lambda: defaultdict(list))
    by_workers: dict[tuple[str, int, str], list[str]] = defaultdict(list)
    gpu = ""
    # files NAME_ROUND_SHAPE.json: each cell lists its rounds in order
    for path in sorted(paths, key=lambda p: (Path(p).stem.split("_")[1], Path(p).stem)):
        tree = Path(path).stem.split("_")[0]
        run = json.loads(Path(path).read_text())
        gpu = run.get("gpu", gpu)
        for r in run["rows"]:
            cells[(r["shape"], r["batch"])][tree].append(
                (r["in_process_ms"], r["grpc_ms"], r["orchestrator_ms"]))
            for w, ms in r.get("orchestrator_ms_by_workers", {}).items():
                by_workers[(r["shape"], r["batch"], tree)].append(f"{w}w {ms:.2f}")
    print(f"# {gpu}: ms per decode step (per generated token of each request); x = the "
          "column over the same run's in-process")
    print("| shape | batch | tree | in-process | Step stream | x | orchestrator | x "
          "| orchestrator by workers |")
    print("|---|---:|---|---|---|---|---|---|---|")
    for (shape, batch), trees in sorted(cells.items()):
        for tree, runs in trees.items():
            col = [", ".join(f"{r[i]:.2f}" for r in runs) for i in range(3)]
            ratio = [", ".join(f"{r[i] / r[0]:.2f}" for r in runs) for i in range(3)]
            print(f"| {shape} | {batch} | {tree} | {col[0]} | {col[1]} | {ratio[1]} | "
                  f"{col[2]} | {ratio[2]} | "
                  f"{'; '.join(by_workers.get((shape, batch, tree), []))} |")


if __name__ == "__main__":
    main(sys.argv[1:])
