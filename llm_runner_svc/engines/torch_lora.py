"""LoRA adapters of the torch engine, in preallocated stacked buffers.

Per engine matrix (q/k/v fused, o, gate/up fused, down; numpy_lora.FUSED) the adapters live
in two buffers claimed once for every slot: A^T [layers, slots + 1, in, M r] (the matrix's M
modules' A^T side by side, each in r = `max_rank` columns) and scale * B^T [layers, slots + 1,
r, out] (each module's B^T over its own output columns). Slot 0 stays zero: the base model.
An adapter of a smaller rank, or without some of the modules, fills the rest with zeros,
which add exact zeros. Loading an adapter into a slot copies into the buffers
(`set`); nothing is reallocated, so captured CUDA graphs keep reading the right memory.

Two ways to run the products, both adding onto the base product of the same rows:
  - `add` (grouped): per adapter present, its rows' (x @ A^T) @ B^T as plain torch products
    (prefill passes; decode steps on the CPU);
  - `add_rows` (graph-safe): each row's adapter slot read from a device tensor, so one
    captured decode graph serves any mix. "triton" (torch_lora_triton.py): a step of up to
    PER_ROW_ROWS rows gathers each row's adapter (shrink into the float32 scratch t, then
    expand), a larger one runs kernels that group rows by adapter, reading each adapter
    once for all its rows; "gather": torch products over each row's gathered matrices (the
    reference of the same path on any device). On the unfused products, "triton" adds
    gate/up's term, applies the SiLU gate and shrinks the result for down in one kernel
    (`gate_rows`).
A decode step of a row or few on the fused products keeps them (Forward.layers): `shrink_rows`
fills t (norming the residual stream first for q/k/v and gate/up, as the product does) and
the product adds each row's t @ B^T inside its epilogue (`LoraTerm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from llm_runner_svc.engines.numpy_lora import FUSED, group_rows
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.lora import LoraAdapter, module_shape
from llm_runner_svc.models.spec import ModelConfig

if TYPE_CHECKING:
    from llm_runner_svc.engines.torch_lora_triton import SlotRows

TorchGroups = Sequence[tuple[int, slice | torch.Tensor]]  # (adapter slot, its rows)
KERNELS = ("grouped", "gather", "triton")


DEFAULT_RANK = 16  # a slot's rank when neither the stage nor the starting adapters say more
# Decode batches of up to this many rows (the fused products' few-row kernel, GEMV_ROWS)
# gather each row's adapter; larger ones read each adapter once for all its rows.
PER_ROW_ROWS = 4


class LoraTerm(NamedTuple):
    """What a fused product needs to add each row's LoRA term (torch_triton_products.py)."""
    t: torch.Tensor  # [n, M r] float32: each row's x @ A^T
    b: torch.Tensor  # [slots + 1, r, out]: the layer's scale * B^T
    idx: torch.Tensor  # [n] int32 adapter slot per row (0: the base model)
    bounds: tuple[int, int]  # output columns where modules 1 and 2 start (out: none)
    rank: int  # r: each module's rank columns in t


