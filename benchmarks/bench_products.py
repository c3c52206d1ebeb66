"""The fused batch-1 products (llm_runner_svc/engines/torch_triton_products.py) against
cuBLAS, on one GPU, at the real model shapes: what picks `gemv_tiles`, `GEMV_LIMITS` and
`fused_rows`.

Part 1, per matrix of each shape (random bf16 weights, float32 activations): the time of one
product inside a CUDA graph of 50 (so launch gaps count as they do in a decode step; the
smaller matrices stay in L2 across the 50, so these are best cases), for `gemv_tiles()`'s
choice, for the other tile candidates (at one row), and for cuBLAS (bf16 activations, float32
output), at each row count. Part 2, whole decode steps: the captured step of an engine with
the fused products on (`fused_rows` 1, the default) and off (0), at batches 1 and 2.

Usage: python benchmarks/bench_products.py [--shapes ...] [--rows 1] [--steps-only]
       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines.base import DecodeRow, EnginePlan  # noqa: E402
from llm_runner_svc.engines.torch_engine import TorchEngine  # noqa: E402
from llm_runner_svc.engines.torch_triton_products import (  # noqa: E402
    ACCUMULATE,
    SILU_GATE,
    STORE,
    gemv_kernel,
    gemv_tiles,
)
from llm_runner_svc.engines.torch_weights import named_shape, random_weights  # noqa: E402

CANDIDATES = [(4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8),
              (32, 256, 8), (32, 128, 4), (4, 512, 4), (8, 256, 4), (2, 1024, 4),
              (2, 512, 4), (4, 512, 2), (4, 1024, 2), (4, 256, 4), (4, 2048, 8),
              (2, 2048, 4)]  # (BN, BK, warps)


def matrices(name: str) -> list[tuple[str, int, int, int, bool]]:
    """(label, n, k, mode, normed) of one layer's products and the head."""
    c = named_shape(name)
    return [("qkv", c.q_dim + 2 * c.kv_dim, c.hidden_size, STORE, True),
            ("o", c.hidden_size, c.q_dim, ACCUMULATE, False),
            ("gate_up", c.intermediate_size, c.hidden_size, SILU_GATE, True),
            ("down", c.hidden_size, c.intermediate_size, ACCUMULATE, False),
            ("head", c.vocab_size, c.hidden_size, STORE, True)]


def bench_matrix(n: int, k: int, mode: int, normed: bool, m: int) -> dict:
    dev = torch.device("cuda")
    w_rows = 2 * n if mode == SILU_GATE else n
    w = torch.randn(w_rows, k, device=dev).mul_(0.02).to(torch.bfloat16)
    a = torch.randn(m, k, device=dev)
    norm = torch.ones(k, device=dev)
    out = torch.zeros(m, n, device=dev)
    a16 = a.to(torch.bfloat16)
    wide = torch.zeros(m, w_rows, device=dev)
    row: dict = {"n": n, "k": k, "m": m, "mb": w.nbytes / 1e6}

    bm = gemv_tiles(m, n, k, mode)[0]

    def fused(cfg):
        bn, bk, warps = cfg
        return lambda: gemv_kernel[(triton.cdiv(n, bn),)](
            a, a.stride(0), w, w, norm, out, out.stride(0), m, n, k, 1e-6, HAS_NORM=normed,
            HAS_BIAS=False, MODE=mode, BM=bm, BN=bn, BK=bk, num_warps=warps)

    row["cublas_us"] = gpu_paths.graph_us(lambda: torch.mm(a16, w.t(), out_dtype=torch.float32,
                                                          out=wide))
    chosen = gemv_tiles(m, n, k, mode)[1:]
    row["chosen"] = list(chosen)
    row["chosen_us"] = gpu_paths.graph_us(fused(chosen))
    best = (row["chosen_us"], chosen)
    for cfg in CANDIDATES if m == 1 else []:
        if bm * cfg[0] * cfg[1] > 8192 * cfg[2] // 4:
            continue
        try:
            us = gpu_paths.graph_us(fused(cfg))
        except Exception as exc:  # a candidate that does not compile or fit
            print(f"#   {cfg}: {type(exc).__name__}", flush=True)
            continue
        if us < best[0]:
            best = (us, cfg)
    row["best_us"], row["best"] = best[0], list(best[1])
    row["gbps_chosen"] = w.nbytes / row["chosen_us"] / 1e3
    return row


def step_us(name: str, fused_rows: int, buckets: list[int]) -> dict[int, float]:
    config = named_shape(name)
    weights = random_weights(config, torch.device("cuda"), torch.bfloat16)
    eng = TorchEngine(config, weights, device="cuda", fused_rows=fused_rows)
    max_batch = max(buckets)
    plan = EnginePlan(max_batch=max_batch, max_seq=512, page_size=16,
                      num_pages=max_batch * 32)
    eng.preallocate(plan)
    rows = [DecodeRow(7, 200, list(range(i * 32, i * 32 + 13))) for i in range(max_batch)]
    graphs = eng.graphs
    assert graphs is not None
    out = {}
    for b in buckets:
        eng.decode(rows[:b])  # stages the inputs the replays below reuse
        out[b] = 1000 * gpu_paths.event_ms(lambda b=b: graphs.replay(b), reps=20, rounds=5)
    eng.close()
    del eng, weights
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--steps-only", action="store_true", help="skip part 1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    report: dict = {"gpu": torch.cuda.get_device_name(), "matrices": [], "steps": []}
    print("| shape | matrix | MB | rows | cuBLAS us | fused us | GB/s | best us | best tiles |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for name in ([] if args.steps_only else args.shapes.split(",")):
        for label, n, k, mode, normed in matrices(name):
            for m in rows_list:
                r = bench_matrix(n, k, mode, normed, m)
                r.update(shape=name, matrix=label)
                report["matrices"].append(r)
                print(f"| {name} | {label} | {r['mb']:.1f} | {m} | {r['cublas_us']:.1f} | "
                      f"{r['chosen_us']:.1f} | {r['gbps_chosen']:,.0f} | {r['best_us']:.1f} | "
                      f"{r['best']} |", flush=True)
    print("| shape | bucket | step us, fused | step us, cuBLAS | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        fused = step_us(name, 1, [1, 2])
        plain = step_us(name, 0, [1, 2])
        for b in fused:
            report["steps"].append({"shape": name, "bucket": b, "fused_us": fused[b],
                                    "cublas_us": plain[b]})
            print(f"| {name} | {b} | {fused[b]:.0f} | {plain[b]:.0f} | "
                  f"{plain[b] / fused[b]:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
