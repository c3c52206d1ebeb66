"""Tokens/s through the orchestrator with tracing off vs on (sampling every request, exporting
OTLP to a local receiver), at one concurrency. Each mode gets its own fresh deployment; rounds
alternate between the two so drift hits both alike.

Usage: python benchmarks/bench_tracing.py [--model stories260K] [--concurrency 8]
       [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_orchestrator import over_grpc  # noqa: E402
from deployment import Deployment  # noqa: E402
from otlp_receiver import OtlpReceiver  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="stories260K")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    receiver = OtlpReceiver()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        deps = {}
        for mode in ("off", "on"):
            (Path(tmp) / mode).mkdir()
            deps[mode] = Deployment(Path(tmp) / mode,
                                    {"backbone": {"maxSeq": 512, "maxBatch": 32,
                                                  "artifact": args.model}},
                                    env=receiver.env() if mode == "on" else None)
        try:
            for _ in range(args.rounds):
                for mode, dep in deps.items():
                    r = asyncio.run(over_grpc("orchestrator", dep.target, args.concurrency,
                                              args.tokens))
                    rates[mode].append(r["tokens_per_s"])
        finally:
            for dep in deps.values():
                dep.close()
    receiver.stop()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"# model {args.model}, concurrency {args.concurrency}, {args.tokens} tokens per "
          f"request, {args.rounds} rounds (median)")
    for mode, rate in (("off", off), ("on", on)):
        rounds = ", ".join(f"{x:,.0f}" for x in rates[mode])
        print(f"tracing {mode}: {rate:,.1f} tok/s  (rounds: {rounds})")
    print(f"spans received: {len(receiver.spans)}")
    print(f"slowdown with tracing: {100 * (1 - on / off):.1f}%")


if __name__ == "__main__":
    main()
