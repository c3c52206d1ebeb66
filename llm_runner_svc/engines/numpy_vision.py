"""The vision tower and projector in float32 numpy: pixels -> one text embedding per image
token (models/vision.py describes the architecture)."""

from __future__ import annotations

import math
import threading
from contextlib import nullcontext

import numpy as np

from llm_runner_svc.models.vision import VisionConfig, VisionLayer, VisionWeights


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to about 1e-7 (Abramowitz & Stegun 7.1.26, computed in float64)."""
    z = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (
        -1.453152027 + t * 1.061405429))))
    return (np.sign(x) * (1.0 - poly * np.exp(-z * z))).astype(np.float32)


def activation(name: str, x: np.ndarray) -> np.ndarray:
    if name == "quick_gelu":
        return x / (1.0 + np.exp(-1.702 * x))
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    # gelu_pytorch_tanh, gelu_new
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def pixel_shuffle(x: np.ndarray, scale: int) -> np.ndarray:
    """[B, n, d] tokens of a square grid -> [B, n / s^2, d s^2]: each s x s block of
    neighbouring patches as one token (Idefics3's order of the block's members)."""
    b, n, d = x.shape
    side = math.isqrt(n)
    x = x.reshape(b, side, side // scale, d * scale).transpose(0, 2, 1, 3)
    x = x.reshape(b, side // scale, side // scale, d * scale * scale).transpose(0, 2, 1, 3)
    return x.reshape(b, n // scale ** 2, d * scale * scale)


def patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[B, C, H, W] -> [B, (H/p)(W/p), C p p], patches row-major, each in the conv kernel's
    (channel, row, column) order."""
    b, c, hh, ww = pixels.shape
    gh, gw = hh // patch, ww // patch
    x = pixels.reshape(b, c, gh, patch, gw, patch).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, gh * gw, c * patch * patch)


class NumpyVision:
    """Runs a vision tower on the host; stateless between calls. With `lock` (the host
    engine's `compute_lock`) each layer runs holding it, so the tower and the engine's steps
    take turns at the BLAS threads instead of running at once."""

    def __init__(self, config: VisionConfig, weights: VisionWeights,
                 lock: threading.Lock | None = None) -> None:
        self.config = config
        self.w = weights
        self._lock = lock

    def _turn(self) -> threading.Lock | nullcontext[None]:
        return self._lock or nullcontext()

    def hidden_states(self, pixels: np.ndarray) -> list[np.ndarray]:
        """[B, C, H, W] float32 -> the tower's hidden states [B, positions, hidden], the
        embeddings first, then each kept layer's output (HF `hidden_states`)."""
        c, w = self.config, self.w
        with self._turn():
            x = patches(np.asarray(pixels, np.float32), c.patch_size) @ w.patch_w.T
        if w.patch_b is not None:
            x = x + w.patch_b
        if w.cls is not None:
            cls = np.broadcast_to(w.cls, (x.shape[0], 1, c.hidden_size))
            x = np.concatenate([cls, x], axis=1)
        x = x + w.pos
        if w.pre_ln is not None:
            x = layer_norm(x, *w.pre_ln, c.layer_norm_eps)
        out = [x]
        for lw in w.layers:
            with self._turn():
                x = self._layer(lw, x)
            out.append(x)
        return out

    def _layer(self, lw: VisionLayer, x: np.ndarray) -> np.ndarray:
        """One encoder layer over x [B, n, hidden]."""
        c = self.config
        b, n, hd = x.shape[0], x.shape[1], c.head_dim
        h = layer_norm(x, lw.ln1_w, lw.ln1_b, c.layer_norm_eps)

        def heads(t: np.ndarray) -> np.ndarray:
            return t.reshape(b, n, c.num_heads, hd).transpose(0, 2, 1, 3)

        q = heads(h @ lw.wq.T + lw.bq) * hd ** -0.5
        k, v = heads(h @ lw.wk.T + lw.bk), heads(h @ lw.wv.T + lw.bv)
        s = q @ k.transpose(0, 1, 3, 2)  # [B, heads, n, n]
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(0, 2, 1, 3).reshape(b, n, c.hidden_size)
        x = x + a @ lw.wo.T + lw.bo
        h = layer_norm(x, lw.ln2_w, lw.ln2_b, c.layer_norm_eps)
        h = activation(c.hidden_act, h @ lw.fc1_w.T + lw.fc1_b)
        return x + h @ lw.fc2_w.T + lw.fc2_b

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """[B, C, H, W] -> [B, tokens_per_image, text_hidden]: the projected features of the
        feature layers, what replaces the image tokens' embeddings."""
        c = self.config
        states = self.hidden_states(pixels)
        feats = [states[f if f >= 0 else c.num_layers + 1 + f] for f in c.feature_layers]
        if c.drop_cls:
            feats = [f[:, 1:] for f in feats]
        x = np.concatenate(feats, axis=-1)
        with self._turn():
            return self._project(x)

    def _project(self, x: np.ndarray) -> np.ndarray:
        """The connector: [B, positions, features] -> [B, tokens_per_image, text_hidden]."""
        c, w = self.config, self.w
        if w.post_ln is not None:
            x = layer_norm(x, *w.post_ln, c.layer_norm_eps)
        if c.connector == "pixel_shuffle":
            return np.ascontiguousarray(pixel_shuffle(x, c.scale_factor) @ w.proj1_w.T,
                                        dtype=np.float32)
        assert w.proj1_b is not None and w.proj2_w is not None and w.proj2_b is not None
        x = activation(c.projector_act, x @ w.proj1_w.T + w.proj1_b)
        return np.ascontiguousarray(x @ w.proj2_w.T + w.proj2_b, dtype=np.float32)