class TorchLora:
    """`num_slots` adapter slots (None: one per adapter of `adapters`, which fill slots 1,
    2, ...) of rank up to `max_rank` (None: the largest of `adapters`, at least 16), stored
    in `dtype` on `device`. `kernel`: how `add_rows` runs: "triton", "gather", or
    "grouped" (not used: decode rows run `add` too); "auto": triton on CUDA, else grouped."""

    def __init__(self, cfg: ModelConfig, adapters: Sequence[LoraAdapter | None],
                 device: torch.device, num_slots: int | None = None,
                 max_rank: int | None = None, dtype: torch.dtype = torch.float32,
                 kernel: str = "auto") -> None:
        num_slots = len(adapters) if num_slots is None else num_slots
        if num_slots < len(adapters):
            raise InvalidArgument(f"maxLoras {num_slots} is below the {len(adapters)} "
                                  "adapters loaded at start")
        max_rank = max_rank or max([DEFAULT_RANK, *(a.rank for a in adapters if a)])
        if kernel == "auto":
            kernel = "triton" if device.type == "cuda" else "grouped"
        if kernel not in KERNELS:
            raise InvalidArgument(f"LoRA kernel {kernel!r}: one of {list(KERNELS)}")
        if max_rank <= 0:
            raise InvalidArgument(f"maxLoraRank must be positive, got {max_rank}")
        self.cfg, self.num_slots, self.rank = cfg, num_slots, max_rank
        self.device, self.dtype, self.kernel = device, dtype, kernel
        self.is_per_row = kernel != "grouped"  # decode steps run `add_rows` (graph-safe)
        L, r = cfg.num_layers, max_rank
        self.a: dict[str, torch.Tensor] = {}  # [layers, slots + 1, in, M r]
        self.b: dict[str, torch.Tensor] = {}  # [layers, slots + 1, r, out]
        self.bounds: dict[str, list[int]] = {}  # output column where each module starts
        for name, mods in FUSED.items():
            in_dim = module_shape(cfg, mods[0])[1]
            outs = [module_shape(cfg, m)[0] for m in mods]
            self.a[name] = torch.zeros(L, num_slots + 1, in_dim, len(mods) * r, dtype=dtype,
                                       device=device)
            self.b[name] = torch.zeros(L, num_slots + 1, r, sum(outs), dtype=dtype,
                                       device=device)
            self.bounds[name] = [int(c) for c in np.cumsum([0, *outs])]
        self.max_r_cols = 3 * r  # the widest matrix's M r (q/k/v)
        self.t: torch.Tensor | None = None  # [4 layers, rows, 3 r] float32 (`reserve`)
        self.adapters: list[LoraAdapter | None] = [None] * (num_slots + 1)  # in each slot
        # grouped shrinks run on a side stream beside the base product reading the same
        # input (`shrink_beside`); the expand after the product joins it
        self._side = torch.cuda.Stream(device) if (
            device.type == "cuda" and kernel == "triton") else None
        self._beside = False  # a shrink on the side stream not joined yet
        self._slot_ids = torch.arange(num_slots + 2, dtype=torch.int32, device=device)
        self._rows: SlotRows | None = None  # this forward's rows by slot (`begin_rows`)
        self.nbytes = sum(t.nbytes for t in (*self.a.values(), *self.b.values()))
        for k, adapter in enumerate(adapters, 1):
            if adapter is not None:
                self.set(k, adapter)

    # ---- slots -----------------------------------------------------------------------
    def set(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Copy `adapter` into `slot` (1-based), or zero the slot (None). Stream-ordered on
        CUDA: steps launched before read the old contents."""
        if adapter is not None and adapter.rank > self.rank:
            raise InvalidArgument(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}; "
                                  f"this stage holds adapters of rank up to {self.rank} "
                                  "(maxLoraRank)")
        r, L = self.rank, self.cfg.num_layers
        for name, mods in FUSED.items():
            a_host = np.zeros(self.a[name].shape[2:], np.float32)
            b_host = np.zeros(self.b[name].shape[2:], np.float32)
            for li in range(L):
                a_host[:] = 0.0
                b_host[:] = 0.0
                for j, m in enumerate(mods):
                    pair = None if adapter is None else adapter.layers[li].get(m)
                    if pair is None:
                        continue
                    assert adapter is not None
                    a, b = pair  # [rank, in], [out_m, rank]
                    c0, c1 = self.bounds[name][j], self.bounds[name][j + 1]
                    a_host[:, j * r:j * r + adapter.rank] = a.T
                    b_host[:adapter.rank, c0:c1] = adapter.scale * b.T
                self.a[name][li, slot].copy_(torch.from_numpy(a_host))
                self.b[name][li, slot].copy_(torch.from_numpy(b_host))
        self.adapters[slot] = adapter

    def reserve(self, rows: int) -> int:
        """Claim the per-row path's scratch for forwards of up to `rows` rows; its bytes."""
        if not self.is_per_row:
            return 0
        self.t = torch.zeros(4 * self.cfg.num_layers, rows, self.max_r_cols,
                             dtype=torch.float32, device=self.device)
        return self.t.nbytes

    # ---- grouped products --------------------------------------------------------------
    def groups(self, adapters: Sequence[int], lengths: Sequence[int]) -> TorchGroups:
        """Forward rows by adapter slot for consecutive stretches of `lengths` rows on
        `adapters`; [] when no row names one."""
        out: list[tuple[int, slice | torch.Tensor]] = []
        for k, rows in group_rows(adapters, lengths):
            out.append((k, rows if isinstance(rows, slice)
                        else torch.as_tensor(rows, device=self.device)))
        return out

    def add(self, layer: int, matrix: str, x: torch.Tensor, out: torch.Tensor,
            groups: TorchGroups) -> None:
        """out[rows] += x[rows] @ A^T @ (scale B)^T for each adapter's rows, in float32;
        x [n, in], out [n, out] (any float dtype)."""
        r, bounds = self.rank, self.bounds[matrix]
        for k, rows in groups:
            a, b = self.a[matrix][layer, k], self.b[matrix][layer, k]
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            t = xs.float() @ a.float()  # [rows, M r]
            for j in range(len(bounds) - 1):
                c0, c1 = bounds[j], bounds[j + 1]
                delta = (t[:, j * r:(j + 1) * r] @ b[:, c0:c1].float()).to(out.dtype)
                if isinstance(rows, slice):
                    out[rows, c0:c1] += delta
                else:
                    out[:, c0:c1].index_add_(0, rows, delta)

    # ---- per-row products (graph-safe) ---------------------------------------------------
    def begin_rows(self, idx: torch.Tensor) -> None:
        """Start a forward whose rows are on adapter slots idx [n] int32 (device): zero the
        per-row scratch (one launch for every layer) and, for the Triton kernels, sort the
        rows by slot."""
        assert self.t is not None, "reserve() first"
        n = idx.shape[0]
        self.t[:, :n].zero_()
        self._rows = None
        if self.kernel == "triton":  # `gate_rows` groups rows at any batch size
            from llm_runner_svc.engines.torch_lora_triton import slot_rows

            self._rows = slot_rows(idx, self._slot_ids)

    def _grouped(self) -> SlotRows:
        assert self._rows is not None, "begin_rows() first"
        return self._rows

    def fuses_rows(self, n: int) -> bool:
        """Whether a decode step of n rows may keep its fused products (the LoRA terms
        inside them: `shrink_rows`, then the product with the term)."""
        return self.kernel == "triton" and n <= PER_ROW_ROWS

    def _scratch(self, layer: int, matrix: str, n: int) -> torch.Tensor:
        assert self.t is not None, "reserve() first"
        return self.t[4 * layer + list(FUSED).index(matrix), :n, :self.a[matrix].shape[3]]

    def starts(self, matrix: str) -> tuple[int, int]:
        """The output columns where modules 1 and 2 start (past the last: none)."""
        bounds = self.bounds[matrix]
        ends = [*bounds[1:-1], bounds[-1], bounds[-1]]
        return ends[0], ends[1]

    def shrink_rows(self, layer: int, matrix: str, x: torch.Tensor, idx: torch.Tensor,
                    norm: torch.Tensor | None = None, is_shrunk: bool = False) -> LoraTerm:
        """t[i] = x[i] @ A^T[idx[i]] into the scratch (zeroed by `begin_rows`), x's rows
        RMS-normed and scaled by `norm` first when given (x then the residual stream);
        the term a fused product adds. Triton kernels only. `is_shrunk`: t is filled
        already (`gate_rows`)."""
        from llm_runner_svc.engines.torch_lora_triton import shrink

        t = self._scratch(layer, matrix, x.shape[0])
        if not is_shrunk:
            shrink(x, self.a[matrix][layer], idx, t, norm, self.cfg.rms_eps)
        return LoraTerm(t, self.b[matrix][layer], idx, self.starts(matrix), self.rank)

    def overlaps(self, n: int) -> bool:
        """Whether a decode step of n rows runs its grouped shrinks beside the products
        (`shrink_beside`); else `add_rows` and `gate_rows` shrink in line."""
        return self._side is not None and n > PER_ROW_ROWS and self.num_slots > 0

    def shrink_beside(self, layer: int, matrix: str, x: torch.Tensor,
                      idx: torch.Tensor) -> None:
        """Start the grouped shrink of x (the input of `matrix`'s base product, which may
        run meanwhile) on the side stream, after what the current stream launched; the
        next `add_rows` / `gate_rows` of `matrix` with `is_shrunk` joins it. In a captured
        graph the fork and the join are graph edges."""
        from llm_runner_svc.engines import torch_lora_triton as kernels

        assert self._side is not None
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            kernels.grouped_shrink(x, self.a[matrix][layer], self._grouped(),
                                   self._scratch(layer, matrix, x.shape[0]))
        self._beside = True

    def _join(self) -> None:
        """The current stream waits for the side stream's shrink, if one is pending."""
        if self._beside:
            assert self._side is not None
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._beside = False

    @property
    def fuses_gate(self) -> bool:
        """Whether `gate_rows` can stand for `add_rows` on gate/up and the SiLU gate."""
        return self.kernel == "triton" and self.num_slots > 0

    def gate_rows(self, layer: int, x: torch.Tensor, gate_up: torch.Tensor, out: torch.Tensor,
                  idx: torch.Tensor, is_shrunk: bool = False) -> None:
        """out [n, F] = silu(g) * u for [g | u] = gate_up [n, 2F] + each row's gate/up LoRA
        term of x [n, in]: the expand and the SiLU gate in one kernel, which also shrinks
        out for down (down's `shrink_rows` / `add_rows` then take `is_shrunk`).
        `is_shrunk`: gate/up's shrink ran already (`shrink_beside`)."""
        from llm_runner_svc.engines import torch_lora_triton as kernels

        n = x.shape[0]
        t = self._scratch(layer, "gate_up", n)
        if is_shrunk:
            self._join()
        elif n <= PER_ROW_ROWS:
            self.shrink_rows(layer, "gate_up", x, idx)
        else:
            kernels.grouped_shrink(x, self.a["gate_up"][layer], self._grouped(), t)
        kernels.expand_gate(t, self.b["gate_up"][layer], self._grouped(), gate_up, out,
                            self.a["down"][layer], self._scratch(layer, "down", n))

    def add_rows(self, layer: int, matrix: str, x: torch.Tensor, out: torch.Tensor,
                 idx: torch.Tensor, is_shrunk: bool = False) -> None:
        """out[i] += x[i] @ A^T[idx[i]] @ B^T[idx[i]] for every row i (slot 0: nothing);
        x [n, in], out [n, out], idx [n] int32 on the device. `is_shrunk`: the scratch
        holds x @ A^T already, or will once the side stream is joined (`gate_rows`,
        `shrink_beside`; Triton kernels only)."""
        r, bounds = self.rank, self.bounds[matrix]
        a, b = self.a[matrix][layer], self.b[matrix][layer]
        n = x.shape[0]
        t = self._scratch(layer, matrix, n)
        if self.kernel == "triton":
            from llm_runner_svc.engines import torch_lora_triton as kernels

            if n <= PER_ROW_ROWS:
                self.shrink_rows(layer, matrix, x, idx, is_shrunk=is_shrunk)
                kernels.expand(t, b, idx, out, self.starts(matrix))
            elif self.num_slots > 0:
                if is_shrunk:
                    self._join()
                else:
                    kernels.grouped_shrink(x, a, self._grouped(), t)
                kernels.grouped_expand(t, b, self._grouped(), out, self.starts(matrix),
                                       len(bounds) - 1)
            return
        assert not is_shrunk, "a shrunk scratch comes from the Triton kernels"
        rows = idx.long()
        t.copy_(torch.bmm(x.float().unsqueeze(1), a.index_select(0, rows).float()).squeeze(1))
        bs = b.index_select(0, rows).float()  # [n, r, out]
        for j in range(len(bounds) - 1):
            c0, c1 = bounds[j], bounds[j + 1]
            delta = torch.bmm(t[:, None, j * r:(j + 1) * r], bs[:, :, c0:c1]).squeeze(1)
            out[:, c0:c1] += delta.to(out.dtype)
