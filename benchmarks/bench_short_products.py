"""The short prefill pass's products on a CUDA GPU: each of a decoder layer's four products
with what surrounds it, cuBLAS and small kernels against `short_kernel` in a sweep of
tilings (torch_triton_short.py), at a model shape's layer sizes.

Each variant is captured in a CUDA graph over every layer's own weights (so no weight is
read from L2 twice, as in a real pass) and replayed; the figure is microseconds a layer,
the median of --reps replays. What each side runs:

  q/k/v    cuBLAS: RMSNorm kernel + addmm with the bias   short: RMSNorm kernel + one launch
  o        cuBLAS: addmm onto the float32 residual        short: one launch
  gate/up  cuBLAS: RMSNorm + mm + SiLU-gate kernel        short: RMSNorm kernel + one launch
  down     cuBLAS: addmm onto the residual (its split-K)  short: one launch

With --norm-inside, q/k/v and gate/up also try the RMSNorm inside the product (one launch).
With --write FILE, the fastest tiling of each product that beats both cuBLAS figures by 2%
goes to FILE (JSON), which `bench_prefix_cache.py --short-tilings FILE` hands to the engine.

Usage: python benchmarks/bench_short_products.py [--shape qwen2.5-7b] [--rows 50]
                                                 [--products gate/up,down] [--write FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines.torch_triton import TritonOps  # noqa: E402
from llm_runner_svc.engines.torch_triton_modes import (  # noqa: E402
    ACCUMULATE,
    SILU_GATE,
    STORE,
    Shape,
    Tiling,
)
from llm_runner_svc.engines.torch_triton_short import MAX_ROWS, ShortProducts  # noqa: E402
from llm_runner_svc.engines.torch_weights import named_shape, random_weights  # noqa: E402

Body = Callable[[int], None]  # runs one layer's product


def _graph_us(body: Body, layers: int, reps: int) -> float:
    """Microseconds a layer: `body` for every layer, captured once, replayed `reps` times."""
    for li in range(layers):  # compile and warm up
        body(li)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for li in range(layers):
            body(li)
    return gpu_paths.event_ms(graph.replay, reps=1, rounds=reps) * 1e3 / layers


def _candidates(mode: int, k: int) -> list[Tiling]:
    """Each tiling with the weights' loads plain and hinted to leave L2 first."""
    if mode == SILU_GATE:  # 18,944 columns: tiles of 64 make 296 programs, 2.2 waves
        return [Tiling(bn, bk, sp, w, st, ev) for bn in (32, 64, 128) for sp in (1, 2)
                for bk, st in ((128, 4), (64, 6), (128, 3))
                for w in ((4, 8) if bn == 128 else (4,)) for ev in (0, 1)]
    splits = (2, 4, 8) if k > 8192 else (1, 2, 4)
    return [Tiling(bn, bk, sp, 4, st, ev) for bn in (32, 64, 128) for sp in splits
            for bk, st in ((128, 4), (64, 6)) for ev in (0, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--rows", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--write", type=Path, default=None, help="the fastest tilings (JSON)")
    ap.add_argument("--products", default="q/k/v,o,gate/up,down",
                    help="which of the layer's products to sweep (comma-separated)")
    ap.add_argument("--norm-inside", action="store_true",
                    help="also the RMSNorm inside q/k/v and gate/up")
    args = ap.parse_args()
    assert args.rows <= MAX_ROWS
    dev = torch.device("cuda")
    c = named_shape(args.shape)
    w = random_weights(c, dev, torch.bfloat16)
    layers = w.layers
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ops = TritonOps(c, 16, num_sms, has_fused_products=False)
    m = args.rows
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, c.hidden_size, device=dev, generator=gen)
    h = torch.empty(m, c.hidden_size, device=dev, dtype=torch.bfloat16)
    qkv = torch.empty(m, c.q_dim + 2 * c.kv_dim, device=dev, dtype=torch.bfloat16)
    attn = torch.randn(m, c.q_dim, device=dev, generator=gen).to(torch.bfloat16)
    gu = torch.empty(m, 2 * c.intermediate_size, device=dev, dtype=torch.bfloat16)
    act = torch.randn(m, c.intermediate_size, device=dev, generator=gen).to(torch.bfloat16)
    f32 = torch.float32

    def cublas_qkv(li: int) -> None:
        lw = layers[li]
        ops.rms_norm(x, lw.attn_norm, h)
        if lw.qkv_bias is not None:
            torch.addmm(lw.qkv_bias, h, lw.qkv.t(), out=qkv)
        else:
            torch.mm(h, lw.qkv.t(), out=qkv)

    def cublas_gate(li: int) -> None:
        ops.rms_norm(x, layers[li].ffn_norm, h)
        torch.mm(h, layers[li].gate_up.t(), out=gu)
        ops.silu_mul(gu, act)

    def cublas_o(li: int) -> None:
        torch.addmm(x, attn, layers[li].wo.t(), out_dtype=f32, out=x)

    def cublas_down(li: int) -> None:
        torch.addmm(x, act, layers[li].down.t(), out_dtype=f32, out=x)

    cublas: dict[str, Body] = {"q/k/v": cublas_qkv, "o": cublas_o, "gate/up": cublas_gate,
                               "down": cublas_down}
    products = {"q/k/v": (c.q_dim + 2 * c.kv_dim, c.hidden_size, STORE),
                "o": (c.hidden_size, c.q_dim, ACCUMULATE),
                "gate/up": (c.intermediate_size, c.hidden_size, SILU_GATE),
                "down": (c.hidden_size, c.intermediate_size, ACCUMULATE)}

    def short_body(name: str, sp: ShortProducts, inside: bool) -> Body:
        def qkv_body(li: int) -> None:
            lw = layers[li]
            if not inside:
                ops.rms_norm(x, lw.attn_norm, h)
            done = (sp.norm_product(x, lw.attn_norm, lw.qkv, lw.qkv_bias, qkv) if inside
                    else sp.product(h, lw.qkv, lw.qkv_bias, qkv))
            assert done

        def gate_body(li: int) -> None:
            lw = layers[li]
            if not inside:
                ops.rms_norm(x, lw.ffn_norm, h)
            done = (sp.norm_gate(x, lw.ffn_norm, lw.gate_up, act) if inside
                    else sp.gate(h, lw.gate_up, act))
            assert done

        def sum_body(li: int) -> None:
            if name == "o":
                assert sp.accumulate(attn, layers[li].wo, x)
            else:
                assert sp.accumulate(act, layers[li].down, x)

        return {"q/k/v": qkv_body, "gate/up": gate_body}.get(name, sum_body)

    print(f"{args.shape}, {m} rows, {len(layers)} layers, "
          f"{torch.cuda.get_device_name(dev)}, {num_sms} SMs; us a layer (median of "
          f"{args.reps} graph replays)\n")
    print("| product | norm | cuBLAS (+ its small kernels) | the same on cuBLASLt | short, best | "
          "best tiling (bn, bk, split, warps, stages, evict) | vs the faster cuBLAS |\n"
          "|---|---|---:|---:|---:|---|---:|")
    chosen: dict[Shape, Tiling] = {}
    for name, (n, k, mode) in products.items():
        if name not in args.products.split(","):
            continue
        base = _graph_us(cublas[name], len(layers), args.reps)
        blas = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        base_lt = _graph_us(cublas[name], len(layers), args.reps)
        torch.backends.cuda.preferred_blas_library(blas)
        insides = (False, True) if args.norm_inside and name in ("q/k/v", "gate/up") else (
            False,)
        best: tuple[float, Shape, Tiling] | None = None
        for inside in insides:
            shape: Shape = (n, k, mode, inside)
            results: list[tuple[float, Tiling]] = []
            for t in _candidates(mode, k):
                sp = ShortProducts(c.rms_eps, {shape: t})
                sp.reserve(dev)
                try:
                    us = _graph_us(short_body(name, sp, inside), len(layers), args.reps)
                except Exception as exc:  # noqa: BLE001 (a tiling the GPU cannot hold)
                    print(f"  {name} {tuple(t)}: {type(exc).__name__}: {str(exc)[:80]}",
                          file=sys.stderr)
                    continue
                results.append((us, t))
            results.sort()
            us, t = results[0]
            ref = min(base, base_lt)  # a short pass runs its other products on cuBLASLt
            where = "inside" if inside else ("kernel before" if name in ("q/k/v", "gate/up")
                                             else "-")
            print(f"| {name} | {where} | {base:.1f} | {base_lt:.1f} | {us:.1f} | {tuple(t)} | "
                  f"{us / ref:.2f}x |", flush=True)
            print(f"  {name}: next best " + ", ".join(f"{tuple(t)} {us:.1f}"
                                                     for us, t in results[1:4]),
                  file=sys.stderr)
            if best is None or us < best[0]:
                best = (us, shape, t)
        if best is not None and best[0] < 0.98 * min(base, base_lt):
            chosen[best[1]] = best[2]
    if args.write is not None:
        rows = [[*shape, *t] for shape, t in chosen.items()]
        args.write.write_text(json.dumps({"shape": args.shape, "tilings": rows}))
        print(f"\nwrote {args.write}: {len(rows)} of the products beat cuBLAS by 2% or more")

if __name__ == "__main__":
    main()
