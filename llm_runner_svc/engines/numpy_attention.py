"""Attention of the numpy engine over its token-major paged KV pool (float32).

The pool of one layer is [pages * page_size, 2 kv_dim]: keys and values side by side, page p
holding rows p*page_size .. (p+1)*page_size-1. GQA is a [kv_heads, group] split of the
query heads, with no per-head loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm_runner_svc.engines.batch import Segment
from llm_runner_svc.engines.numpy_kernels import softmax_
from llm_runner_svc.models.spec import ModelConfig


def attend_prefill(c: ModelConfig, pool: np.ndarray, page_size: int, q: np.ndarray,
                   table: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """q [n, q_dim] of one request at positions `pos` [n] (ascending, their KV already
    in `pool`), attending causally over the pages of `table` up to the last position.
    Returns [n, q_dim]. Every shape here follows from n and the last position only."""
    n = q.shape[0]
    end = int(pos[-1]) + 1
    pages = table[:(end - 1) // page_size + 1]
    span = pages.shape[0] * page_size
    rows = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)  # [span]
    g = c.num_heads // c.num_kv_heads
    window = np.take(pool, rows, axis=0).reshape(span, 2, c.num_kv_heads, c.head_dim)
    keys_t = window[:, 0].transpose(1, 2, 0)[:, None]  # [kv, 1, hd, span]
    vals_t = window[:, 1].transpose(1, 0, 2)[:, None]  # [kv, 1, span, hd]
    qh = q.reshape(n, c.num_kv_heads, g, c.head_dim).transpose(1, 2, 0, 3)  # [kv, g, n, hd]
    scores = np.matmul(qh, keys_t)  # [kv, g, n, span]
    scores *= np.float32(1.0 / np.sqrt(c.head_dim))
    visible = np.arange(span)[None, :] <= pos[:, None]  # [n, span] causal
    scores[..., ~visible] = -np.inf
    softmax_(scores)
    out = np.matmul(scores, vals_t)  # [kv, g, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, c.q_dim)


@dataclass(frozen=True)
class Singles:
    """Where one-token segments read: the pool rows of every segment's window page by
    page, and the causal mask over the padded windows."""

    gather: np.ndarray  # [b * span] pool rows
    mask: np.ndarray  # [b, 1, 1, span] additive

    @staticmethod
    def build(segs: Sequence[Segment], page_size: int) -> Singles:
        ps = page_size
        b = len(segs)
        pos = np.fromiter((s.start for s in segs), dtype=np.int64, count=b)
        num_pages = int(pos.max()) // ps + 1
        tables = np.zeros((b, num_pages), np.int64)  # short rows padded (masked)
        for i, s in enumerate(segs):
            m = min(num_pages, len(s.pages))
            tables[i, :m] = s.pages[:m]
        gather = (tables[:, :, None] * ps + np.arange(ps)).reshape(-1)
        mask = np.where(np.arange(num_pages * ps)[None, :] <= pos[:, None], 0.0, -np.inf)
        return Singles(gather, mask.astype(np.float32)[:, None, None, :])


def attend_singles(c: ModelConfig, pool: np.ndarray, q: np.ndarray, one: Singles) -> np.ndarray:
    """q [b, q_dim], one row per one-token segment, each attending over its gathered
    window. Returns [b, q_dim]."""
    b = q.shape[0]
    span = one.gather.shape[0] // b
    g = c.num_heads // c.num_kv_heads
    window = np.take(pool, one.gather, axis=0).reshape(b, span, 2, c.num_kv_heads, c.head_dim)
    qh = q.reshape(b, c.num_kv_heads, g, c.head_dim)
    scores = np.matmul(qh, window[:, :, 0].transpose(0, 2, 3, 1))  # [b, kv, g, span]
    scores *= np.float32(1.0 / np.sqrt(c.head_dim))
    scores += one.mask
    softmax_(scores)
    out = np.matmul(scores, window[:, :, 1].transpose(0, 2, 1, 3))  # [b, kv, g, hd]
    return out.reshape(b, c.q_dim)
