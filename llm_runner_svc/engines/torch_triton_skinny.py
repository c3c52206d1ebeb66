"""Products of a short prefill window (imported only on CUDA): `a @ w.T` for a few dozen
activation rows against a layer's whole weight matrix, the case of a reusing request's new
tokens after a long cached prompt.

Such a product reads every weight once and does little else, so its time is the weights'
bytes over the memory bandwidth, if every multiprocessor streams. With 64 rows, a narrow
matrix (q/k/v, o and down of a 7B model: 3,584 to 4,608 output columns) splits into too few
column tiles to keep 132 multiprocessors busy, and cuBLAS reads them at 2.6-3.4 TB/s. Here
each tile's K range is split as well (SPLIT_K programs a tile, enough for two programs a
multiprocessor); each leaves its float32 partial in `part`, counts itself in, and the last to
finish sums the partials in split order (the same sum every run) and writes the tile: the
output (bf16 or float32, plus the bias) or, accumulating, onto a float32 residual. The
counts are zero again after every launch, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from llm_runner_svc.models.spec import ModelConfig

MAX_ROWS = 64  # the most activation rows a product here takes (one row tile)
MAX_SPLIT = 16


@triton.jit
def _write(acc, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride, HAS_BIAS: tl.constexpr,
           ACCUMULATE: tl.constexpr):
    out_off = rm[:, None] * out_stride + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if ACCUMULATE:
        acc += tl.load(out_ptr + out_off, mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def skinny_kernel(a_ptr, a_stride, w_ptr, bias_ptr, out_ptr, out_stride, part_ptr, count_ptr,
                  M, N, K, k_per_split, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    """Grid (cdiv(N, BN), SPLIT_K): program (t, s) multiplies rows 0..M-1 of a [M, K] by
    weight rows t BN .. of w [N, K] over K positions s k_per_split .. (a multiple of BK).
    `part` [SPLIT_K, BM, N] float32 and `count` [cdiv(N, BN)] int32 serve SPLIT_K > 1."""
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
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        kmask = kk < k_hi
        a = tl.load(a_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    if SPLIT_K == 1:
        _write(acc, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride, HAS_BIAS, ACCUMULATE)
    else:
        p_off = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + split * BM * N + p_off, acc, mask=nmask[None, :])
        tl.debug_barrier()  # every thread's partial is written before the count
        counter = count_ptr + tile
        if tl.atomic_add(counter, 1) == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BM, BN], tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * BM * N + p_off, mask=nmask[None, :],
                                 other=0.0, cache_modifier=".cg")
            _write(total, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride, HAS_BIAS,
                   ACCUMULATE)
            tl.atomic_xchg(counter, 0)


def layer_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """(output columns, K) of a decoder layer's products: q/k/v, o, gate/up, down."""
    return [(c.q_dim + 2 * c.kv_dim, c.hidden_size), (c.hidden_size, c.q_dim),
            (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]


class Tiling(NamedTuple):
    bn: int  # weight rows (output columns) a program
    bk: int  # K positions a step
    split_k: int  # programs sharing a tile's K range
    warps: int
    stages: int


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def tiling(n: int, k: int, num_sms: int) -> Tiling:
    """The tiling of a product with n output columns over k: 128 columns a program (64 for
    a matrix too narrow for one 128-column tile a multiprocessor), 128 positions a step, and
    the K range split until there are two programs a multiprocessor, each keeping at least
    four steps."""
    bn = 128 if n >= 128 * num_sms // 2 else 64
    tiles = -(-n // bn)
    split = min(MAX_SPLIT, _pow2_floor(2 * num_sms // tiles), _pow2_floor(k // (4 * 128)))
    return Tiling(bn, 128, max(1, split), 4, 4)


class SkinnyProducts:
    """Launches of `skinny_kernel` with their partials and counts claimed once (`reserve`)
    for the widest matrix that splits."""

    def __init__(self, num_sms: int) -> None:
        self.num_sms = num_sms
        self.widest = 0  # the most output columns a split product may have
        self._part: torch.Tensor | None = None
        self._count: torch.Tensor | None = None

    def reserve(self, shapes: list[tuple[int, int]], device: torch.device) -> int:
        """Claim partials for products of the (n, k) `shapes` (any split of the widest one
        `tiling` splits, up to MAX_SPLIT); returns their bytes."""
        self.widest = max([n for n, k in shapes if tiling(n, k, self.num_sms).split_k > 1]
                          or [0])
        tiles = max([-(-n // 64) for n, _ in shapes] or [1])
        self._part = torch.empty((max(self.widest * MAX_SPLIT * MAX_ROWS, 1),),
                                 dtype=torch.float32, device=device)
        self._count = torch.zeros((tiles,), dtype=torch.int32, device=device)
        return int(self._part.nbytes + self._count.nbytes)

    def product(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                bias: torch.Tensor | None = None, accumulate: bool = False,
                tiles: Tiling | None = None) -> bool:
        """out = a @ w.T (+ bias), or out += a @ w.T with `accumulate`, for a [m, k] with
        m <= MAX_ROWS; False (nothing launched) for a product this does not take."""
        m, k = a.shape
        n = w.shape[0]
        if m > MAX_ROWS or a.dtype != w.dtype or self._part is None or self._count is None:
            return False
        t = tiles or tiling(n, k, self.num_sms)
        if t.split_k > 1 and (n > self.widest or t.split_k > MAX_SPLIT
                              or -(-n // t.bn) > self._count.numel()):
            return False
        per_split = -(-k // (t.split_k * t.bk)) * t.bk
        skinny_kernel[(triton.cdiv(n, t.bn), t.split_k)](
            a, a.stride(0), w, bias if bias is not None else w, out, out.stride(0),
            self._part, self._count, m, n, k, per_split, HAS_BIAS=bias is not None,
            ACCUMULATE=accumulate, BM=MAX_ROWS, BN=t.bn, BK=t.bk, SPLIT_K=t.split_k,
            num_warps=t.warps, num_stages=t.stages)
        return True
