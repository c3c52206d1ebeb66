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
    m_use = m_new
    if IS_DIAGONAL:  # a split's first tile may hide every key from a query
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p, v, MODE)
    return acc, m_new, l_i


@triton.jit
def prefill_attention_kernel(qkv_ptr, qkv_stride, k_pool_ptr, v_pool_ptr, out_ptr, out_stride,
                             blocks_ptr, tables_ptr, table_stride, scale, part_ptr, ml_ptr,
                             part_rows, count_ptr, GROUP: tl.constexpr, KV_DIM: tl.constexpr,
                             HD: tl.constexpr, HD_P: tl.constexpr, PAGE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
                             SPLITS: tl.constexpr, SELF_COMBINE: tl.constexpr):
    """Grid (heads, blocks, SPLITS): the heads of one block run side by side, so the GROUP
    heads that share a kv head read its tiles while they are in L2. `scale` is
    log2(e)/sqrt(hd). With SPLITS > 1, split s folds tiles s, s + SPLITS, ... and leaves
    its unnormalised sums and (max, denominator) per query in the partials (`part_ptr`
    [SPLITS, part_rows, heads, HD_P], `ml_ptr` [SPLITS, part_rows, heads, 2]). With
    SELF_COMBINE, each split then counts itself in (`count_ptr`, one int32 per block and
    head, zero between launches) and the last of a block's splits to finish merges them
    into the output and zeroes the count, so the merge costs no launch of its own; without,
    `combine_kernel` merges them."""
    head = tl.program_id(0)
    blk = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(0)
    chunk = tl.load(blocks_ptr + blk * 4)
    first = tl.load(blocks_ptr + blk * 4 + 1)
    pos0 = tl.load(blocks_ptr + blk * 4 + 2)
    count = tl.load(blocks_ptr + blk * 4 + 3)
    if count == 0:  # a padding block of a captured pass (every chunk row of the batch)
        return
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
    for n0 in range(split * BLOCK_N, full, SPLITS * BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, n0, q_pos, end, table, k_pool_ptr,
                              v_pool_ptr, kvh, d, dmask, scale, KV_DIM, HD, HD_P, PAGE, BLOCK_N,
                              MODE, False)
    full_tiles = full // BLOCK_N
    diagonal = full_tiles + (split + SPLITS - full_tiles % SPLITS) % SPLITS  # this split's first
    for n0 in range(diagonal * BLOCK_N, end, SPLITS * BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, n0, q_pos, end, table, k_pool_ptr,
                              v_pool_ptr, kvh, d, dmask, scale, KV_DIM, HD, HD_P, PAGE, BLOCK_N,
                              MODE, True)
    if SPLITS == 1:
        out_off = (first + m)[:, None] * out_stride + head * HD + d[None, :]
        tl.store(out_ptr + out_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=q_mask)
    else:
        row = (split * part_rows + first + m) * num_heads + head  # [BLOCK_M]
        tl.store(part_ptr + row[:, None] * HD_P + d[None, :], acc, mask=mmask[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=mmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mmask)
        if SELF_COMBINE:
            tl.debug_barrier()  # every thread's partials are written before the count
            counter = count_ptr + blk * num_heads + head
            if tl.atomic_add(counter, 1) == SPLITS - 1:
                tl.debug_barrier()
                _merge_splits(part_ptr, ml_ptr, part_rows, (first + m) * num_heads + head,
                              mmask, d, dmask, out_ptr + (first + m)[:, None] * out_stride
                              + head * HD + d[None, :], num_heads, HD_P, SPLITS)
                tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_splits(part_ptr, ml_ptr, part_rows, row0, mmask, d, dmask, out_ptrs, num_heads,
                  HD_P: tl.constexpr, SPLITS: tl.constexpr):
    """Merge the SPLITS partials of the queries whose split-0 partial rows are `row0`
    [BLOCK_M] and write them at `out_ptrs` [BLOCK_M, HD_P]. A split that saw no key left
    max -inf and denominator 0: it weighs nothing."""
    m_all = tl.full(row0.shape, float("-inf"), tl.float32)
    l_all = tl.zeros(row0.shape, tl.float32)
    acc = tl.zeros([row0.shape[0], HD_P], tl.float32)
    for sp in range(SPLITS):
        row = sp * part_rows * num_heads + row0
        m_s = tl.load(ml_ptr + row * 2, mask=mmask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ml_ptr + row * 2 + 1, mask=mmask, other=0.0, cache_modifier=".cg")
        a_s = tl.load(part_ptr + row[:, None] * HD_P + d[None, :], mask=mmask[:, None],
                      other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_all, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_all - m_use)
        w = tl.exp2(m_s - m_use)
        acc = acc * alpha[:, None] + a_s * w[:, None]
        l_all = l_all * alpha + l_s * w
        m_all = m_new
    res = tl.where(l_all[:, None] > 0, acc / l_all[:, None], 0.0)
    tl.store(out_ptrs, res.to(out_ptrs.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


@triton.jit
def combine_kernel(part_ptr, ml_ptr, part_rows, out_ptr, out_stride, HD: tl.constexpr,
                   HD_P: tl.constexpr, SPLITS: tl.constexpr, TOKENS: tl.constexpr):
    """Grid (cdiv(tokens, TOKENS), heads): the SPLITS partial sums of TOKENS queries of one
    head into their outputs. A split that saw no key left max -inf and denominator 0, so it
    weighs nothing; a padding token that no block holds reads stale partials and writes
    what it likes to its own row."""
    toks = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    tmask = toks < part_rows
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HD_P)
    rows = (s[:, None] * part_rows + toks[None, :]) * num_heads + head  # [SPLITS, TOKENS]
    m_s = tl.load(ml_ptr + rows * 2, mask=tmask[None, :], other=float("-inf"))
    m_max = tl.max(m_s, axis=0)  # [TOKENS]
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([TOKENS], tl.float32)
    acc = tl.zeros([TOKENS, HD_P], tl.float32)
    for sp in tl.static_range(SPLITS):
        row = (sp * part_rows + toks) * num_heads + head  # [TOKENS]
        w = tl.exp2(tl.load(ml_ptr + row * 2, mask=tmask, other=float("-inf")) - m_max)
        l_sum += w * tl.load(ml_ptr + row * 2 + 1, mask=tmask, other=0.0)
        acc += w[:, None] * tl.load(part_ptr + row[:, None] * HD_P + d[None, :],
                                    mask=tmask[:, None], other=0.0)
    res = tl.where(l_sum[:, None] > 0, acc / l_sum[:, None], 0.0)
    tl.store(out_ptr + toks[:, None] * out_stride + head * HD + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & (d < HD)[None, :])


# Queries per combining program. Timed in a CUDA graph on an H100 (bench_attention.py
# --after 2000, 50 queries, 7B shape, 8 splits), the split kernel and its combining launch
# took 14.2 us a layer with 4, 14.3 with 8, 14.6 with 16 and 17.1 with one.
COMBINE_TOKENS = 4

Tiles = tuple[int, int, int]  # (BLOCK_N, num_warps, num_stages)


def tiles_for(block_m: int, mode: int, splits: int = 1) -> Tiles:
    """Keys per tile, warps and pipeline stages for blocks of `block_m` queries whose keys
    are split over `splits` programs. Measured on the H200 (bench_attention.py, hd 128,
    8,192 positions): 128 queries by 128 keys, 8 warps, 3 stages is the fastest bf16 choice,
    12% ahead of 128 by 64; below 1,024 positions the tile choices are within a few
    microseconds of each other. A split pass's few tiles per program go best with 2 stages
    (H100, 50 queries after 2,000 positions: 16.9 us a layer against 17.5 with 3). The
    float32-q modes hold four products' operands: 64 keys, 2 stages."""
    if mode == BF16:
        if block_m >= 128:
            return 128, 8, 3
        return BLOCK_N, 4, 2 if splits > 1 else 3
    return BLOCK_N, 8 if block_m >= 128 else 4, 2


def prefill_block(num_tokens: int) -> int:
    """Queries per block: 128 once a batch has enough of them to fill the GPU with blocks
    of that size, 64 below."""
    return 128 if num_tokens > 1024 else 64


SPLIT_TOKENS = 256  # passes up to this many tokens may split their keys
MAX_SPLITS = 16


def prefill_splits(num_tokens: int, block_m: int, num_heads: int, num_sms: int) -> int:
    """How many programs share one block's keys in a pass of `num_tokens` tokens (blocks of
    `block_m`): a few dozen query heads of a short pass after a long cached prefix would
    otherwise each stream every key alone on a handful of the GPU's multiprocessors.
    Enough splits to give every multiprocessor two programs, for passes up to
    SPLIT_TOKENS (longer ones have blocks enough), a power of two up to MAX_SPLITS."""
    if num_tokens > SPLIT_TOKENS:
        return 1
    programs = num_heads * -(-num_tokens // block_m)
    want = max(1, 2 * num_sms // programs)
    return min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def split_rows(num_heads: int, num_sms: int) -> int:
    """Rows of the partials (`PrefillPartials`): the most SPLITS x tokens any pass needs."""
    return max(prefill_splits(t, prefill_block(t), num_heads, num_sms) * t
               for t in range(1, SPLIT_TOKENS + 1))


class PrefillPartials:
    """The split passes' partial sums, claimed before any capture."""

    def __init__(self, num_heads: int, head_dim: int, num_sms: int,
                 device: torch.device, rows: int = 0) -> None:
        """`rows`: at least this many (splits x tokens), for passes that choose their own
        splits."""
        self.num_heads, self.num_sms = num_heads, num_sms
        hd_p = max(16, 1 << (head_dim - 1).bit_length())
        rows = max(rows, split_rows(num_heads, num_sms))
        self.part = torch.zeros((rows, num_heads, hd_p), device=device)
        self.ml = torch.zeros((rows, num_heads, 2), device=device)
        # the self-combining splits' counts: one per block and head (a split pass has at
        # most SPLIT_TOKENS blocks, one token each), zero between launches
        self.counts = torch.zeros((SPLIT_TOKENS, num_heads), dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return int(self.part.nbytes + self.ml.nbytes + self.counts.nbytes)


def launch_prefill_attention(qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             blocks: torch.Tensor, tables: torch.Tensor, out: torch.Tensor,
                             num_heads: int, num_kv_heads: int, head_dim: int,
                             page_size: int, block_m: int, tiles: Tiles | None = None,
                             partials: PrefillPartials | None = None,
                             splits: int | None = None, self_combine: bool = False,
                             combine_tokens: int | None = None) -> None:
    """out [T, heads * hd] = causal attention of the q heads at the start of qkv rows over
    the pool, per the layout's `blocks` [B, 4] (of `block_m` queries) and `tables`
    [R, pages] (int64). `tiles`: (keys per tile, warps, stages), else `tiles_for`. With
    `partials`, a short pass splits each block's keys (`prefill_splits`) and a second
    launch combines them (`combine_kernel`), or with `self_combine` the last split of
    each block to finish. Timed in a CUDA graph on an H100 (bench_attention.py --after,
    50 queries after 2,000 positions, 7B shape), the second launch is the faster: 16.9 us
    a layer, both launches counted, against 23.5 us, because the last split merges the
    partials of a whole block alone, after the others have finished. `splits` overrides
    the choice of splits (at most what `partials` holds rows for); `combine_tokens`, the
    queries each combining program merges (a power of two; default COMBINE_TOKENS)."""
    is_f32 = (k_pool.dtype == torch.float32, qkv.dtype == torch.float32)
    mode = IEEE if is_f32[0] else SPLIT if is_f32[1] else BF16
    hd_p = max(16, 1 << (head_dim - 1).bit_length())
    tokens = qkv.shape[0]
    if partials is None:
        splits = 1
    elif splits is None:
        splits = prefill_splits(tokens, block_m, num_heads, partials.num_sms)
    block_n, warps, stages = tiles or tiles_for(block_m, mode, splits)
    part, ml, counts = ((partials.part, partials.ml, partials.counts) if partials is not None
                        else (out, out, blocks))
    prefill_attention_kernel[(num_heads, blocks.shape[0], splits)](
        qkv, qkv.stride(0), k_pool, v_pool, out, out.stride(0), blocks, tables,
        tables.stride(0), LOG2E / math.sqrt(head_dim), part, ml, tokens, counts,
        GROUP=num_heads // num_kv_heads, KV_DIM=num_kv_heads * head_dim, HD=head_dim,
        HD_P=hd_p, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, MODE=mode,
        SPLITS=splits, SELF_COMBINE=self_combine, num_warps=warps, num_stages=stages)
    if splits > 1 and not self_combine:
        per = combine_tokens or COMBINE_TOKENS
        combine_kernel[(triton.cdiv(tokens, per), num_heads)](
            part, ml, tokens, out, out.stride(0), HD=head_dim, HD_P=hd_p, SPLITS=splits,
            TOKENS=per, num_warps=4)
