"""Causal prefill attention on one GPU, one prompt, one layer: the engine's Triton kernel
over the paged pool against torch's FlashAttention (varlen, on keys and values gathered
contiguous from the same pages, the gather included) and torch SDPA on contiguous
tensors (what transformers runs). Prints ms per layer, TFLOP/s (causal: q.k and p.v over
n(n+1)/2 pairs) and each result's distance from SDPA's; then the Triton kernel's tile
choices (queries per block, keys per tile, warps, stages), fastest first.

With `--after P`, the prompts are short passes after P cached positions (a reused system
prompt): only the Triton kernel, in blocks of 64 queries, with its keys split over 1, 4, 8
or 16 programs per block (`prefill_splits`), merged by their last program or by a second
launch (counted in) that merges 1 to 16 queries per program (`MERGES`), each timed inside a
CUDA graph (the device's time, as the engine runs it) and eagerly.

Usage: python benchmarks/bench_attention.py [--shapes qwen2.5-1.5b,qwen2.5-7b]
       [--prompts 512,2048,8192] [--page-size 16] [--no-sweep] [--after 2000]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_paths  # noqa: E402

from llm_runner_svc.engines.torch_prefill import (  # noqa: E402
    PrefillChunk,
    PrefillLayout,
    PrefillStager,
)
from llm_runner_svc.engines.torch_triton_prefill import (  # noqa: E402
    COMBINE_TOKENS,
    PrefillPartials,
    Tiles,
    launch_prefill_attention,
    prefill_block,
    prefill_splits,
)
from llm_runner_svc.engines.torch_weights import named_shape  # noqa: E402

TILES = [(bm, (bn, w, st)) for bm in (64, 128) for bn in (64, 128) for w in (4, 8)
         for st in (2, 3) if bm * bn <= 128 * 64 or w == 8]


def bench(shape: str, n: int, page: int, has_sweep: bool) -> dict:
    c = named_shape(shape)
    dev = torch.device("cuda")
    pages = -(-n // page)
    order = torch.randperm(pages).tolist()  # a request's pages are not in pool order
    qkv = torch.randn(n, c.q_dim + 2 * c.kv_dim, device=dev, dtype=torch.bfloat16)
    k_pool = torch.randn((pages + 1) * page, c.kv_dim, device=dev, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    stager = PrefillStager(n, 1, pages, page, pages, dev)
    layout = stager.stage([PrefillChunk([0] * n, 0, order, 0)], prefill_block(n))
    out = torch.empty(n, c.q_dim, device=dev, dtype=torch.bfloat16)
    rows = layout.slots  # pool row of each position, in order

    def triton_paged() -> torch.Tensor:
        launch_prefill_attention(qkv, k_pool, v_pool, layout.blocks, layout.tables, out,
                                 c.num_heads, c.num_kv_heads, c.head_dim, page, layout.block)
        return out

    q = qkv[:, :c.q_dim].view(n, c.num_heads, c.head_dim)
    cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
    scale = 1.0 / math.sqrt(c.head_dim)

    def flash_gathered() -> torch.Tensor:
        k = k_pool.index_select(0, rows).view(n, c.num_kv_heads, c.head_dim)
        v = v_pool.index_select(0, rows).view(n, c.num_kv_heads, c.head_dim)
        res: torch.Tensor = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale)[0]
        return res.reshape(n, c.q_dim)

    kc = k_pool.index_select(0, rows).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
    vc = v_pool.index_select(0, rows).view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)

    def sdpa() -> torch.Tensor:
        res = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None], vc[None],
                                             is_causal=True, scale=scale, enable_gqa=True)
        return res[0].transpose(0, 1).reshape(n, c.q_dim)

    ref = sdpa().float()
    sweep = []
    own = PrefillStager(n, 1, pages, page, pages, dev)  # `layout` keeps its buffer
    for block_m, tiles in TILES if has_sweep else []:
        lay = own.stage([PrefillChunk([0] * n, 0, order, 0)], block_m)

        def run(lay: PrefillLayout = lay, block_m: int = block_m, tiles: Tiles = tiles) -> None:
            launch_prefill_attention(qkv, k_pool, v_pool, lay.blocks, lay.tables, out,
                                     c.num_heads, c.num_kv_heads, c.head_dim, page, block_m,
                                     tiles)

        try:
            sweep.append((gpu_paths.event_ms(run, reps=10, rounds=3, warmup=2), block_m, tiles))
        except Exception as exc:  # a tile choice past the shared memory or registers
            print(f"# {block_m}/{tiles}: {exc}"[:200], flush=True)
    sweep.sort()
    if sweep:
        print(f"# {shape} {n}: " + ", ".join(f"{b}/{t} {ms:.3f}" for ms, b, t in sweep[:6]),
              flush=True)
    flops = 4 * c.head_dim * c.num_heads * n * (n + 1) / 2
    row: dict = {"shape": shape, "prompt": n, "layers": c.num_layers}
    for name, fn in (("triton_paged", triton_paged), ("flash_gathered", flash_gathered),
                     ("sdpa", sdpa)):
        try:
            got = fn().float()
            ms = gpu_paths.event_ms(fn, reps=20, rounds=3, warmup=3)
        except (RuntimeError, TypeError) as exc:
            print(f"# {shape} {n} {name}: {exc}"[:300], flush=True)
            continue
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9,
                     "rel": float((got - ref).norm() / ref.norm())}
    return row


# (splits, merge) of the --after sweep: merge 0 = the last split merges its block, k > 0 =
# a second launch merges k queries per program
MERGES = [(1, 1), (4, 0), (4, 1), (4, 8), (4, 16), (8, 0), (8, 1), (8, 4), (8, 8), (8, 16),
          (16, 8), (16, 16)]


def after_prefix(shape: str, n: int, prefix: int, page: int) -> None:
    """A pass of `n` queries at positions prefix .. prefix + n - 1: ms per layer by
    (queries per block, tiles, splits), fastest first, and the engine's own choice."""
    c = named_shape(shape)
    dev = torch.device("cuda")
    pages = -(-(prefix + n) // page)
    order = torch.randperm(pages).tolist()
    qkv = torch.randn(n, c.q_dim + 2 * c.kv_dim, device=dev, dtype=torch.bfloat16)
    k_pool = torch.randn((pages + 1) * page, c.kv_dim, device=dev, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    out = torch.empty(n, c.q_dim, device=dev, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    partials = PrefillPartials(c.num_heads, c.head_dim, sms, dev, rows=32 * n)
    stager = PrefillStager(n, 1, pages, page, pages, dev)
    chunk = PrefillChunk([0] * n, prefix, order, 0)
    ref = None
    timings = []
    for block_m in (64,):
        lay = stager.stage([chunk], block_m)
        most = partials.part.shape[0] // n
        for tiles in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2)):
            for splits, merge in MERGES:
                if splits > most:
                    continue

                def run(lay: PrefillLayout = lay, block_m: int = block_m,
                        tiles: Tiles = tiles, splits: int = splits, merge: int = merge) -> None:
                    launch_prefill_attention(qkv, k_pool, v_pool, lay.blocks, lay.tables, out,
                                             c.num_heads, c.num_kv_heads, c.head_dim, page,
                                             block_m, tiles, partials, splits,
                                             self_combine=merge == 0,
                                             combine_tokens=merge or None)

                run()
                got = out.float().clone()
                ref = got if ref is None else ref
                rel = float((got - ref).norm() / ref.norm())
                us = gpu_paths.graph_us(run, reps=28)
                eager = gpu_paths.event_ms(run, reps=20, rounds=3, warmup=2) * 1000
                label = "-" if splits == 1 else "last split" if merge == 0 else \
                    f"launch, {merge} per program"
                timings.append((us, eager, block_m, tiles, splits, label, rel))
    timings.sort()
    own = prefill_splits(n, prefill_block(n), c.num_heads, sms)
    print(f"# {shape}: {n} queries after {prefix} positions; the engine takes block "
          f"{prefill_block(n)}, {own} splits, merged by a second launch, {COMBINE_TOKENS} "
          "queries per program. In a graph: "
          f"{c.num_layers} launches captured as one CUDA graph, as the engine runs them; "
          "eagerly: launched one by one from Python")
    print("| queries per block | tiles (keys, warps, stages) | splits | merged by "
          "| us per layer in a graph | all layers ms | us per layer eagerly | rel to the first "
          "|\n|---:|---|---:|---|---:|---:|---:|---:|")
    for us, eager, block_m, tiles, splits, merge, rel in timings:
        print(f"| {block_m} | {tiles} | {splits} | {merge} | {us:.1f} | "
              f"{us * c.num_layers / 1000:.2f} | {eager:.1f} | {rel:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-sweep", action="store_true", help="leave out the tile sweep")
    ap.add_argument("--after", type=int, default=0,
                    help="cached positions before each prompt (short passes after a prefix)")
    args = ap.parse_args()
    if args.after:
        for s in args.shapes.split(","):
            for n in args.prompts.split(","):
                after_prefix(s, int(n), args.after, args.page_size)
        return
    rows = [bench(s, int(n), args.page_size, not args.no_sweep) for s in args.shapes.split(",")
            for n in args.prompts.split(",")]
    names = ("triton_paged", "flash_gathered", "sdpa")
    print("| shape | prompt | " + " | ".join(f"{k} ms/layer (TFLOP/s, rel)" for k in names)
          + " | Triton, all layers ms |")
    print("|---|---:|" + "---:|" * (len(names) + 1))
    for r in rows:
        cells = [f"{r[k]['ms']:.3f} ({r[k]['tflops']:.0f}, {r[k]['rel']:.1e})" if k in r
                 else "-" for k in names]
        total = f"{r['triton_paged']['ms'] * r['layers']:.1f}" if "triton_paged" in r else "-"
        print(f"| {r['shape']} | {r['prompt']:,} | " + " | ".join(cells) + f" | {total} |")


if __name__ == "__main__":
    main()
