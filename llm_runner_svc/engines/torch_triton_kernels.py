"""Triton kernels of the torch engine's GPU decode step (imported only on CUDA).

Each kernel fuses what plain torch would run as several launches: the embedding lookup and
its widening to the float32 residual stream; RMSNorm; q/k norm + RoPE + the KV-pool write (a
prefill window's); paged attention, which in a decode step also rotates the new q and k,
stores k and v, and merges split rows in its last program; SiLU-and-multiply; the greedy
pick. Where a result needs every program's part (merging splits, the argmax), the programs
count themselves in with an atomic and the last one finishes, instead of a second launch.
Shapes and pointers are fixed at capture, so every kernel reads the per-row position from
device memory and a CUDA graph can replay it at any length.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, out_stride, n_cols, eps,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = x * inv * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(gu_ptr, gu_stride, out_ptr, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_store_kernel(qkv_ptr, qkv_stride, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_pool_ptr,
                      v_pool_ptr, q_norm_ptr, k_norm_ptr, eps, NUM_HEADS: tl.constexpr,
                      NUM_KV: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
                      HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                      HAS_QK_NORM: tl.constexpr, FIRST_HEAD: tl.constexpr):
    """Grid (rows, heads + kv_heads - FIRST_HEAD): one head vector per program, rotated
    (q/k-normalized first, for such models) as decode attention rotates it; q in place, k
    and v into the pool at the row's slot. FIRST_HEAD = NUM_HEADS: the k and v only, q
    left unrotated (for a decode attention that rotates it)."""
    row = tl.program_id(0)
    head = tl.program_id(1) + FIRST_HEAD
    pos = tl.load(pos_ptr + row)
    d = tl.arange(0, HD_P)
    dmask = d < HD
    partner, sign, cs, sn = _rope_pairs(d, pos, cos_ptr, sin_ptr, HALF, INTERLEAVED)
    base = qkv_ptr + row * qkv_stride + head * HD  # k heads follow the q heads
    x = tl.load(base + d, mask=dmask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=dmask, other=0.0).to(tl.float32)
    if head < NUM_HEADS:
        r = _rotate(x, xp, sign, cs, sn, q_norm_ptr, d, partner, dmask, eps, HD, HAS_QK_NORM)
        tl.store(base + d, r.to(qkv_ptr.dtype.element_ty), mask=dmask)
    else:
        r = _rotate(x, xp, sign, cs, sn, k_norm_ptr, d, partner, dmask, eps, HD, HAS_QK_NORM)
        kvh = head - NUM_HEADS
        dst = tl.load(slot_ptr + row).to(tl.int64) * (NUM_KV * HD) + kvh * HD + d
        tl.store(k_pool_ptr + dst, r.to(k_pool_ptr.dtype.element_ty), mask=dmask)
        v = tl.load(qkv_ptr + row * qkv_stride + (NUM_HEADS + NUM_KV + kvh) * HD + d,
                    mask=dmask, other=0.0)
        tl.store(v_pool_ptr + dst, v.to(v_pool_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _rope_pairs(d, pos, cos_ptr, sin_ptr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """For head dimensions d: the partner each is rotated with, the sign of the partner's
    term, and cos and sin at position `pos`: rotated[d] = x[d] cos + sign x[partner] sin."""
    if INTERLEAVED:
        partner = d ^ 1
        ci = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        ci = tl.where(d < HALF, d, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
    dmask = ci < HALF
    cs = tl.load(cos_ptr + pos * HALF + ci, mask=dmask, other=0.0)
    sn = tl.load(sin_ptr + pos * HALF + ci, mask=dmask, other=0.0)
    return partner, sign, cs, sn


@triton.jit
def _rotate(x, xp, sign, cs, sn, norm_ptr, d, partner, dmask, eps, HD: tl.constexpr,
            HAS_QK_NORM: tl.constexpr):
    """Heads x [.., HD_P] (float32; xp the same heads at the partner dimensions), normalized
    per head first for q/k-norm models, then rotated."""
    if HAS_QK_NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / HD + eps)
        x = x * inv * tl.load(norm_ptr + d, mask=dmask, other=0.0)
        xp = xp * inv * tl.load(norm_ptr + partner, mask=dmask, other=0.0)
    return x * cs + sign * xp * sn


@triton.jit
def decode_attention_kernel(qkv_ptr, qkv_stride, k_pool_ptr, v_pool_ptr, pos_ptr, tables_ptr,
                            table_stride, out_ptr, out_stride, part_ptr, lse_ptr, count_ptr,
                            scale, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
                            NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr,
                            GROUP: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
                            HALF: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_N: tl.constexpr, KV_FP32: tl.constexpr,
                            INTERLEAVED: tl.constexpr, HAS_QK_NORM: tl.constexpr,
                            STORE_KV: tl.constexpr):
    """Grid (rows, kv_heads, splits). Program (r, h, s) attends the GROUP query heads of kv
    head h over positions [s * SPLIT, (s + 1) * SPLIT) of row r, stopping at the row's own
    position: nothing past it is read. A row whose positions fit one split writes its output
    here; otherwise each split leaves its normalized partial and log-sum-exp, counts itself
    in, and the last split of the (row, kv head) to finish merges them (then resets the
    count for the next launch), so the merge costs no launch of its own.

    The row's new q, k and v come unrotated in qkv: each program rotates (q/k-normalizes
    first, for such models) its query heads as it loads them, and the program whose split
    holds the row's position rotates k and writes k and v into the pool before it reads its
    positions, so RoPE and the KV write cost no launch of their own. That store is seen by
    its own program only: rows that read each other's new positions (a verify row's K + 1
    positions, run as decode rows) have their k and v stored by an earlier launch
    (`rope_store_kernel` with FIRST_HEAD = NUM_HEADS) and run with STORE_KV off. A float32
    pool (the float32 engine) multiplies in float32; over a bf16 pool the float32 q goes in
    as a bf16 pair (high part and remainder), so the scores keep about 16 of its mantissa
    bits."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(pos_ptr + row)
    length = pos + 1
    start = split * SPLIT
    if start < length:
        end = tl.minimum(start + SPLIT, length)
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < GROUP
        d = tl.arange(0, HD_P)
        dmask = d < HD
        partner, sign, cs, sn = _rope_pairs(d, pos, cos_ptr, sin_ptr, HALF, INTERLEAVED)
        row_ptr = qkv_ptr + row * qkv_stride
        q_rows = (kvh * GROUP + heads)[:, None] * HD
        q_mask = hmask[:, None] & dmask[None, :]
        q = tl.load(row_ptr + q_rows + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
        qp = tl.load(row_ptr + q_rows + partner[None, :], mask=q_mask, other=0.0)
        q = _rotate(q, qp.to(tl.float32), sign[None, :], cs[None, :], sn[None, :], q_norm_ptr,
                    d[None, :], partner[None, :], dmask[None, :], eps, HD, HAS_QK_NORM)
        # (STORE_KV off: an earlier launch stored every row's k and v; two `if`s, as
        # Triton's compiler takes no `and` of a constexpr and a tensor condition)
        if STORE_KV:  # noqa: SIM102
            if pos < start + SPLIT:  # this split holds the new position: store its k, v
                k_ptr = row_ptr + (NUM_HEADS + kvh) * HD
                k = tl.load(k_ptr + d, mask=dmask, other=0.0).to(tl.float32)
                kp = tl.load(k_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
                k = _rotate(k, kp, sign, cs, sn, k_norm_ptr, d, partner, dmask, eps, HD,
                            HAS_QK_NORM)
                v = tl.load(row_ptr + (NUM_HEADS + NUM_KV + kvh) * HD + d, mask=dmask,
                            other=0.0)
                page = tl.load(tables_ptr + row * table_stride + pos // PAGE).to(tl.int64)
                dst = (page * PAGE + pos % PAGE) * (NUM_KV * HD) + kvh * HD + d
                tl.store(k_pool_ptr + dst, k.to(k_pool_ptr.dtype.element_ty), mask=dmask)
                tl.store(v_pool_ptr + dst, v.to(v_pool_ptr.dtype.element_ty), mask=dmask)
        tl.debug_barrier()  # the stores above are seen by this program's loads below
        if not KV_FP32:
            q_hi = q.to(k_pool_ptr.dtype.element_ty)
            q_lo = (q - q_hi.to(tl.float32)).to(k_pool_ptr.dtype.element_ty)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HD_P], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < end
            page = tl.load(tables_ptr + row * table_stride + offs // PAGE, mask=nmask, other=0)
            prow = page.to(tl.int64) * PAGE + offs % PAGE
            kv_off = prow[:, None] * (NUM_KV * HD) + kvh * HD + d[None, :]
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_pool_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, HD_P]
            v = tl.load(v_pool_ptr + kv_off, mask=kv_mask, other=0.0)
            if KV_FP32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:  # bf16 products are exact, summed in float32
                s = tl.dot(q_hi, tl.trans(k)) + tl.dot(q_lo, tl.trans(k))
            s = tl.where(nmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if KV_FP32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:  # p as a bf16 pair (high + low part): about 16 mantissa bits survive
                p_hi = p.to(v.dtype)
                p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
                pv = tl.dot(p_hi, v) + tl.dot(p_lo, v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        res = acc / l_i[:, None]
        out_mask = hmask[:, None] & dmask[None, :]
        if length <= SPLIT:
            tl.store(out_ptr + row * out_stride + q_rows + d[None, :],
                     res.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            head_ids = row * (NUM_KV * GROUP) + kvh * GROUP + heads  # [BLOCK_H]
            p_rows = head_ids[:, None] * NUM_SPLITS * HD_P + d[None, :]
            tl.store(part_ptr + p_rows + split * HD_P, res, mask=out_mask)
            tl.store(lse_ptr + head_ids * NUM_SPLITS + split, m_i + tl.log(l_i), mask=hmask)
            tl.debug_barrier()  # every thread's partial is written before the count
            counter = count_ptr + row * NUM_KV + kvh
            if tl.atomic_add(counter, 1) == (length + SPLIT - 1) // SPLIT - 1:
                tl.debug_barrier()
                m = tl.full([BLOCK_H], float("-inf"), tl.float32)
                total = tl.zeros([BLOCK_H], tl.float32)
                merged = tl.zeros([BLOCK_H, HD_P], tl.float32)
                for sp in range(0, (length + SPLIT - 1) // SPLIT):
                    lse = tl.load(lse_ptr + head_ids * NUM_SPLITS + sp, mask=hmask, other=0.0,
                                  cache_modifier=".cg")
                    part = tl.load(part_ptr + p_rows + sp * HD_P, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
                    m_new = tl.maximum(m, lse)
                    alpha = tl.exp(m - m_new)
                    w = tl.exp(lse - m_new)
                    merged = merged * alpha[:, None] + part * w[:, None]
                    total = total * alpha + w
                    m = m_new
                tl.store(out_ptr + row * out_stride + q_rows + d[None, :],
                         (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(counter, 0)


@triton.jit
def argmax_kernel(logits_ptr, stride, n_cols, part_val_ptr, part_idx_ptr, count_ptr, out_ptr,
                  NUM_CHUNKS: tl.constexpr, CHUNKS_P: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, NUM_CHUNKS): the first index of each row's largest logit, in one launch:
    every program leaves its chunk's best, and the last of a row to finish picks among them
    (then resets the row's count)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride + offs, mask=offs < n_cols, other=float("-inf"))
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, offs, n_cols), axis=0)
    tl.store(part_val_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, first)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + row, 1) == NUM_CHUNKS - 1:
        tl.debug_barrier()
        c = tl.arange(0, CHUNKS_P)
        cmask = c < NUM_CHUNKS
        vals = tl.load(part_val_ptr + row * NUM_CHUNKS + c, mask=cmask, other=float("-inf"),
                       cache_modifier=".cg")
        idx = tl.load(part_idx_ptr + row * NUM_CHUNKS + c, mask=cmask, other=n_cols,
                      cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(vals == top, idx, n_cols), axis=0).to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0)


@triton.jit
def embed_kernel(ids_ptr, emb_ptr, x_ptr, cap_ptr, hidden, BLOCK: tl.constexpr,
                 CAPTURE: tl.constexpr):
    """Grid (rows, cdiv(hidden, BLOCK)): residual rows = embedding rows of ids, widened to
    float32 (and staged as layer-0 states when CAPTURE)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    tok = tl.load(ids_ptr + row).to(tl.int64)
    e = tl.load(emb_ptr + tok * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * hidden + cols, e, mask=mask)
    if CAPTURE:
        tl.store(cap_ptr + row * hidden + cols, e, mask=mask)
