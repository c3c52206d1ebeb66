"""Triton kernels of per-row LoRA products (BGMV: each row gathers its own adapter).

The adapters sit in stacked buffers (torch_lora.py): A^T [slots + 1, in, R] and B^T
[slots + 1, r, out] per layer and engine matrix, slot 0 all zeros (the base model), and a
row's adapter slot is read from device memory, so one captured decode graph serves any mix
of adapters. `shrink` adds x[row] @ A^T[slot] into t[row] ([n, R] float32, zeroed before),
split over `in` so a decode batch of one row still spreads over many programs; `expand` adds
t[row, module's rank columns] @ B^T[slot] onto out[row], each output column taking the rank
columns of the module (q/k/v, gate/up) it belongs to. Rows on slot 0 read nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SHRINK_TILE = 8192  # elements of A^T a shrink program reads: [in positions, R]
EXPAND_BLOCK_N = 128  # output columns per expand program


@triton.jit
def lora_shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, idx_ptr, t_ptr, t_stride,
                       n_in, R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_R)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    k_end = tl.where(slot != 0, n_in, 0)  # a base row reads nothing
    r_end = tl.where(slot != 0, R, 0)
    kmask = ks < k_end
    x = tl.load(x_ptr + row * x_stride + ks, mask=kmask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + slot * a_slot_stride + ks[:, None] * R + rs[None, :],
                mask=kmask[:, None] & (rs[None, :] < R), other=0.0).to(tl.float32)
    part = tl.sum(x[:, None] * a, axis=0)  # [BLOCK_R]
    tl.atomic_add(t_ptr + row * t_stride + rs, part, mask=rs < r_end)


@triton.jit
def lora_expand_kernel(t_ptr, t_stride, b_ptr, b_slot_stride, idx_ptr, out_ptr, out_stride,
                       n_out, bound1, bound2, r: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    js = tl.arange(0, BLOCK_R)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    cmask = cols < tl.where(slot != 0, n_out, 0)  # a base row reads and writes nothing
    module = (cols >= bound1).to(tl.int32) + (cols >= bound2).to(tl.int32)  # [BLOCK_N]
    mask = (js[:, None] < r) & cmask[None, :]
    tv = tl.load(t_ptr + row * t_stride + module[None, :] * r + js[:, None], mask=mask,
                 other=0.0)  # [BLOCK_R, BLOCK_N] float32
    b = tl.load(b_ptr + slot * b_slot_stride + js[:, None] * n_out + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    delta = tl.sum(tv * b, axis=0)
    o = tl.load(out_ptr + row * out_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (o + delta).to(out_ptr.dtype.element_ty),
             mask=cmask)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, t: torch.Tensor) -> None:
    """t [n, R] float32 += x [n, in] @ a[idx] ([slots + 1, in, R]), per row."""
    n, n_in = x.shape
    big_r = a.shape[2]
    block_r = _pow2(big_r)
    block_k = max(64, min(512, SHRINK_TILE // block_r))  # fewer partial sums for small R
    lora_shrink_kernel[(n, triton.cdiv(n_in, block_k))](
        x, x.stride(0), a, a.stride(0), idx, t, t.stride(0), n_in, R=big_r,
        BLOCK_K=block_k, BLOCK_R=block_r, num_warps=4)


def expand(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
           bounds: tuple[int, int]) -> None:
    """out [n, out] += t[:, module's rank columns] @ b[idx] ([slots + 1, r, out]) per row;
    output columns from bounds[0] belong to the second module, from bounds[1] the third."""
    n, n_out = out.shape
    r = b.shape[1]
    lora_expand_kernel[(n, triton.cdiv(n_out, EXPAND_BLOCK_N))](
        t, t.stride(0), b, b.stride(0), idx, out, out.stride(0), n_out, bounds[0], bounds[1],
        r=r, BLOCK_R=_pow2(r), BLOCK_N=EXPAND_BLOCK_N, num_warps=4)
