"""LoRA products for the torch engine, grouped by adapter (S-LoRA/Punica style).

The same fused matrices as the numpy engine (numpy_lora.py): per adapter, layer and engine
matrix, A^T [in, R] and scale * B^T [R, out], held float32 on the engine's device. A forward
whose rows name adapters adds, per adapter present, `(x[rows] @ A^T) @ B^T` onto the base
product of its rows, as eager torch operations: such a forward runs eagerly (on CUDA it
bypasses the captured graphs and the fused products, which know nothing of adapters).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_runner_svc.engines.numpy_lora import FUSED, Fused, fuse_matrices, group_rows
from llm_runner_svc.models.lora import LoraAdapter
from llm_runner_svc.models.spec import ModelConfig

_TorchFused = tuple[torch.Tensor, list[tuple[slice, slice, torch.Tensor]]]
TorchGroups = Sequence[tuple[int, slice | torch.Tensor]]  # (adapter index, its rows)


class TorchLora:
    """The adapters' fused matrices on `device`; adapter k (1-based) is `adapters[k - 1]`."""

    def __init__(self, cfg: ModelConfig, adapters: Sequence[LoraAdapter],
                 device: torch.device) -> None:
        self.device = device

        def put(fused: Fused | None) -> _TorchFused | None:
            if fused is None:
                return None
            return (torch.as_tensor(fused[0], device=device),
                    [(rs, cs, torch.as_tensor(b, device=device)) for rs, cs, b in fused[1]])

        # _mats[k - 1][layer][matrix] = (A^T [in, R], per module (rank columns, output
        # columns, scale * B^T [r, out_m])) float32, or None
        self._mats = [[{name: put(fuse_matrices(cfg, a, i, mods)) for name, mods in FUSED.items()}
                       for i in range(cfg.num_layers)] for a in adapters]
        self.nbytes = sum(f[0].nbytes + sum(b.nbytes for _, _, b in f[1])
                          for per in self._mats for layer in per for f in layer.values()
                          if f is not None)

    def groups(self, adapters: Sequence[int], lengths: Sequence[int]) -> TorchGroups:
        """Forward rows by adapter for consecutive stretches of `lengths` rows on
        `adapters`; [] when no row names one (the forward may then run as captured)."""
        out: list[tuple[int, slice | torch.Tensor]] = []
        for k, rows in group_rows(adapters, lengths):
            out.append((k, rows if isinstance(rows, slice)
                        else torch.as_tensor(rows, device=self.device)))
        return out

    def add(self, layer: int, matrix: str, x: torch.Tensor, out: torch.Tensor,
            groups: TorchGroups) -> None:
        """out[rows] += x[rows] @ A^T @ (scale B)^T for each adapter's rows, in float32;
        x [n, in], out [n, out] (any float dtype)."""
        for k, rows in groups:
            mats = self._mats[k - 1][layer][matrix]
            if mats is None:
                continue
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            t = xs.float() @ mats[0]  # [rows, R]
            for rank_cols, out_cols, b_t in mats[1]:
                delta = (t[:, rank_cols] @ b_t).to(out.dtype)
                if isinstance(rows, slice):
                    out[rows, out_cols] += delta
                else:
                    out[:, out_cols].index_add_(0, rows, delta)
