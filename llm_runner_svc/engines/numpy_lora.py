"""LoRA products for the numpy engine, grouped by adapter (S-LoRA/Punica style).

Each row of a pass runs with its own adapter (0 = none). The base product runs once over all
rows; then, per adapter present in the pass, its rows take `(x @ A^T) @ (scale B)^T` added
onto the base output. The adapter's A of the modules fused in one engine matrix (q/k/v,
gate/up) are fused too (A^T side by side [in, sum r]: one product), while each module's B^T
multiplies its own rank columns into its own output columns: a block-diagonal fused B^T would
read its zero blocks on every step (a third more adapter bytes, docs/benchmarks.md).
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
# (A^T [in, R], [(rank columns, output columns, scale * B^T [r, out_m]) per module])
Fused = tuple[np.ndarray, list[tuple[slice, slice, np.ndarray]]]


def fuse_matrices(cfg: ModelConfig, adapter: LoraAdapter, layer: int,
                  modules: Sequence[str]) -> Fused | None:
    """(A^T [in, R] of the targeted `modules` side by side, and per targeted module its rank
    columns of A^T, its output columns and scale * B^T [r, out_m])."""
    pairs = [(m, adapter.layers[layer].get(m)) for m in modules]
    if all(p is None for _, p in pairs):
        return None
    in_dim = module_shape(cfg, modules[0])[1]
    total_r = sum(adapter.rank for _, p in pairs if p is not None)
    a_t = np.zeros((in_dim, total_r), np.float32)
    parts = []
    r0 = c0 = 0
    r = adapter.rank
    for m, p in pairs:
        out_dim = module_shape(cfg, m)[0]
        if p is not None:
            a, b = p
            a_t[:, r0:r0 + r] = a.T
            parts.append((slice(r0, r0 + r), slice(c0, c0 + out_dim),
                          np.ascontiguousarray(adapter.scale * b.T, np.float32)))
            r0 += r
        c0 += out_dim
    return a_t, parts


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
    """The adapters' fused matrices in `num_slots` slots; a row's adapter k (1-based) runs
    with the adapter set into slot k (`set`)."""

    def __init__(self, cfg: ModelConfig, num_slots: int) -> None:
        self.cfg = cfg
        self.num_slots = num_slots
        # _mats[k - 1][layer][matrix] = (A^T, B^T) or None; None for an empty slot
        self._mats: list[list[dict[str, Fused | None]] | None] = [None] * num_slots

    def set(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put `adapter` into `slot` (1-based), or empty it (None)."""
        cfg = self.cfg
        self._mats[slot - 1] = None if adapter is None else [
            {name: fuse_matrices(cfg, adapter, i, mods) for name, mods in FUSED.items()}
            for i in range(cfg.num_layers)]

    def grow(self, num_slots: int) -> None:
        """Empty slots up to `num_slots`."""
        self._mats.extend([None] * (num_slots - self.num_slots))
        self.num_slots = max(self.num_slots, num_slots)

    def has(self, slot: int) -> bool:
        return self._mats[slot - 1] is not None

    def add(self, layer: int, matrix: str, x: np.ndarray, out: np.ndarray,
            groups: Groups) -> None:
        """out[rows] += x[rows] @ A^T @ (scale B)^T for each adapter's rows; x [n, in],
        out [n, out]."""
        for k, rows in groups:
            per_layer = self._mats[k - 1]
            mats = None if per_layer is None else per_layer[layer][matrix]
            if mats is None:
                continue
            t = x[rows] @ mats[0]  # [rows, R]
            for rank_cols, out_cols, b_t in mats[1]:
                out[rows, out_cols] += t[:, rank_cols] @ b_t
