"""The vision tower and projector on the torch engine's device, in its dtype (float32 on
the CPU, bf16 on CUDA); embeddings come back as float32 host arrays. The same math as
numpy_vision.py (models/vision.py describes the architecture)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llm_runner_svc.models.vision import VisionConfig, VisionWeights


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu(x)
    return F.gelu(x, approximate="tanh")


def _pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """As numpy_vision.pixel_shuffle."""
    b, n, d = x.shape
    side = math.isqrt(n)
    x = x.reshape(b, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(b, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(b, n // scale ** 2, d * scale * scale)


class TorchVision:
    """Runs a vision tower where `engine` (a TorchEngine) runs; weights copied there once."""

    def __init__(self, config: VisionConfig, weights: VisionWeights, engine: Any) -> None:
        self.config = config
        self.device, self.dtype = engine.device, engine.dtype

        def t(a: np.ndarray | None) -> Any:
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(
                self.device, self.dtype)

        self.w: dict[str, Any] = {name: t(getattr(weights, name)) for name in (
            "patch_w", "patch_b", "cls", "pos", "proj1_w", "proj1_b", "proj2_w", "proj2_b")}
        self.pre_ln = None if weights.pre_ln is None else (t(weights.pre_ln[0]),
                                                           t(weights.pre_ln[1]))
        self.post_ln = None if weights.post_ln is None else (t(weights.post_ln[0]),
                                                             t(weights.post_ln[1]))
        self.layers = [{k: t(v) for k, v in vars(lw).items()} for lw in weights.layers]

    @torch.inference_mode()
    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """[B, C, H, W] float32 -> [B, tokens_per_image, text_hidden] float32 on the host."""
        c, w = self.config, self.w
        x = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)).to(
            self.device, self.dtype)
        b, p = x.shape[0], c.patch_size
        x = F.unfold(x, kernel_size=p, stride=p).transpose(1, 2)  # [B, patches, C p p]
        x = F.linear(x, w["patch_w"], w["patch_b"])
        if w["cls"] is not None:
            x = torch.cat([w["cls"].expand(b, 1, -1), x], dim=1)
        x = x + w["pos"]
        if self.pre_ln is not None:
            x = F.layer_norm(x, (c.hidden_size,), *self.pre_ln, eps=c.layer_norm_eps)
        states = [x]
        n, hd = x.shape[1], c.head_dim
        for lw in self.layers:
            h = F.layer_norm(x, (c.hidden_size,), lw["ln1_w"], lw["ln1_b"], c.layer_norm_eps)
            q, k, v = (F.linear(h, lw[f"w{n_}"], lw[f"b{n_}"]).view(b, n, c.num_heads, hd)
                       .transpose(1, 2) for n_ in "qkv")
            a = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(hd))
            x = x + F.linear(a.transpose(1, 2).reshape(b, n, c.hidden_size), lw["wo"], lw["bo"])
            h = F.layer_norm(x, (c.hidden_size,), lw["ln2_w"], lw["ln2_b"], c.layer_norm_eps)
            x = x + F.linear(_act(c.hidden_act, F.linear(h, lw["fc1_w"], lw["fc1_b"])),
                             lw["fc2_w"], lw["fc2_b"])
            states.append(x)
        feats = [states[f if f >= 0 else c.num_layers + 1 + f] for f in c.feature_layers]
        if c.drop_cls:
            feats = [f[:, 1:] for f in feats]
        y = torch.cat(feats, -1)
        if self.post_ln is not None:
            y = F.layer_norm(y, (c.hidden_size,), *self.post_ln, eps=c.layer_norm_eps)
        if c.connector == "pixel_shuffle":
            y = F.linear(_pixel_shuffle(y, c.scale_factor), w["proj1_w"])
        else:
            y = _act(c.projector_act, F.linear(y, w["proj1_w"], w["proj1_b"]))
            y = F.linear(y, w["proj2_w"], w["proj2_b"])
        return y.to(torch.float32).cpu().numpy()
