"""Products of a short bf16 prefill pass, with the layer's small steps folded into them
(imported only on CUDA).

A pass of a few dozen tokens (a reusing request's new turn after its cached prompt) reads
every weight once and does little else: each product is the weights' bytes over the memory
bandwidth plus its launch's ramp and tail. On cuBLAS a decoder layer takes eleven launches,
four of them products and the rest small: two RMSNorms, the SiLU gate, the split-K
reduction of down, besides RoPE and attention. `short_kernel` does one product with some of
those steps inside it:

- the RMSNorm of float32 residual rows as they load (each activation tile scaled by the norm
  weight and rounded to bf16 for the tensor cores, its squares summed on the way, the
  product scaled by each row's inverse RMS at the end: the norm is linear in the row), or
  rows some other launch normed;
- the SiLU gate (both halves of its columns, writing `silu(gate) * up`), the bias, or the
  sum onto the float32 residual.

A narrow matrix (q/k/v, o, down of a 7B model: 3,584 to 4,608 columns) has too few column
tiles for every multiprocessor, and a wide one's tiles may leave the last wave of programs
mostly idle, so the K range may be split over SPLIT_K programs a tile; each leaves its
float32 partial (both halves' for the SiLU gate, and its rows' partial sums of squares) in
the partials, counts itself in, and the last of a tile's programs sums them in split order
(the same sum every run) and finishes the tile. The counts are zero again after every
launch, so a CUDA graph can hold the launches. The weights are read once a pass; with
EVICT_W their loads ask L2 to drop them first, keeping the rows every program rereads.

Whether a product takes this kernel, and with which tiling, is measured per shape
(`benchmarks/bench_short_products.py`, each side in a CUDA graph over every layer's
weights): a product runs here only where a measured tiling beat cuBLAS with its small
kernels. (On an H100 at the 7B shape, the norm inside the product made q/k/v 2.2x and
gate/up 1.5x slower than cuBLAS: every program reads the float32 rows, twice the bytes of
bf16 ones, beside its weights.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from llm_runner_svc.engines.torch_triton_modes import (
    ACCUMULATE,
    SILU_GATE,
    STORE,
    Shape,
    Tiling,
)
from llm_runner_svc.engines.torch_triton_products import _finish

_SILU_GATE = tl.constexpr(SILU_GATE)
MAX_ROWS = 64  # the most rows a short product takes (one row tile)


@triton.jit
def _weights(ptrs, kmask, nmask, EVICT_W: tl.constexpr):
    """A [BK, BN] tile of weights (read once a pass)."""
    mask = kmask[:, None] & nmask[None, :]
    if EVICT_W:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def short_kernel(a_ptr, a_stride, w_ptr, bias_ptr, norm_ptr, out_ptr, out_stride, part_ptr,
                 ss_ptr, count_ptr, M, N, K, k_per_split, eps, HAS_NORM: tl.constexpr,
                 HAS_BIAS: tl.constexpr, MODE: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVICT_W: tl.constexpr):
    """Grid (cdiv(N, BN), SPLIT_K): program (t, s) multiplies rows 0..M-1 of a [M, K] by
    weight rows t BN .. t BN + BN - 1 of w [N, K] (for SILU_GATE w has 2 N rows, gate then
    up) over K positions s k_per_split .. (a multiple of BK). HAS_NORM: a is the float32
    residual, RMSNormed by `norm` on the way (see the module docstring). MODE: STORE,
    ACCUMULATE or SILU_GATE. With SPLIT_K > 1: `part` [halves, SPLIT_K, BM, N] (halves 2 for
    SILU_GATE, else 1) and `ss` [SPLIT_K, tiles, BM] float32, `count` [tiles] int32, zero
    between launches."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = tile * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * a_stride
    w_cols = w_ptr + rn[None, :].to(tl.int64) * K  # w read as [BK, BN] tiles
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        kmask = kk < k_hi
        a = tl.load(a_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if HAS_NORM:
            a = a.to(tl.float32)
            ss += tl.sum(a * a, axis=1)
            a = a * tl.load(norm_ptr + kk, mask=kmask, other=0.0)[None, :]
        a = a.to(w_ptr.dtype.element_ty)
        acc = tl.dot(a, _weights(w_cols + kk[:, None], kmask, nmask, EVICT_W), acc)
        if MODE == _SILU_GATE:
            acc_up = tl.dot(a, _weights(w_cols + N * K + kk[:, None], kmask, nmask, EVICT_W),
                            acc_up)
    if SPLIT_K == 1:
        if HAS_NORM:
            inv = tl.rsqrt(ss / K + eps)[:, None]
            acc = acc * inv
            acc_up = acc_up * inv
        _finish(acc, acc_up, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride, HAS_BIAS,
                MODE)
    else:
        tiles = tl.num_programs(0)
        p_off = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + split * BM * N + p_off, acc, mask=nmask[None, :])
        if MODE == _SILU_GATE:
            tl.store(part_ptr + (SPLIT_K + split) * BM * N + p_off, acc_up,
                     mask=nmask[None, :])
        if HAS_NORM:
            tl.store(ss_ptr + (split * tiles + tile) * BM + rm, ss)
        tl.debug_barrier()  # every thread's partial is written before the count
        counter = count_ptr + tile
        if tl.atomic_add(counter, 1) == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BM, BN], tl.float32)
            total_up = tl.zeros([BM, BN], tl.float32)
            ss_all = tl.zeros([BM], tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * BM * N + p_off, mask=nmask[None, :],
                                 other=0.0, cache_modifier=".cg")
                if MODE == _SILU_GATE:
                    total_up += tl.load(part_ptr + (SPLIT_K + s) * BM * N + p_off,
                                        mask=nmask[None, :], other=0.0, cache_modifier=".cg")
                if HAS_NORM:
                    ss_all += tl.load(ss_ptr + (s * tiles + tile) * BM + rm,
                                      cache_modifier=".cg")
            if HAS_NORM:
                inv = tl.rsqrt(ss_all / K + eps)[:, None]
                total = total * inv
                total_up = total_up * inv
            _finish(total, total_up, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride,
                    HAS_BIAS, MODE)
            tl.atomic_xchg(counter, 0)


