"""Weights read into L2 while a short pass's attention runs: do the products after it get
faster? (One GPU.)

The attention of a short pass after a long cached prefix (the engine's kernel, --queries
after --after positions) keeps the device's memory bus mostly idle for its whole time, and
the next products (o, then gate/up) only read weights. Here a side stream reads the next
layer products' first bytes into L2 (a Triton kernel that loads and sums them, evict-last)
while the attention runs, and the main stream waits for it before the o product. Each
variant runs the --shape's layers, every layer with its own weights and KV (so nothing is in
L2 from the layer before), captured as one CUDA graph; the figure is the graph's time per
layer (median of 5 replays).

Variants: attention alone; o product alone; attention then o then gate/up (plain); the same
with the o weights read beside the attention; with the o weights and the first MB of the
gate/up weights read beside it.

Usage: python benchmarks/bench_l2_prefetch.py [--shape qwen2.5-7b] [--queries 50]
                                              [--after 2000] [--prefetch-mb 0,8,16,24]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines.torch_prefill import PrefillChunk, PrefillStager  # noqa: E402
from llm_runner_svc.engines.torch_triton_prefill import (  # noqa: E402
    PrefillPartials,
    launch_prefill_attention,
    prefill_block,
)
from llm_runner_svc.engines.torch_weights import named_shape  # noqa: E402

TOUCH_BLOCK = 4096  # bf16 elements a program loads per iteration


@triton.jit
def touch_kernel(ptr, n, sink, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    """Load ITERS x BLOCK elements from program_id's range of `ptr` [n], keeping them in L2
    (evict_last); their sum goes to `sink` so the loads stay."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * ITERS * BLOCK
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < n, other=0.0,
                       eviction_policy="evict_last").to(tl.float32)
    tl.store(sink + pid, tl.sum(acc, axis=0))


def touch(t: torch.Tensor, elements: int, sink: torch.Tensor, programs: int) -> None:
    """Read the first `elements` of `t` (flat) into L2 with `programs` programs."""
    iters = max(1, -(-elements // (programs * TOUCH_BLOCK)))
    grid = -(-elements // (iters * TOUCH_BLOCK))
    touch_kernel[(grid,)](t, elements, sink, ITERS=iters, BLOCK=TOUCH_BLOCK, num_warps=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--after", type=int, default=2000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefetch-mb", default="0,8,16,24",
                    help="MB of the gate/up weights read beside the attention, after o's")
    ap.add_argument("--programs", type=int, default=64, help="programs of the reading kernel")
    args = ap.parse_args()
    c = named_shape(args.shape)
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    n, page, layers = args.queries, args.page_size, c.num_layers
    pages = -(-(args.after + n) // page)
    qkv = torch.randn(n, c.q_dim + 2 * c.kv_dim, device=dev, dtype=bf16)
    pools = [(torch.randn((pages + 1) * page, c.kv_dim, device=dev, dtype=bf16),
              torch.randn((pages + 1) * page, c.kv_dim, device=dev, dtype=bf16))
             for _ in range(layers)]
    wo = [torch.randn(c.hidden_size, c.q_dim, device=dev, dtype=bf16) * 0.02
          for _ in range(layers)]
    wgu = [torch.randn(2 * c.intermediate_size, c.hidden_size, device=dev, dtype=bf16) * 0.02
           for _ in range(layers)]
    attn = torch.empty(n, c.q_dim, device=dev, dtype=bf16)
    x = torch.empty(n, c.hidden_size, device=dev, dtype=bf16)
    gu = torch.empty(n, 2 * c.intermediate_size, device=dev, dtype=bf16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    partials = PrefillPartials(c.num_heads, c.head_dim, sms, dev)
    stager = PrefillStager(n, 1, pages, page, pages, dev)
    order = torch.randperm(pages).tolist()
    lay = stager.stage([PrefillChunk([0] * n, args.after, order, 0)], prefill_block(n))
    sink = torch.zeros(4 * sms * 16, device=dev)
    side = torch.cuda.Stream()

    def attention(li: int) -> None:
        k, v = pools[li]
        launch_prefill_attention(qkv, k, v, lay.blocks, lay.tables, attn, c.num_heads,
                                 c.num_kv_heads, c.head_dim, page, lay.block,
                                 partials=partials)

    def layer(li: int, has_products: bool, gate_mb: int | None) -> None:
        main_stream = torch.cuda.current_stream()
        if gate_mb is not None:
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                touch(wo[li], wo[li].numel(), sink, args.programs)
                if gate_mb:
                    touch(wgu[li], min(wgu[li].numel(), gate_mb * 2**20 // 2), sink,
                          args.programs)
        attention(li)
        if gate_mb is not None:
            main_stream.wait_stream(side)
        if has_products:
            torch.mm(attn, wo[li].t(), out=x)
            torch.mm(x, wgu[li].t(), out=gu)

    def every_layer(body: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            for li in range(layers):
                body(li)
        return run

    variants: dict[str, Callable[[], None]] = {
        "attention alone": every_layer(attention),
        "o product alone": every_layer(lambda li: torch.mm(attn, wo[li].t(), out=x)),
        "gate/up product alone": every_layer(lambda li: torch.mm(x, wgu[li].t(), out=gu)),
        "attention, o, gate/up": every_layer(lambda li: layer(li, True, None)),
    }
    def with_reads(mb: int) -> Callable[[int], None]:
        return lambda li: layer(li, True, mb)

    for mb in (int(v) for v in args.prefetch_mb.split(",")):
        variants[f"the same, o + {mb} MB of gate/up read beside the attention"] = \
            every_layer(with_reads(mb))
    print(f"{args.shape}: {n} queries after {args.after} positions, {layers} layers in one "
          f"graph, each with its own weights and KV; o weights {wo[0].nbytes / 2**20:.1f} MB, "
          f"gate/up {wgu[0].nbytes / 2**20:.1f} MB; reading kernel: {args.programs} programs\n")
    print("| variant | us per layer |\n|---|---:|")
    for name, run in variants.items():
        us = gpu_paths.graph_us(run, reps=1)
        print(f"| {name} | {us / layers:.1f} |", flush=True)


if __name__ == "__main__":
    main()
