"""Elementwise building blocks of the numpy engine (float32 in, float32 out)."""

from __future__ import annotations

import numpy as np

from llm_runner_svc.models.spec import RopeStyle


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float,
             out: np.ndarray | None = None) -> np.ndarray:
    """x * weight / sqrt(mean(x^2) + eps) over the last axis."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    ms += np.float32(eps)
    inv = 1.0 / np.sqrt(ms)
    if out is None:
        return x * inv * weight
    np.multiply(x, inv, out=out)
    out *= weight
    return out


def rope_tables(max_seq: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, each [max_seq, head_dim / 2] float32, angle = pos * theta^(-2i / head_dim)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.arange(max_seq, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: RopeStyle) -> None:
    """Rotate x [n, heads, head_dim] in place; cos/sin [n, 1, head_dim / 2]."""
    half = x.shape[-1] // 2
    if style is RopeStyle.INTERLEAVED:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    a_new = a * cos - b * sin
    b *= cos
    b += a * sin
    a[...] = a_new


def softmax_(scores: np.ndarray) -> None:
    """Softmax over the last axis, in place; rows of all -inf are not expected."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)


def round_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 `a` rounded to the nearest bf16 value (ties to even), still float32: what a
    bf16 store and load give back. Finite inputs only."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) \
        & np.uint32(0xFFFF0000)
    out: np.ndarray = rounded.view(np.float32)
    return out
