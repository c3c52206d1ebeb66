"""Causal attention of a prefill batch over the paged KV pool (imported only on CUDA).

One launch covers every chunk of a `PrefillLayout`, whatever their lengths and starts: a
program takes one query head of one block of a chunk's queries (the layout's blocks, longest
attention first) and streams that chunk's keys and values straight from its pages, FlashAttention
style (online softmax, one pass, nothing of size [queries, keys] written out). Keys below
the block's first position are visible to every query and need no mask; only the tiles
from there to the block's last position are masked.

What the products multiply depends on the operands (MODE):
- BF16: bf16 q over the bf16 pool, on the tensor cores at full rate; the probabilities go
  into the second product as bf16 (the prefill of long windows).
- SPLIT: float32 q (the fused products' activations) over the bf16 pool; q and the
  probabilities go in as bf16 pairs (high part and remainder), so about 16 mantissa bits
  survive, as in decode attention (the windows that keep float32 activations).
- IEEE: float32 q over a float32 pool (the float32 engine), exact float32 products.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BF16, SPLIT, IEEE = 0, 1, 2
_BF16, _SPLIT, _IEEE = tl.constexpr(BF16), tl.constexpr(SPLIT), tl.constexpr(IEEE)
BLOCK_N = 64  # keys per tile, but for long bf16 batches (`tiles_for`)
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    """a [M, K] @ b [K, N] in float32 by MODE (see the module docstring); b is a pool tile."""
    if MODE == _IEEE:
        return tl.dot(a, b, input_precision="ieee")
    if MODE == _SPLIT:
        a_hi = a.to(b.dtype)
        a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
        return tl.dot(a_hi, b) + tl.dot(a_lo, b)
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def _tile(acc, m_i, l_i, q, n0, q_pos, end, table, k_pool_ptr, v_pool_ptr, kvh, d, dmask,
          scale, KV_DIM: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
          PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
          IS_DIAGONAL: tl.constexpr):
    """Fold keys n0 .. n0 + BLOCK_N - 1 into the block's running softmax; on the diagonal
    a query sees only keys at or before its position, and none past `end`."""
    offs = n0 + tl.arange(0, BLOCK_N)
    nmask = offs < end
    if IS_DIAGONAL:
        page = tl.load(table + offs // PAGE, mask=nmask, other=0)
    else:
        page = tl.load(table + offs // PAGE)
    rows = page * PAGE + offs % PAGE
    kv_off = rows[:, None] * KV_DIM + kvh * HD + d[None, :]
    if IS_DIAGONAL:
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_pool_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, HD_P]
        v = tl.load(v_pool_ptr + kv_off, mask=kv_mask, other=0.0)
    elif HD == HD_P:
        k = tl.load(k_pool_ptr + kv_off)
        v = tl.load(v_pool_ptr + kv_off)
    else:
        k = tl.load(k_pool_ptr + kv_off, mask=dmask[None, :], other=0.0)
        v = tl.load(v_pool_ptr + kv_off, mask=dmask[None, :], other=0.0)
    s = _dot(q, tl.trans(k), MODE) * scale  # log2 units
    if IS_DIAGONAL:
        s = tl.where((offs[None, :] <= q_pos[:, None]) & nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p, v, MODE)
    return acc, m_new, l_i


@triton.jit
def prefill_attention_kernel(qkv_ptr, qkv_stride, k_pool_ptr, v_pool_ptr, out_ptr, out_stride,
                             blocks_ptr, tables_ptr, table_stride, scale,
                             GROUP: tl.constexpr, KV_DIM: tl.constexpr, HD: tl.constexpr,
                             HD_P: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """Grid (heads, blocks): the heads of one block run side by side, so the GROUP heads
    that share a kv head read its tiles while they are in L2. `scale` is log2(e)/sqrt(hd)."""
    head = tl.program_id(0)
    blk = tl.program_id(1)
    chunk = tl.load(blocks_ptr + blk * 4)
    first = tl.load(blocks_ptr + blk * 4 + 1)
    pos0 = tl.load(blocks_ptr + blk * 4 + 2)
    count = tl.load(blocks_ptr + blk * 4 + 3)
    kvh = head // GROUP
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD_P)
    mmask = m < count
    dmask = d < HD
    q_pos = pos0 + m
    q_off = (first + m)[:, None] * qkv_stride + head * HD + d[None, :]
    q_mask = mmask[:, None] & dmask[None, :]
    q = tl.load(qkv_ptr + q_off, mask=q_mask, other=0.0)
    table = tables_ptr + chunk * table_stride
    end = pos0 + count
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD_P], tl.float32)
    full = pos0 // BLOCK_N * BLOCK_N  # tiles below this are visible to every query
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, n0, q_pos, end, table, k_pool_ptr,
                              v_pool_ptr, kvh, d, dmask, scale, KV_DIM, HD, HD_P, PAGE, BLOCK_N,
                              MODE, False)
    for n0 in range(full, end, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, n0, q_pos, end, table, k_pool_ptr,
                              v_pool_ptr, kvh, d, dmask, scale, KV_DIM, HD, HD_P, PAGE, BLOCK_N,
                              MODE, True)
    out_off = (first + m)[:, None] * out_stride + head * HD + d[None, :]
    tl.store(out_ptr + out_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


Tiles = tuple[int, int, int]  # (BLOCK_N, num_warps, num_stages)


def tiles_for(block_m: int, mode: int) -> Tiles:
    """Keys per tile, warps and pipeline stages for blocks of `block_m` queries. Measured on
    the H200 (bench_attention.py, hd 128, 8,192 positions): 128 queries by 128 keys, 8 warps,
    3 stages is the fastest bf16 choice, 12% ahead of 128 by 64; below 1,024 positions the
    tile choices are within a few microseconds of each other. The float32-q modes hold four
    products' operands: 64 keys, 2 stages."""
    if mode == BF16:
        return (128, 8, 3) if block_m >= 128 else (BLOCK_N, 4, 3)
    return BLOCK_N, 8 if block_m >= 128 else 4, 2


def prefill_block(num_tokens: int) -> int:
    """Queries per block: 128 once a batch has enough of them to fill the GPU with blocks
    of that size, 64 below."""
    return 128 if num_tokens > 1024 else 64


def launch_prefill_attention(qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             blocks: torch.Tensor, tables: torch.Tensor, out: torch.Tensor,
                             num_heads: int, num_kv_heads: int, head_dim: int,
                             page_size: int, block_m: int, tiles: Tiles | None = None) -> None:
    """out [T, heads * hd] = causal attention of the q heads at the start of qkv rows over
    the pool, per the layout's `blocks` [B, 4] (of `block_m` queries) and `tables`
    [R, pages] (int64). `tiles`: (keys per tile, warps, stages), else `tiles_for`."""
    is_f32 = (k_pool.dtype == torch.float32, qkv.dtype == torch.float32)
    mode = IEEE if is_f32[0] else SPLIT if is_f32[1] else BF16
    block_n, warps, stages = tiles or tiles_for(block_m, mode)
    hd_p = max(16, 1 << (head_dim - 1).bit_length())
    prefill_attention_kernel[(num_heads, blocks.shape[0])](
        qkv, qkv.stride(0), k_pool, v_pool, out, out.stride(0), blocks, tables,
        tables.stride(0), LOG2E / math.sqrt(head_dim), GROUP=num_heads // num_kv_heads,
        KV_DIM=num_kv_heads * head_dim, HD=head_dim, HD_P=hd_p, PAGE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, MODE=mode, num_warps=warps, num_stages=stages)
