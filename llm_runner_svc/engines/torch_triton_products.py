"""Fused matrix products of the bf16 GPU forward (imported only on CUDA).

One kernel computes `A @ W.T` for float32 activations A [m, k] and bf16 weights W [n, k]
with what surrounds the product in a decoder layer fused around it:

- prologue: the RMSNorm of A's rows (their inverse RMS first, over the whole row, then each
  tile scaled by it and by the norm weight as it is loaded), so the normed input is never
  written out;
- epilogue: the bias; or accumulation into the output (the residual stream, `x += A @ W.T`);
  or the SiLU gate (W holds gate rows then up rows, and each program computes both halves of
  its columns, writing `silu(gate) * up`); in a decode step's few-row kernel, each row's
  LoRA term first, when its rows carry adapters (`_lora_delta`; torch_lora.py).

The activations are never rounded to bf16. A decode step's few rows (`gemv_kernel`) are
multiplied on the CUDA cores in float32 with the weights widened as they stream in: the
step reads the weights once, which is all its time, and the products are exact. Prefill
windows (`product_kernel`) use the tensor cores, each activation tile split into a bf16 high
part and a bf16 remainder, both multiplied and summed in float32, so about 16 of float32's
24 mantissa bits survive (against bf16's 8).
A decoder layer is then four launches beside attention, instead of four products and four
elementwise kernels, and its states keep float32 precision apart from the weights and KV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_runner_svc.engines.torch_lora import LoraTerm
from llm_runner_svc.engines.torch_triton_modes import ACCUMULATE, SILU_GATE, STORE

_ACCUMULATE = tl.constexpr(ACCUMULATE)  # the same, as the kernel sees them
_SILU_GATE = tl.constexpr(SILU_GATE)


@triton.jit
def _split_dot(a, w, acc):
    """acc += a @ w with a float32 [BM, BK] split into two bf16 parts; w bf16 [BK, BN]."""
    a_hi = a.to(tl.bfloat16)
    a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(a_hi, w, acc)
    return tl.dot(a_lo, w, acc)


@triton.jit
def _inv_rms(a_rows, mmask, K, eps, BM: tl.constexpr, BK: tl.constexpr):
    """1 / RMS of each activation row ([BM, 1] row pointers), over the whole row."""
    rk = tl.arange(0, BK)
    ss = tl.zeros([BM], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_rows + kk[None, :], mask=mmask[:, None] & (kk < K)[None, :], other=0.0)
        ss += tl.sum(a * a, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _activations(a_rows, kk, kmask, mmask, norm_ptr, inv, HAS_NORM: tl.constexpr):
    """The [BM, BK] activation tile at columns kk, normed when HAS_NORM."""
    a = tl.load(a_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
    if HAS_NORM:
        g = tl.load(norm_ptr + kk, mask=kmask, other=0.0)
        a = a * inv[:, None] * g[None, :]
    return a


@triton.jit
def _finish(y, up, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride,
            HAS_BIAS: tl.constexpr, MODE: tl.constexpr):
    """The epilogue of both kernels on a [BM, BN] product `y` (and `up`, for SILU_GATE)."""
    out_off = rm[:, None].to(tl.int64) * out_stride + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if MODE == _SILU_GATE:
        y = y / (1.0 + tl.exp(-y)) * up
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if MODE == _ACCUMULATE:
        y += tl.load(out_ptr + out_off, mask=omask, other=0.0)
    tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _lora_delta(t_ptr, t_stride, lb_ptr, lb_slot_stride, idx_ptr, rm, mmask, cols, nmask,
                lb_cols, bound1, bound2, LORA_R: tl.constexpr, LORA_BR: tl.constexpr):
    """The LoRA term of a [BM, BN] product tile: for row m on adapter slot s (idx[m]; 0, the
    base model, reads nothing) and output column c of module j (c from bound1: j = 1, from
    bound2: j = 2), sum over i < LORA_R of t[m, j LORA_R + i] * B^T[s, i, c]; t [rows, M r]
    float32 (the shrink's x @ A^T), B^T [slots + 1, r, lb_cols] (torch_lora.py)."""
    slot = tl.load(idx_ptr + rm, mask=mmask, other=0).to(tl.int64)  # [BM]
    js = tl.arange(0, LORA_BR)
    module = (cols >= bound1).to(tl.int32) + (cols >= bound2).to(tl.int32)  # [BN]
    live = ((slot != 0)[:, None, None] & (js < LORA_R)[None, :, None]
            & nmask[None, None, :])  # [BM, LORA_BR, BN]
    tv = tl.load(t_ptr + rm[:, None, None].to(tl.int64) * t_stride
                 + module[None, None, :] * LORA_R + js[None, :, None], mask=live, other=0.0)
    b = tl.load(lb_ptr + slot[:, None, None] * lb_slot_stride + js[None, :, None] * lb_cols
                + cols[None, None, :], mask=live, other=0.0).to(tl.float32)
    return tl.sum(tv * b, axis=1)


@triton.jit
def product_kernel(a_ptr, a_stride, w_ptr, bias_ptr, norm_ptr, out_ptr, out_stride, M, N, K,
                   eps, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (cdiv(M, BM), cdiv(N, BN)); MODE is STORE, ACCUMULATE or SILU_GATE (then W has
    2 N rows and the output N columns)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * a_stride
    w_cols = w_ptr + rn[None, :].to(tl.int64) * K  # W [n, k] read as [BK, BN] tiles
    if HAS_NORM:  # noqa: SIM108 (a statement: a constexpr branch, compiled or not)
        inv = _inv_rms(a_rows, mmask, K, eps, BM, BK)
    else:
        inv = tl.full([BM], 1.0, tl.float32)
    acc = tl.zeros([BM, BN], tl.float32)
    acc_up = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        kmask = kk < K
        a = _activations(a_rows, kk, kmask, mmask, norm_ptr, inv, HAS_NORM)
        wmask = kmask[:, None] & nmask[None, :]
        w = tl.load(w_cols + kk[:, None], mask=wmask, other=0.0)
        acc = _split_dot(a, w, acc)
        if MODE == _SILU_GATE:
            w_up = tl.load(w_cols + N * K + kk[:, None], mask=wmask, other=0.0)
            acc_up = _split_dot(a, w_up, acc_up)
    _finish(acc, acc_up, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride, HAS_BIAS, MODE)


@triton.jit
def gemv_kernel(a_ptr, a_stride, w_ptr, bias_ptr, norm_ptr, out_ptr, out_stride, M, N, K, eps,
                t_ptr, t_stride, lb_ptr, lb_slot_stride, idx_ptr, lb_cols, bound1, bound2,
                HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr,
                HAS_LORA: tl.constexpr, LORA_R: tl.constexpr, LORA_BR: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """`product_kernel` for a decode step's few rows (M <= BM), on the CUDA cores: grid
    (cdiv(N, BN),). Each program streams BN weight rows along K in coalesced [BN, BK] tiles,
    widens them to float32 and multiplies them with every activation row exactly (float32
    products and sums), reducing across K once at the end. HAS_LORA: each row's LoRA term
    (`_lora_delta`) is added to the product before the epilogue (to both the gate and the
    up half, for SILU_GATE: before the SiLU)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    mmask = rm < M
    nmask = rn < N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * a_stride  # [BM, 1]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K  # [BN, 1]
    if HAS_NORM:  # noqa: SIM108 (a statement: a constexpr branch, compiled or not)
        inv = _inv_rms(a_rows, mmask, K, eps, BM, BK)
    else:
        inv = tl.full([BM], 1.0, tl.float32)
    acc = tl.zeros([BM, BN, BK], tl.float32)
    acc_up = tl.zeros([BM, BN, BK], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        kmask = kk < K
        a = _activations(a_rows, kk, kmask, mmask, norm_ptr, inv, HAS_NORM)
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=wmask, other=0.0).to(tl.float32)
        acc += a[:, None, :] * w[None, :, :]
        if MODE == _SILU_GATE:
            w_up = tl.load(w_rows + N * K + kk[None, :], mask=wmask, other=0.0)
            acc_up += a[:, None, :] * w_up.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    up = tl.sum(acc_up, axis=2)
    if HAS_LORA:
        y += _lora_delta(t_ptr, t_stride, lb_ptr, lb_slot_stride, idx_ptr, rm, mmask, rn,
                         nmask, lb_cols, bound1, bound2, LORA_R, LORA_BR)
        if MODE == _SILU_GATE:
            up += _lora_delta(t_ptr, t_stride, lb_ptr, lb_slot_stride, idx_ptr, rm, mmask,
                              N + rn, nmask, lb_cols, bound1, bound2, LORA_R, LORA_BR)
    _finish(y, up, rm, rn, mmask, nmask, bias_ptr, out_ptr, out_stride, HAS_BIAS, MODE)


GEMV_ROWS = 4  # the most rows gemv_kernel takes; more go to product_kernel
_GEMV_ELEMENTS = 8192  # BM * BN * BK of one float32 accumulator: 64 registers a thread


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def gemv_tiles(m: int, n: int, k: int, mode: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps) of gemv_kernel. Measured on the H200 (bench_products.py):
    four weight rows a program and K tiles as deep as the registers allow stream a layer's
    matrices fastest (a gate program holds two accumulators: half as deep); a vocabulary
    head (tens of thousands of rows) prefers 16 rows by 256."""
    bm = _pow2(m)
    if n >= 32768:
        bn, deepest = 16, 256
    else:
        bn, deepest = 4, 512 if mode == SILU_GATE else 1024
    bk = max(64, min(deepest, _pow2(k), _GEMV_ELEMENTS // (bm * bn)))
    return bm, bn, bk, 4


# The largest weights (bytes) gemv_kernel reads faster at batch 1 than cuBLAS plus the norm
# and SiLU launches it saves (H200, bench_products.py per matrix; for gate/up the whole step:
# the 1.5B shape's 55 MB gate/up on cuBLAS took its step from 1.63 to 1.52 ms): past these
# sizes one cuBLAS product streams enough faster to outweigh two or three small launches.
GEMV_LIMITS = {STORE: 64 << 20, ACCUMULATE: 160 << 20, SILU_GATE: 32 << 20}


def tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) of product_kernel (prefill windows)."""
    bk = min(64, max(16, _pow2(k)))
    return 64, 64, bk, 4, 3


class FusedProducts:
    """The launches; `eps` is the model's RMSNorm epsilon."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    @staticmethod
    def outruns_cublas(w: torch.Tensor, mode: int) -> bool:
        """Whether a decode step's product with `w` in `mode` is faster fused."""
        return w.numel() * w.element_size() <= GEMV_LIMITS[mode]

    def _launch(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, n: int,
                mode: int, norm: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, lora: LoraTerm | None = None) -> None:
        m, k = a.shape
        if m <= GEMV_ROWS:
            bm, bn, bk, warps = gemv_tiles(m, n, k, mode)
            t, lb, idx = (lora.t, lora.b, lora.idx) if lora is not None else (a, w, a)
            bounds, rank = (lora.bounds, lora.rank) if lora is not None else ((0, 0), 1)
            gemv_kernel[(triton.cdiv(n, bn),)](
                a, a.stride(0), w, bias if bias is not None else w,
                norm if norm is not None else a, out, out.stride(0), m, n, k, self.eps,
                t, t.stride(0), lb, lb.stride(0), idx, lb.shape[-1], bounds[0], bounds[1],
                HAS_NORM=norm is not None, HAS_BIAS=bias is not None, MODE=mode,
                HAS_LORA=lora is not None, LORA_R=rank, LORA_BR=_pow2(rank), BM=bm,
                BN=bn, BK=bk, num_warps=warps)
            return
        assert lora is None, "LoRA terms ride on the few-row products only"
        bm, bn, bk, warps, stages = tiles(m, n, k)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        product_kernel[grid](
            a, a.stride(0), w, bias if bias is not None else w,
            norm if norm is not None else a, out, out.stride(0), m, n, k, self.eps,
            HAS_NORM=norm is not None, HAS_BIAS=bias is not None, MODE=mode, BM=bm, BN=bn,
            BK=bk, num_warps=warps, num_stages=stages)

    def norm_product(self, x: torch.Tensor, norm: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor,
                     lora: LoraTerm | None = None) -> None:
        """out = rms_norm(x) * norm @ w.T (+ bias) (+ each row's LoRA term, `lora`: x's
        rows already shrunk, normed, by `TorchLora.shrink_rows`)."""
        self._launch(x, w, out, w.shape[0], STORE, norm, bias, lora)

    def norm_gate(self, x: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor,
                  out: torch.Tensor, lora: LoraTerm | None = None) -> None:
        """out = silu(g) * u where [g | u] = rms_norm(x) * norm @ gate_up.T (+ each row's
        LoRA term on g and u)."""
        self._launch(x, gate_up, out, gate_up.shape[0] // 2, SILU_GATE, norm, lora=lora)

    def accumulate(self, a: torch.Tensor, w: torch.Tensor, x: torch.Tensor,
                   lora: LoraTerm | None = None) -> None:
        """x += a @ w.T (+ each row's LoRA term)"""
        self._launch(a, w, x, w.shape[0], ACCUMULATE, lora=lora)
