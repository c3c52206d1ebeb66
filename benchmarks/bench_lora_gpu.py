"""Decode-step cost of LoRA adapters mixed in one batch, on one GPU (the torch engine's CUDA
graphs with the per-row Triton kernels).

A 7B shape (Qwen2.5-7B, random bf16 weights drawn on the GPU) and N random adapters of rank
R on all seven modules (q/k/v/o, gate/up/down), resident in the engine's stacked buffers.
For each batch size, the captured decode step (CUDA events around graph replays, every row
at `--position`) measured side by side, in rounds that alternate the cases:
  - base: an engine without adapters (the base model's own graphs);
  - lora/base rows: the engine with the adapters, every row on the base model;
  - shared: every row on one adapter;
  - mixed: every row on a different adapter (row i on adapter i % N + 1).
Ratios are against the base engine's step. The bytes an adapter adds to a step are printed
beside them: a mixed batch of b rows reads min(b, N) adapters on top of the weights.
Before the table, one line per batch of the LoRA kernels alone (ms per launch, CUDA events,
layer 0, every row on a different adapter): at batch 1 the per-row shrink (normed for
q/k/v and gate/up, as the fused products take it) and expand, and the fused q/k/v and down
products with and without the term inside; at larger batches the grouped shrink and expand
(gate/up's expand always with the SiLU gate and down's shrink, as the unfused products run
it).

Usage: python benchmarks/bench_lora_gpu.py [--shape qwen2.5-7b] [--batches 1,8,32] [--rank 16]
                                           [--adapters 8] [--position 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402
from bench_lora import random_adapter  # noqa: E402

from llm_runner_svc.engines.base import DecodeRow, EnginePlan  # noqa: E402
from llm_runner_svc.engines.torch_engine import TorchEngine  # noqa: E402
from llm_runner_svc.engines.torch_lora import PER_ROW_ROWS, TorchLora  # noqa: E402
from llm_runner_svc.engines.torch_weights import named_shape, random_weights  # noqa: E402

PAGE = 16


def replay_ms(engine: TorchEngine, slots: list[int], position: int, reps: int) -> float:
    """ms per replay of the decode graph for rows on adapter `slots` at `position`."""
    graphs = engine.graphs
    assert graphs is not None
    plan = engine._need_plan()
    b = len(slots)
    bucket = graphs.bucket_for(b)
    per_row = position // plan.page_size + 1
    rows = [DecodeRow(0, position, [(i * per_row + p) % plan.num_pages for p in range(per_row)],
                      adapter=slots[i]) for i in range(b)]
    engine.stager.stage(rows, bucket)
    with_lora = any(slots)
    return gpu_paths.event_ms(lambda: graphs.replay(bucket, with_lora), reps=reps, warmup=3)


def _matrix_ms(lora: TorchLora, m: str, x: torch.Tensor, norm: torch.Tensor | None,
               idx: torch.Tensor, reps: int) -> dict[str, float]:
    """ms per launch of matrix m's shrink and expand in layer 0 for rows x on adapters idx
    (gate/up's expand: with the SiLU gate and down's shrink, as the unfused products run
    it)."""
    from llm_runner_svc.engines import torch_lora_triton as kernels

    b, dev = x.shape[0], x.device
    a, bt = lora.a[m][0], lora.b[m][0]
    t = torch.zeros(b, a.shape[2], device=dev)
    dest = torch.zeros(b, bt.shape[2], device=dev, dtype=torch.bfloat16)
    act = torch.zeros(b, bt.shape[2] // 2, device=dev, dtype=torch.bfloat16)
    t_down = torch.zeros(b, lora.rank, device=dev)
    starts = lora.starts(m)
    if b <= PER_ROW_ROWS:
        def shrink() -> None:
            kernels.shrink(x, a, idx, t, norm, lora.cfg.rms_eps)
    else:
        h = x.to(torch.bfloat16)  # the cuBLAS products' bf16 inputs

        def shrink() -> None:
            kernels.grouped_shrink(h, a, rows, t)

    rows = kernels.slot_rows(idx, torch.arange(a.shape[0] + 1, dtype=torch.int32, device=dev))

    def expand() -> None:
        if m == "gate_up":
            kernels.expand_gate(t, bt, rows, dest, act, lora.a["down"][0], t_down)
        elif b <= PER_ROW_ROWS:
            kernels.expand(t, bt, idx, dest, starts)
        else:
            kernels.grouped_expand(t, bt, rows, dest, starts, len(lora.bounds[m]) - 1)

    return {f"{m} shrink": gpu_paths.event_ms(shrink, reps=reps, warmup=3),
            f"{m} expand": gpu_paths.event_ms(expand, reps=reps, warmup=3)}


def kernel_ms(lora: TorchLora, engine: TorchEngine, b: int, reps: int) -> dict[str, float]:
    """ms per launch of layer 0's LoRA kernels for b rows on adapters 1, 2, ... (see the
    module docstring)."""
    cfg, lw, dev = lora.cfg, engine.weights.layers[0], lora.device
    idx = torch.tensor([i % lora.num_slots + 1 for i in range(b)], dtype=torch.int32,
                       device=dev)
    x = torch.randn(b, cfg.hidden_size, device=dev)  # the residual stream, float32
    inputs = {"qkv": x, "gate_up": x,
              "down": torch.randn(b, cfg.intermediate_size, device=dev)}
    norms = {"qkv": lw.attn_norm, "gate_up": lw.ffn_norm, "down": None}
    out: dict[str, float] = {}
    for m, inp in inputs.items():
        out.update(_matrix_ms(lora, m, inp, norms[m], idx, reps))
    products = engine.forward.products
    if b <= PER_ROW_ROWS and products is not None:
        term = lora.shrink_rows(0, "qkv", x, idx, lw.attn_norm)
        qkv = torch.zeros(b, lw.qkv.shape[0], device=dev)
        for name, lo in (("qkv fused", None), ("qkv fused+term", term)):
            out[name] = gpu_paths.event_ms(lambda lo=lo: products.norm_product(
                x, lw.attn_norm, lw.qkv, lw.qkv_bias, qkv, lo), reps=reps, warmup=3)
        term = lora.shrink_rows(0, "down", inputs["down"], idx)
        for name, lo in (("down fused", None), ("down fused+term", term)):
            out[name] = gpu_paths.event_ms(lambda lo=lo: products.accumulate(
                inputs["down"], lw.down, x, lo), reps=reps, warmup=3)
    torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--position", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = named_shape(args.shape)
    device = torch.device("cuda")
    t0 = time.perf_counter()
    weights = random_weights(cfg, device, torch.bfloat16)
    adapters = [random_adapter(cfg, f"a{i}", args.rank, seed=i) for i in range(args.adapters)]
    plan = EnginePlan(max_batch=max(batches), max_seq=args.position + 32, page_size=PAGE,
                      num_pages=max(batches) * ((args.position + 32) // PAGE + 1),
                      prefill_chunk=64, step_tokens=64)
    base = TorchEngine(cfg, weights, device=device, prefill_graph_tokens=0)
    base.preallocate(plan)
    lora = TorchEngine(cfg, weights, device=device, prefill_graph_tokens=0)
    lora.reserve_adapters(args.adapters, args.rank, kernel="triton")  # bf16 stacked buffers
    for k, adapter in enumerate(adapters, 1):
        lora.set_adapter(k, adapter)
    lora.preallocate(plan)
    assert lora.lora is not None and lora.lora.kernel == "triton"
    weight_bytes = base.weights.step_bytes()
    adapter_bytes = lora.lora.nbytes // (args.adapters + 1)
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}; {args.shape}, {args.adapters} adapters of rank "
          f"{args.rank} on 7 modules ({adapter_bytes / 2**20:.1f} MiB each, "
          f"{100 * adapter_bytes / weight_bytes:.2f}% of the weights); setup "
          f"{time.perf_counter() - t0:.0f} s; graph replays at position {args.position}, "
          f"median of {args.rounds} alternating rounds of {args.reps}", flush=True)
    kernels = {}
    for b in batches:
        kernels[b] = kernel_ms(lora.lora, lora, b, args.reps)
        print(f"# kernels, batch {b} (ms per launch): " + ", ".join(
            f"{k} {v:.4f}" for k, v in kernels[b].items()), flush=True)
    print("| batch | base ms | lora engine, base rows | one shared adapter | every row its own "
          "adapter | adapter bytes read (mixed) |")
    print("|---:|---:|---:|---:|---:|---:|")
    out = []
    for b in batches:
        cases = {"base": (base, [0] * b), "lora_base_rows": (lora, [0] * b),
                 "shared": (lora, [1] * b),
                 "mixed": (lora, [i % args.adapters + 1 for i in range(b)])}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, (eng, slots) in cases.items():
                times[k].append(replay_ms(eng, slots, args.position, args.reps))
        ms = {k: statistics.median(v) for k, v in times.items()}
        extra = min(b, args.adapters) * adapter_bytes / weight_bytes
        row = {"batch": b, **{f"{k}_ms": v for k, v in ms.items()},
               **{f"{k}_ratio": v / ms["base"] for k, v in ms.items()}}
        out.append(row)
        print(f"| {b} | {ms['base']:.3f} | {ms['lora_base_rows']:.3f} "
              f"({ms['lora_base_rows'] / ms['base']:.2f}x) | {ms['shared']:.3f} "
              f"({ms['shared'] / ms['base']:.2f}x) | {ms['mixed']:.3f} "
              f"({ms['mixed'] / ms['base']:.2f}x) | +{100 * extra:.1f}% |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "shape": args.shape, "rank": args.rank, "adapters": args.adapters,
            "position": args.position, "rows": out,
            "kernels_ms": {str(b): v for b, v in kernels.items()}}, indent=1))
    lora.close()
    base.close()


if __name__ == "__main__":
    main()
