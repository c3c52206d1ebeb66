"""LoRA products for the numpy engine, grouped by adapter (S-LoRA/Punica style).

Each row of a pass runs with its own adapter (0 = none). The base product runs once over all
rows; then, per adapter present in the pass, its rows take `(x @ A^T) @ (scale B)^T` added
onto the base output. The adapter's A and B of the modules fused in one engine matrix (q/k/v,
gate/up) are fused too: A^T side by side [in, sum r], B^T block-diagonal [sum r, out], so each
fused matrix costs two small products per adapter present, whatever the modules targeted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llm_runner_svc.models.lora import LoraAdapter, module_shape
from llm_runner_svc.models.spec import ModelConfig

# engine matrix -> the PEFT modules fused in it, in output order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}

Groups = list[tuple[int, slice | np.ndarray]]  # (adapter index, its rows)


def fuse_matrices(cfg: ModelConfig, adapter: LoraAdapter, layer: int,
          modules: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """(A^T [in, R], scale * B^T block-diagonal [R, out]) of the targeted `modules`."""
    pairs = [(m, adapter.layers[layer].get(m)) for m in modules]
    if all(p is None for _, p in pairs):
        return None
    in_dim = module_shape(cfg, modules[0])[1]
    total_out = sum(module_shape(cfg, m)[0] for m in modules)
    total_r = sum(adapter.rank for _, p in pairs if p is not None)
    a_t = np.zeros((in_dim, total_r), np.float32)
    b_t = np.zeros((total_r, total_out), np.float32)
    r0 = c0 = 0
    for m, p in pairs:
        out_dim = module_shape(cfg, m)[0]
        if p is not None:
            a, b = p
            a_t[:, r0:r0 + adapter.rank] = a.T
            b_t[r0:r0 + adapter.rank, c0:c0 + out_dim] = adapter.scale * b.T
            r0 += adapter.rank
        c0 += out_dim
    return a_t, b_t


def group_rows(adapters: Sequence[int], lengths: Sequence[int]) -> Groups:
    """Rows by adapter for consecutive stretches of `lengths` rows on `adapters` (rows of
    adapter 0 left out); rows all on one adapter are one slice."""
    if not any(adapters):
        return []
    ids = np.repeat(np.asarray(adapters, dtype=np.int64), lengths)  # [n]
    present = np.unique(ids)
    if present.size == 1:
        return [(int(present[0]), slice(0, ids.shape[0]))]
    return [(int(k), np.flatnonzero(ids == k)) for k in present if k]


class LoraProducts:
    """The adapters' fused matrices; adapter k (1-based) is `adapters[k - 1]`."""

    def __init__(self, cfg: ModelConfig, adapters: Sequence[LoraAdapter]) -> None:
        self.num_adapters = len(adapters)
        # _mats[k - 1][layer][matrix] = (A^T, B^T) or None
        self._mats = [[{name: fuse_matrices(cfg, a, i, mods) for name, mods in FUSED.items()}
                       for i in range(cfg.num_layers)] for a in adapters]

    def add(self, layer: int, matrix: str, x: np.ndarray, out: np.ndarray,
            groups: Groups) -> None:
        """out[rows] += x[rows] @ A^T @ (scale B)^T for each adapter's rows; x [n, in],
        out [n, out]."""
        for k, rows in groups:
            mats = self._mats[k - 1][layer][matrix]
            if mats is not None:
                out[rows] += (x[rows] @ mats[0]) @ mats[1]
