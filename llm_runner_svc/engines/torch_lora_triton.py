"""Triton kernels of LoRA products over stacked adapter buffers.

The adapters sit in stacked buffers (torch_lora.py): A^T [slots + 1, in, R] and B^T
[slots + 1, r, out] per layer and engine matrix, slot 0 all zeros (the base model), and a
row's adapter slot is read from device memory, so one captured decode graph serves any mix
of adapters. Two pairs of kernels, each a shrink (t [n, R] float32, zeroed before, += x @
A^T) then an expand (out += t[:, module's rank columns] @ B^T, each output column taking the
rank columns of the module, q/k/v or gate/up, it belongs to); rows on slot 0 read nothing:
  - per row (BGMV, a decode step of a few rows): each row gathers its own adapter; the
    shrink is split over `in` so one row still spreads over many programs, and can RMS-norm
    its input first (the fused products' normed input is never written out); the fused
    products add the expand themselves (torch_triton_products.py);
  - grouped by adapter (larger batches): the step sorts its rows by slot once
    (`slot_rows`, on the device); then a program per adapter slot, tile and block of 16 of
    that slot's rows reads the slot's tile of A^T or B^T and multiplies it, on the tensor
    cores, with those rows. A step reads each adapter present once per 16 of its rows
    instead of once per row, and no program waits on another (a program past its slot's
    rows exits after reading two numbers). Packing each slot's rows matters when rows of
    many adapters interleave: 32 rows on 8 adapters take 8 blocks, not 16 half-empty ones.
gate/up's expand on the unfused products also applies the SiLU gate and runs down's shrink
over the tile it writes (`expand_gate`, grouped the same way, the base model's rows in slot
0's programs): two launches fewer a layer, and no round trip of the bf16 gate/up output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SHRINK_TILE = 8192  # elements of A^T a shrink program reads: [in positions, R]
EXPAND_BLOCK_N = 128  # output columns per expand program
GATE_BLOCK_N = 64  # per expand_gate program: it holds three adapter tiles and two outputs


@triton.jit
def lora_shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, idx_ptr, t_ptr, t_stride,
                       n_in, norm_ptr, eps, R: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_R: tl.constexpr, HAS_NORM: tl.constexpr):
    """Grid (rows, cdiv(n_in, BLOCK_K)). HAS_NORM: x is the residual stream and the
    product's input its RMSNorm (times the norm weight), as the fused products norm it."""
    row = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rs = tl.arange(0, BLOCK_R)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    k_end = tl.where(slot != 0, n_in, 0)  # a base row reads nothing
    r_end = tl.where(slot != 0, R, 0)
    kmask = ks < k_end
    x_row = x_ptr + row * x_stride
    x = tl.load(x_row + ks, mask=kmask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_row + kk, mask=kk < k_end, other=0.0).to(tl.float32)
            ss += xk * xk
        inv = tl.rsqrt(tl.sum(ss, axis=0) / n_in + eps)
        g = tl.load(norm_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
        x = x * inv * g
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



@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc += a @ b for float32 a: exact float32 products when b is float32 (IEEE), else a
    rounded to b's bf16 (a LoRA term's relative error stays near bf16's 2^-9, on a term
    that is a small part of what it is added to; the unfused products' inputs are bf16
    anyway)."""
    if IEEE:  # noqa: SIM108 (a statement: a constexpr branch, compiled or not)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a.to(b.dtype), b, acc)
    return acc


@triton.jit
def _slot_rows(order_ptr, starts_ptr, slot, BLOCK_M: tl.constexpr):
    """(rows, mine): the rows of `slot` numbered program_id(2) * BLOCK_M and on (each
    slot's rows packed into its blocks: `order` lists the rows by slot, slot s's from
    starts[s] to starts[s + 1]), and which of the BLOCK_M are real."""
    first = tl.load(starts_ptr + slot) + tl.program_id(2) * BLOCK_M
    ks = first + tl.arange(0, BLOCK_M)
    mine = ks < tl.load(starts_ptr + slot + 1)
    rows = tl.load(order_ptr + ks, mask=mine, other=0)
    return rows, mine


@triton.jit
def grouped_shrink_kernel(x_ptr, x_stride, a_ptr, a_slot_stride, order_ptr, starts_ptr, t_ptr,
                          t_stride, n_in, R: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    """Grid (slots, cdiv(n_in, BLOCK_K), cdiv(n_rows, BLOCK_M)): if slot program_id(0) + 1
    has a row block program_id(2), that slot's A^T tile times those rows (masked to the
    real ones), added into t."""
    slot = tl.program_id(0) + 1
    rows, mine = _slot_rows(order_ptr, starts_ptr, slot, BLOCK_M)
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        rs = tl.arange(0, BLOCK_R)
        kmask = ks < n_in
        a = tl.load(a_ptr + slot.to(tl.int64) * a_slot_stride + ks[:, None] * R + rs[None, :],
                    mask=kmask[:, None] & (rs[None, :] < R), other=0.0)  # [BLOCK_K, BLOCK_R]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :],
                    mask=mine[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        part = _dot(x, a, tl.zeros([BLOCK_M, BLOCK_R], tl.float32), IEEE)
        tl.atomic_add(t_ptr + rows[:, None] * t_stride + rs[None, :], part,
                      mask=mine[:, None] & (rs[None, :] < R))


@triton.jit
def grouped_expand_kernel(t_ptr, t_stride, b_ptr, b_slot_stride, order_ptr, starts_ptr, out_ptr,
                          out_stride, n_out, bound1, bound2, r: tl.constexpr,
                          NUM_MODULES: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    """Grid (slots, cdiv(n_out, BLOCK_N), cdiv(n_rows, BLOCK_M)): if slot program_id(0) + 1
    has a row block program_id(2), each module's rank columns of t for those rows times
    the slot's B^T tile of the module's columns, added onto those rows of out (each
    output element has one writer)."""
    slot = tl.program_id(0) + 1
    rows, mine = _slot_rows(order_ptr, starts_ptr, slot, BLOCK_M)
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        js = tl.arange(0, BLOCK_R)
        cmask = cols < n_out
        jmask = js < r
        module = (cols >= bound1).to(tl.int32) + (cols >= bound2).to(tl.int32)  # [BLOCK_N]
        b = tl.load(b_ptr + slot.to(tl.int64) * b_slot_stride + js[:, None] * n_out
                    + cols[None, :], mask=jmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(NUM_MODULES):
            tv = tl.load(t_ptr + rows[:, None] * t_stride + j * r + js[None, :],
                         mask=mine[:, None] & jmask[None, :], other=0.0)
            acc = _dot(tv, tl.where((module == j)[None, :], b, 0.0).to(b.dtype), acc, IEEE)
        offs = rows[:, None].to(tl.int64) * out_stride + cols[None, :]
        omask = mine[:, None] & cmask[None, :]
        o = tl.load(out_ptr + offs, mask=omask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (o + acc).to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def expand_gate_kernel(gu_ptr, gu_stride, t_ptr, t_stride, b_ptr, b_slot_stride, order_ptr,
                       starts_ptr, out_ptr, out_stride, a_ptr, a_slot_stride, t2_ptr, t2_stride,
                       F, r: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    """Grid (slots + 1, cdiv(F, BLOCK_N), cdiv(n_rows, BLOCK_M)): the expand of gate/up,
    the SiLU gate and the shrink of down in one. If slot program_id(0) (0: the base model,
    which reads no adapter) has a row block program_id(2), those rows' terms (t
    times the slot's B^T tiles of gate and of up columns) go onto gate_up [n, 2F] as it is
    loaded, silu(gate) * up is written to out [n, F] (every row by its own slot's program),
    and that tile of out times the slot's down A^T rows of the same columns is added into
    t2 [n, r] (float32; down's K split over the column tiles)."""
    slot = tl.program_id(0)
    rows, mine = _slot_rows(order_ptr, starts_ptr, slot, BLOCK_M)
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        js = tl.arange(0, BLOCK_R)
        cmask = cols < F
        live = js < tl.where(slot != 0, r, 0)  # [BLOCK_R]
        bmask = live[:, None] & cmask[None, :]
        b_tile = (b_ptr + slot.to(tl.int64) * b_slot_stride + js[:, None] * (2 * F)
                  + cols[None, :])
        b_gate = tl.load(b_tile, mask=bmask, other=0.0)  # [BLOCK_R, BLOCK_N]
        b_up = tl.load(b_tile + F, mask=bmask, other=0.0)
        a_down = tl.load(a_ptr + slot.to(tl.int64) * a_slot_stride + cols[:, None] * r
                         + js[None, :], mask=cmask[:, None] & live[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_R]
        tmask = mine[:, None] & live[None, :]
        t_rows = t_ptr + rows[:, None] * t_stride + js[None, :]
        t_gate = tl.load(t_rows, mask=tmask, other=0.0)  # [BLOCK_M, BLOCK_R]
        t_up = tl.load(t_rows + r, mask=tmask, other=0.0)
        omask = mine[:, None] & cmask[None, :]
        gu_rows = gu_ptr + rows[:, None].to(tl.int64) * gu_stride + cols[None, :]
        g = tl.load(gu_rows, mask=omask, other=0.0).to(tl.float32)
        u = tl.load(gu_rows + F, mask=omask, other=0.0).to(tl.float32)
        g = _dot(t_gate, b_gate, g, IEEE)
        u = _dot(t_up, b_up, u, IEEE)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], y,
                 mask=omask)
        part = _dot(y.to(tl.float32), a_down, tl.zeros([BLOCK_M, BLOCK_R], tl.float32), IEEE)
        tl.atomic_add(t2_ptr + rows[:, None] * t2_stride + js[None, :], part, mask=tmask)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, t: torch.Tensor,
           norm: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """t [n, R] float32 += x [n, in] @ a[idx] ([slots + 1, in, R]), per row; with `norm`
    [in], x's rows RMS-normed (epsilon `eps`) and scaled by it first."""
    n, n_in = x.shape
    big_r = a.shape[2]
    block_r = _pow2(big_r)
    block_k = max(64, min(512, SHRINK_TILE // block_r))  # fewer partial sums for small R
    lora_shrink_kernel[(n, triton.cdiv(n_in, block_k))](
        x, x.stride(0), a, a.stride(0), idx, t, t.stride(0), n_in,
        norm if norm is not None else x, eps, R=big_r, BLOCK_K=block_k, BLOCK_R=block_r,
        HAS_NORM=norm is not None, num_warps=4)


def expand(t: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
           bounds: tuple[int, int]) -> None:
    """out [n, out] += t[:, module's rank columns] @ b[idx] ([slots + 1, r, out]) per row;
    output columns from bounds[0] belong to the second module, from bounds[1] the third."""
    n, n_out = out.shape
    r = b.shape[1]
    lora_expand_kernel[(n, triton.cdiv(n_out, EXPAND_BLOCK_N))](
        t, t.stride(0), b, b.stride(0), idx, out, out.stride(0), n_out, bounds[0], bounds[1],
        r=r, BLOCK_R=_pow2(r), BLOCK_N=EXPAND_BLOCK_N, num_warps=4)


GROUP_ROWS = 16  # rows a grouped program multiplies at once (tl.dot's smallest tile)


class SlotRows(NamedTuple):
    """A batch's rows grouped by adapter slot, for the grouped kernels (`slot_rows`)."""
    order: torch.Tensor  # [n] int32: the row numbers by slot, in row order within a slot
    starts: torch.Tensor  # [slots + 2] int32: slot s's rows are order[starts[s]:starts[s + 1]]


def slot_rows(idx: torch.Tensor, slot_ids: torch.Tensor) -> SlotRows:
    """Group the rows of a batch by their adapter slots idx [n] int32; slot_ids: [0, 1,
    ..., slots + 1] int32 on idx's device. No host synchronisation (graph-safe): once per
    step, so no grouped program has to search the batch for its rows."""
    by_slot, order = torch.sort(idx, stable=True)
    return SlotRows(order.to(torch.int32),
                    torch.searchsorted(by_slot, slot_ids, out_int32=True))


def grouped_shrink(x: torch.Tensor, a: torch.Tensor, rows: SlotRows, t: torch.Tensor) -> None:
    """t [n, R] float32 += x [n, in] @ a[slot] ([slots + 1, in, R]) of each row's slot,
    each slot's A^T read once per block of its rows; rows on slot 0 add nothing."""
    n, n_in = x.shape
    big_r = a.shape[2]
    block_r = _pow2(big_r)
    block_k = max(16, min(256, SHRINK_TILE // block_r))
    grid = (a.shape[0] - 1, triton.cdiv(n_in, block_k), triton.cdiv(n, GROUP_ROWS))
    grouped_shrink_kernel[grid](
        x, x.stride(0), a, a.stride(0), rows.order, rows.starts, t, t.stride(0), n_in,
        R=big_r, BLOCK_M=GROUP_ROWS, BLOCK_K=block_k, BLOCK_R=block_r,
        IEEE=a.dtype == torch.float32, num_warps=4)


def grouped_expand(t: torch.Tensor, b: torch.Tensor, rows: SlotRows, out: torch.Tensor,
                   bounds: tuple[int, int], num_modules: int) -> None:
    """`expand` with each slot's B^T read once for all its rows."""
    n, n_out = out.shape
    r = b.shape[1]
    grid = (b.shape[0] - 1, triton.cdiv(n_out, EXPAND_BLOCK_N), triton.cdiv(n, GROUP_ROWS))
    grouped_expand_kernel[grid](
        t, t.stride(0), b, b.stride(0), rows.order, rows.starts, out, out.stride(0), n_out,
        bounds[0], bounds[1], r=r, NUM_MODULES=num_modules, BLOCK_M=GROUP_ROWS,
        BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=_pow2(r), IEEE=b.dtype == torch.float32,
        num_warps=4)


def expand_gate(t: torch.Tensor, b: torch.Tensor, rows: SlotRows, gate_up: torch.Tensor,
                out: torch.Tensor, a_down: torch.Tensor, t_down: torch.Tensor) -> None:
    """out [n, F] = silu(g) * u where [g | u] = gate_up [n, 2F] + t @ b[slot] (the gate
    and up modules' rank columns of t [n, 2 r] onto their columns), in float32; and
    t_down [n, r] += out @ a_down[slot] ([slots + 1, F, r]): down's shrink."""
    n, f = out.shape
    r = b.shape[1]
    assert a_down.shape[2] == r
    grid = (b.shape[0], triton.cdiv(f, GATE_BLOCK_N), triton.cdiv(n, GROUP_ROWS))
    expand_gate_kernel[grid](
        gate_up, gate_up.stride(0), t, t.stride(0), b, b.stride(0), rows.order, rows.starts,
        out, out.stride(0), a_down, a_down.stride(0), t_down, t_down.stride(0), f, r=r,
        BLOCK_M=GROUP_ROWS, BLOCK_N=GATE_BLOCK_N, BLOCK_R=_pow2(r),
        IEEE=b.dtype == torch.float32, num_warps=4)

