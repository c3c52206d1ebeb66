"""Duplicate-aware visual token pruning (DART style), after the encoder, before prefill.

An image's tokens are redundant when they say what a few pivot tokens already say. Per
image: the pivots are the `pivot_image_tokens` image tokens and the `pivot_text_tokens`
prompt text tokens of largest L2 norm (embedding space, ties to the earlier token); each other
image token scores its largest cosine similarity to a pivot; the image pivots are kept, and
of the rest those least similar to the pivots, until round(N x (1 - reduction_ratio)) tokens
are kept (never fewer than `min_visual_tokens`, the pivots or 1; never more than N). Kept
tokens keep their order; the prompt is then the text and the kept tokens, one position each,
in order (positions stay consecutive: a pruned token leaves no gap).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_runner_svc.errors import Unimplemented

ALGORITHMS = ("dart",)


@dataclass(frozen=True)
class PruningConfig:
    """config.visual_pruning (runner_keys checks the types and ranges)."""

    reduction_ratio: float = 0.5
    min_visual_tokens: int = 1
    pivot_image_tokens: int = 4
    pivot_text_tokens: int = 4

    @classmethod
    def from_keys(cls, raw: Mapping[str, Any]) -> PruningConfig:
        algorithm = raw.get("algorithm", "dart")
        if algorithm not in ALGORITHMS:
            raise Unimplemented(f"config.visual_pruning.algorithm {algorithm!r}: this build "
                                f"has {', '.join(ALGORITHMS)}")
        d = cls()
        return cls(float(raw.get("reduction_ratio", d.reduction_ratio)),
                   int(raw.get("min_visual_tokens", d.min_visual_tokens)),
                   int(raw.get("pivot_image_tokens", d.pivot_image_tokens)),
                   int(raw.get("pivot_text_tokens", d.pivot_text_tokens)))

    def num_kept(self, n: int) -> int:
        """Tokens kept of an image of `n` (before the pivot floor)."""
        keep = int(round(n * (1.0 - self.reduction_ratio)))
        return min(n, max(keep, self.min_visual_tokens, 1))


def _largest(norms: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, ties to the lower index."""
    return np.argsort(-norms, kind="stable")[:k]


def prune(visual: np.ndarray, text: np.ndarray, cfg: PruningConfig) -> np.ndarray:
    """The kept indices (ascending) of one image's tokens `visual` [N, hidden], given the
    prompt's text token embeddings `text` [M, hidden]."""
    n = len(visual)
    v = visual.astype(np.float64)
    img_pivots = _largest(np.linalg.norm(v, axis=1), min(cfg.pivot_image_tokens, n))
    t = text.astype(np.float64)
    txt_pivots = _largest(np.linalg.norm(t, axis=1), min(cfg.pivot_text_tokens, len(t)))
    pivots = np.concatenate([v[img_pivots], t[txt_pivots]])
    keep = max(cfg.num_kept(n), len(img_pivots))
    unit = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    punit = pivots / np.maximum(np.linalg.norm(pivots, axis=1, keepdims=True), 1e-12)
    score = (unit @ punit.T).max(axis=1)  # [N] closeness to the nearest pivot
    rest = np.setdiff1d(np.arange(n), img_pivots)
    chosen = rest[np.argsort(score[rest], kind="stable")[:keep - len(img_pivots)]]
    return np.sort(np.concatenate([img_pivots, chosen]))
