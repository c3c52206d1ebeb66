"""What a fused product does around `A @ W.T` (the MODE of the kernels in
torch_triton_products.py and torch_triton_short.py), and the short products' measured
tilings; apart so that the forward and the engine can name them without importing Triton
(the CPU engine never does)."""

from __future__ import annotations

import json
from typing import NamedTuple

STORE = 0  # out = A @ W.T (+ bias)
ACCUMULATE = 1  # out += A @ W.T (the residual stream)
SILU_GATE = 2  # W = [gate; up]: out = silu(A @ gate.T) * (A @ up.T)


class Tiling(NamedTuple):
    """How `short_kernel` (torch_triton_short.py) tiles one product."""

    bn: int  # weight rows (output columns) a program
    bk: int  # K positions a step
    split_k: int  # programs sharing a tile's K range
    warps: int
    stages: int
    evict: int = 0  # 1: the weight loads ask L2 to drop them first


# A product: (output columns n, k, mode, whether the RMSNorm runs inside it)
Shape = tuple[int, int, int, bool]

# The short products that beat cuBLAS with their small kernels, as measured
# (bench_short_products.py, 50 rows, each side in a CUDA graph over the 28 layers' weights,
# H100 80GB HBM3, 2026-12-06): the 7B shape's gate/up on rows the norm kernel normed, the
# SiLU gate inside, 103.5 us a layer against 107.3 for cuBLAS and the SiLU kernel. Its q/k/v
# (18.8 against 16.5), o (13.7 / 12.1) and down (54.1 / 54.6) stay on cuBLAS.
SHORT_TILINGS: dict[Shape, Tiling] = {(18944, 3584, SILU_GATE, False): Tiling(64, 128, 1, 4, 4)}


def load_tilings(text: str) -> dict[Shape, Tiling]:
    """Tilings as `bench_short_products.py --write` leaves them (JSON)."""
    rows = json.loads(text)["tilings"]
    return {(int(r[0]), int(r[1]), int(r[2]), bool(r[3])): Tiling(*map(int, r[4:]))
            for r in rows}
