"""Products of a short prefill window on one GPU: the split-K Triton kernel
(llm_runner_svc/engines/torch_triton_skinny.py) against cuBLAS, at a model's layer shapes.

For each matrix of a layer (q/k/v with its bias, o and down accumulated onto a float32
residual, gate/up stored), one weight copy per layer (so nothing stays in L2 between the
products, as in a forward), random bf16, and `--rows` activation rows in bf16: a CUDA graph
of one product per layer, replayed (CUDA events), for cuBLAS as the engine calls it, for
`tiling()`'s choice, and for a sweep of tilings (columns a program, K step, splits, warps,
stages). Prints microseconds per product and the weights' TB/s, fastest tilings first.

Usage: python benchmarks/bench_skinny.py [--shape qwen2.5-7b] [--rows 50] [--no-sweep]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines.torch_triton_skinny import (  # noqa: E402
    MAX_SPLIT,
    SkinnyProducts,
    Tiling,
    tiling,
)
from llm_runner_svc.engines.torch_weights import named_shape  # noqa: E402

SWEEP = [Tiling(bn, bk, s, w, st) for bn, bk, s, w, st in itertools.product(
    (64, 128), (64, 128), (1, 2, 4, 8), (4, 8), (3, 5))]


def graph_us(fns: list[Callable[[], object]]) -> float:
    """Microseconds per call of the `fns`, captured in order as one CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return 1000 * gpu_paths.event_ms(graph.replay, reps=5, rounds=3, warmup=1) / len(fns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--rows", type=int, default=50)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    c = named_shape(args.shape)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    m, layers = args.rows, c.num_layers
    mats = [("qkv", c.q_dim + 2 * c.kv_dim, c.hidden_size, True, False),
            ("o", c.hidden_size, c.q_dim, False, True),
            ("gate_up", 2 * c.intermediate_size, c.hidden_size, False, False),
            ("down", c.hidden_size, c.intermediate_size, False, True)]
    sk = SkinnyProducts(sms)
    sk.reserve([(n, k) for _, n, k, _, _ in mats], dev)
    sk.widest = max(n for _, n, _, _, _ in mats)  # let the sweep split any of them
    sk._part = torch.empty(sk.widest * MAX_SPLIT * 64, device=dev)
    print(f"# {torch.cuda.get_device_name()}, {args.shape}, {m} rows, {layers} layers, "
          f"{sms} SMs")
    print("| matrix | MB a layer | cuBLAS us | TB/s | tiling() | us | TB/s | best tiling | us "
          "| TB/s |\n|---|---:|---:|---:|---|---:|---:|---|---:|---:|", flush=True)
    for name, n, k, has_bias, acc in mats:
        bench_matrix(sk, name, n, k, has_bias, acc, m, layers, not args.no_sweep)
        torch.cuda.empty_cache()


def bench_matrix(sk: SkinnyProducts, name: str, n: int, k: int, has_bias: bool, acc: bool,
                 m: int, layers: int, has_sweep: bool) -> None:
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    out = torch.zeros(m, n, device=dev, dtype=torch.float32 if acc else torch.bfloat16)
    mb = n * k * 2 / 1e6

    def cublas(w: torch.Tensor) -> Callable[[], object]:
        if acc:
            return lambda: torch.addmm(out, a, w.t(), out_dtype=torch.float32, out=out)
        if bias is not None:
            return lambda: torch.addmm(bias, a, w.t(), out=out)
        return lambda: torch.mm(a, w.t(), out=out)

    def ours(w: torch.Tensor, t: Tiling) -> Callable[[], object]:
        return lambda: sk.product(a, w, out, bias, acc, t)

    want = a.float() @ ws[0].float().t() + (bias.float() if bias is not None else 0.0)
    got = torch.zeros_like(out)
    sk.product(a, ws[0], got, bias, acc)
    rel = float((got.float() - want).norm() / want.norm())
    base = graph_us([cublas(w) for w in ws])
    own = tiling(n, k, sk.num_sms)
    own_us = graph_us([ours(w, own) for w in ws])
    results = []
    for t in SWEEP if has_sweep else []:
        if t.split_k > 1 and k // t.split_k < 2 * t.bk:
            continue
        try:
            results.append((graph_us([ours(w, t) for w in ws]), t))
        except Exception as exc:  # a tiling past the shared memory or registers
            print(f"#   {name} {tuple(t)}: {type(exc).__name__}", flush=True)
    results.sort()
    best_us, best = results[0] if results else (own_us, own)
    print(f"# {name}: tiling() result vs float32 reference, relative error {rel:.1e}")
    print(f"| {name} | {mb:.1f} | {base:.1f} | {mb / base:.2f} | {tuple(own)} | "
          f"{own_us:.1f} | {mb / own_us:.2f} | {tuple(best)} | {best_us:.1f} | "
          f"{mb / best_us:.2f} |", flush=True)
    for us, t in results[:5]:
        print(f"#   {name} {tuple(t)} {us:.1f} us {mb / us:.2f} TB/s", flush=True)

if __name__ == "__main__":
    main()
