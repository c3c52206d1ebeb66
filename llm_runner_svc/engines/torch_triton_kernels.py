"""Triton kernels of the torch engine's GPU decode step (imported only on CUDA).

Each kernel fuses what plain torch would run as several launches, so one decoder layer costs
five small launches beside its four matrix products: RMSNorm; q/k norm + RoPE + the KV-pool
write; paged attention (plus a combine launch when a row's positions are split across
programs); SiLU-and-multiply. Shapes and pointers are fixed at capture, so every kernel reads
the per-row position from device memory and a CUDA graph can replay it at any length.
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
def rope_store_kernel(qkv_ptr, qkv_stride, pos_ptr, tables_ptr, table_stride, cos_ptr,
                      sin_ptr, k_pool_ptr, v_pool_ptr, q_norm_ptr, k_norm_ptr, eps,
                      NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HD: tl.constexpr,
                      HALF: tl.constexpr, HALF_P: tl.constexpr, PAGE: tl.constexpr,
                      INTERLEAVED: tl.constexpr, HAS_QK_NORM: tl.constexpr):
    """Grid (rows, heads + kv_heads): one head vector per program."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    i = tl.arange(0, HALF_P)
    mask = i < HALF
    if INTERLEAVED:
        ia = 2 * i
        ib = 2 * i + 1
    else:
        ia = i
        ib = i + HALF
    base = qkv_ptr + row * qkv_stride + head * HD  # k heads follow the q heads
    a = tl.load(base + ia, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + ib, mask=mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        inv = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / HD + eps)
        if head < NUM_HEADS:
            wa = tl.load(q_norm_ptr + ia, mask=mask, other=0.0)
            wb = tl.load(q_norm_ptr + ib, mask=mask, other=0.0)
        else:
            wa = tl.load(k_norm_ptr + ia, mask=mask, other=0.0)
            wb = tl.load(k_norm_ptr + ib, mask=mask, other=0.0)
        a = a * inv * wa
        b = b * inv * wb
    c = tl.load(cos_ptr + pos * HALF + i, mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + i, mask=mask, other=0.0)
    ra = a * c - b * s
    rb = b * c + a * s
    if head < NUM_HEADS:
        tl.store(base + ia, ra.to(qkv_ptr.dtype.element_ty), mask=mask)
        tl.store(base + ib, rb.to(qkv_ptr.dtype.element_ty), mask=mask)
    else:
        kvh = head - NUM_HEADS
        page = tl.load(tables_ptr + row * table_stride + pos // PAGE).to(tl.int64)
        dst = (page * PAGE + pos % PAGE) * (NUM_KV * HD) + kvh * HD
        tl.store(k_pool_ptr + dst + ia, ra.to(k_pool_ptr.dtype.element_ty), mask=mask)
        tl.store(k_pool_ptr + dst + ib, rb.to(k_pool_ptr.dtype.element_ty), mask=mask)
        v_src = qkv_ptr + row * qkv_stride + (NUM_HEADS + NUM_KV + kvh) * HD
        v_a = tl.load(v_src + ia, mask=mask, other=0.0)
        v_b = tl.load(v_src + ib, mask=mask, other=0.0)
        tl.store(v_pool_ptr + dst + ia, v_a.to(v_pool_ptr.dtype.element_ty), mask=mask)
        tl.store(v_pool_ptr + dst + ib, v_b.to(v_pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def decode_attention_kernel(qkv_ptr, qkv_stride, k_pool_ptr, v_pool_ptr, pos_ptr, tables_ptr,
                            table_stride, out_ptr, out_stride, part_ptr, lse_ptr, scale,
                            NUM_KV: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr,
                            HD_P: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_N: tl.constexpr, Q_FP32: tl.constexpr,
                            KV_FP32: tl.constexpr):
    """Grid (rows, kv_heads, splits). Program (r, h, s) attends the GROUP query heads of kv
    head h over positions [s * SPLIT, (s + 1) * SPLIT) of row r, stopping at the row's own
    position: nothing past it is read. A row whose positions fit one split writes its output
    here; otherwise each split leaves its normalized partial and log-sum-exp for
    `combine_kernel`. A float32 pool (the float32 engine) multiplies in float32; over a bf16
    pool a float32 q (the fused products' activations) goes in as a bf16 pair (high part and
    remainder), so the scores keep about 16 of its mantissa bits."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(pos_ptr + row) + 1
    start = split * SPLIT
    if start < length:
        end = tl.minimum(start + SPLIT, length)
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < GROUP
        d = tl.arange(0, HD_P)
        dmask = d < HD
        q_off = (kvh * GROUP + heads)[:, None] * HD + d[None, :]
        q = tl.load(qkv_ptr + row * qkv_stride + q_off, mask=hmask[:, None] & dmask[None, :],
                    other=0.0)  # [BLOCK_H, HD_P]
        if not KV_FP32:
            q_hi = q.to(k_pool_ptr.dtype.element_ty)
            q_lo = (q.to(tl.float32) - q_hi.to(tl.float32)).to(k_pool_ptr.dtype.element_ty)
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
                s = tl.dot(q_hi, tl.trans(k))
                if Q_FP32:
                    s += tl.dot(q_lo, tl.trans(k))
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
            tl.store(out_ptr + row * out_stride + q_off, res.to(out_ptr.dtype.element_ty),
                     mask=out_mask)
        else:
            head_ids = row * (NUM_KV * GROUP) + kvh * GROUP + heads  # [BLOCK_H]
            p_off = (head_ids[:, None] * NUM_SPLITS + split) * HD_P + d[None, :]
            tl.store(part_ptr + p_off, res, mask=out_mask)
            tl.store(lse_ptr + head_ids * NUM_SPLITS + split, m_i + tl.log(l_i), mask=hmask)


@triton.jit
def combine_kernel(pos_ptr, part_ptr, lse_ptr, out_ptr, out_stride,
                   NUM_HEADS: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
                   SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Grid (rows, heads): merge the split partials of rows longer than one split."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(pos_ptr + row) + 1
    if length > SPLIT:
        num_active = (length + SPLIT - 1) // SPLIT
        d = tl.arange(0, HD_P)
        dmask = d < HD
        hid = row * NUM_HEADS + head
        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([HD_P], tl.float32)
        for s in range(0, num_active):
            lse = tl.load(lse_ptr + hid * NUM_SPLITS + s + tl.zeros([1], tl.int32))
            part = tl.load(part_ptr + (hid * NUM_SPLITS + s) * HD_P + d, mask=dmask, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + part * w
            total = total * alpha + w
            m = m_new
        res = acc / total
        tl.store(out_ptr + row * out_stride + head * HD + d, res.to(out_ptr.dtype.element_ty),
                 mask=dmask)