class ShortProducts:
    """Launches of `short_kernel` for the products it holds a tiling for (`tilings`, as
    measured: bench_short_products.py writes the fastest of each shape where it beats
    cuBLAS), their partials claimed once (`reserve`) before any capture. Each call returns
    False, launching nothing, for a product without a tiling: the caller multiplies it on
    cuBLAS."""

    def __init__(self, eps: float, tilings: Mapping[Shape, Tiling]) -> None:
        self.eps = eps
        self.tilings = dict(tilings)
        for (n, k, _, _), t in self.tilings.items():
            if min(t[:4]) < 1 or t.stages < 1 or t.bn & (t.bn - 1) or t.bk & (t.bk - 1):
                raise ValueError(f"tiling {tuple(t)} of the product ({n}, {k}): bn and bk "
                                 "powers of two, split_k, warps and stages at least 1")
        self._part: torch.Tensor | None = None
        self._ss: torch.Tensor | None = None
        self._count: torch.Tensor | None = None

    def reserve(self, device: torch.device) -> int:
        """Claim the partials of every tiled product; returns their bytes."""
        part = ss = count = 1
        for (n, _, mode, _), t in self.tilings.items():
            tiles = -(-n // t.bn)
            count = max(count, tiles)
            if t.split_k > 1:
                halves = 2 if mode == SILU_GATE else 1
                part = max(part, halves * t.split_k * MAX_ROWS * n)
                ss = max(ss, t.split_k * tiles * MAX_ROWS)
        self._part = torch.empty(part, dtype=torch.float32, device=device)
        self._ss = torch.empty(ss, dtype=torch.float32, device=device)
        self._count = torch.zeros(count, dtype=torch.int32, device=device)
        return int(self._part.nbytes + self._ss.nbytes + self._count.nbytes)

    def _launch(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n: int, mode: int,
                norm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> bool:
        m, k = a.shape
        t = self.tilings.get((n, k, mode, norm is not None))
        if t is None or m > MAX_ROWS:
            return False
        part, ss, count = self._part, self._ss, self._count
        assert part is not None and ss is not None and count is not None, "reserve() first"
        per_split = -(-k // (t.split_k * t.bk)) * t.bk
        short_kernel[(-(-n // t.bn), t.split_k)](
            a, a.stride(0), w, bias if bias is not None else w, norm if norm is not None else a,
            out, out.stride(0), part, ss, count, m, n, k, per_split, self.eps,
            HAS_NORM=norm is not None, HAS_BIAS=bias is not None, MODE=mode,
            BM=max(16, 1 << (m - 1).bit_length()), BN=t.bn, BK=t.bk, SPLIT_K=t.split_k,
            EVICT_W=bool(t.evict), num_warps=t.warps, num_stages=t.stages)
        return True

    def norm_product(self, x: torch.Tensor, norm: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor) -> bool:
        """out = rms_norm(x) * norm @ w.T (+ bias); x [m, k] float32."""
        return self._launch(x, w, out, w.shape[0], STORE, norm, bias)

    def product(self, h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor) -> bool:
        """out = h @ w.T (+ bias)"""
        return self._launch(h, w, out, w.shape[0], STORE, bias=bias)

    def norm_gate(self, x: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor,
                  out: torch.Tensor) -> bool:
        """out = silu(g) * u where [g | u] = rms_norm(x) * norm @ gate_up.T"""
        return self._launch(x, gate_up, out, gate_up.shape[0] // 2, SILU_GATE, norm)

    def gate(self, h: torch.Tensor, gate_up: torch.Tensor, out: torch.Tensor) -> bool:
        """out = silu(g) * u where [g | u] = h @ gate_up.T"""
        return self._launch(h, gate_up, out, gate_up.shape[0] // 2, SILU_GATE)

    def accumulate(self, a: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> bool:
        """x += a @ w.T; x float32."""
        return self._launch(a, w, x, w.shape[0], ACCUMULATE)
