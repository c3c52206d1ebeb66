"""The decoder forward of the torch engine over its run state: one code path for CPU and GPU,
for prefill batches and decode batches. Nothing on the decode path allocates on the device:
every result lands in a `RunState` buffer, so a decode step can be captured as a CUDA graph.

The residual stream stays float32 whatever the compute dtype: each branch's product is
accumulated into it in float32 (`addmm` with a float32 output where the device has it), so
bf16 rounding enters once per product instead of compounding across layers. Which products
also keep float32 activations (the fused products) depends on the rows: see `fuses`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llm_runner_svc.engines.torch_lora import LoraTerm, TorchGroups, TorchLora
from llm_runner_svc.engines.torch_ops import Rope, TorchOps, pool_slots
from llm_runner_svc.engines.torch_prefill import PrefillLayout
from llm_runner_svc.engines.torch_state import RunState
from llm_runner_svc.engines.torch_triton_modes import ACCUMULATE, SILU_GATE, STORE
from llm_runner_svc.engines.torch_weights import TorchWeights
from llm_runner_svc.models.spec import ModelConfig

if TYPE_CHECKING:  # (CUDA only)
    from llm_runner_svc.engines.torch_triton_short import ShortProducts

Attend = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, qkv, out)


def has_float32_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `mm`/`addmm` can write a float32 result from `dtype` operands here."""
    if dtype == torch.float32:
        return True
    if device.type != "cuda":
        return False
    a = torch.randn(4, 32, device=device).to(dtype)
    w = torch.randn(8, 32, device=device).to(dtype)
    x = torch.randn(4, 8, device=device)
    want = x + a.float() @ w.float().t()
    try:
        torch.addmm(x, a, w.t(), out_dtype=torch.float32, out=x)
    except (RuntimeError, TypeError):
        return False
    return bool(torch.allclose(x, want, rtol=1e-3, atol=1e-3))


def _unfused(w: torch.Tensor, mode: int) -> bool:
    return False


@contextmanager
def _cublaslt(prefer: bool) -> Iterator[None]:
    """With `prefer`, cuBLAS products go through cuBLASLt inside the block (a short pass's:
    measured on an H100 at the 7B shape and 50 rows, down's product onto the residual took
    50.5 us a layer there against 54.6 on the default cuBLAS, which adds a split-K reduction
    kernel; q/k/v, o and gate/up took the same). A captured graph keeps the kernels chosen."""
    if not prefer:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class Forward:
    def __init__(self, config: ModelConfig, weights: TorchWeights, ops: TorchOps,
                 state: RunState, hidden_layer: int | None, page_size: int,
                 has_f32_products: bool, fused_rows: int = 0,
                 fused_prefill_rows: int = 0, lora: TorchLora | None = None,
                 short: ShortProducts | None = None, short_rows: int = 0) -> None:
        """`short`: the short passes' products, for prefill passes of up to `short_rows`
        tokens that keep no float32 activations (`prefill`); such a pass's other products
        run on cuBLASLt."""
        self.config = config
        self.lora = lora  # the LoRA adapters rows may name
        if lora is not None:  # the per-row products' scratch, for a decode batch
            lora.reserve(state.logits.shape[0])
        self.weights = weights
        self.ops = ops
        self.s = state
        self.hidden_layer = hidden_layer
        self.page_size = page_size
        self.has_f32_products = has_f32_products
        self.products = ops.products
        self.fused_rows = fused_rows
        self.fused_prefill_rows = fused_prefill_rows
        self.short, self.short_rows = short, short_rows if short is not None else 0
        self._ropes = [Rope(state.cos, state.sin, lw.q_norm, lw.k_norm) for lw in weights.layers]

    # ---- products --------------------------------------------------------------------
    def _accumulate(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
        """x [n, out] float32 += a [n, in] @ w[out, in].T"""
        if a.dtype == torch.float32:
            torch.addmm(x, a, w.t(), out=x)
        elif self.has_f32_products:
            torch.addmm(x, a, w.t(), out_dtype=torch.float32, out=x)
        else:
            tmp = self.s.wide[:x.numel()].view(x.shape)
            torch.mm(a, w.t(), out=tmp)
            x.add_(tmp)

    def _to_float32(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """out [n, out] float32 = a @ w.T"""
        if a.dtype == torch.float32:
            torch.mm(a, w.t(), out=out)
        elif self.has_f32_products:
            torch.mm(a, w.t(), out_dtype=torch.float32, out=out)
        else:
            tmp = self.s.wide[:out.numel()].view(out.shape)
            torch.mm(a, w.t(), out=tmp)
            out.copy_(tmp)

    # ---- the forward -----------------------------------------------------------------
    def embed(self, ids: torch.Tensor, n: int, capture: bool) -> None:
        """Residual rows 0..n-1 = embedding rows of ids [n]."""
        self.ops.embed(self.weights.embedding, ids, self.s.x[:n],
                       self.s.cap_emb[:n] if capture else None)

    def override(self, overrides: Sequence[tuple[int, Any]], capture: bool) -> None:
        """Residual rows that take given input embeddings ((first row, host float32 array
        [k, hidden]) each: an image's) instead of their tokens'."""
        for first, values in overrides:
            rows = slice(first, first + len(values))
            src = torch.from_numpy(np.ascontiguousarray(values))
            self.s.x[rows].copy_(src, non_blocking=False)
            if capture:
                self.s.cap_emb[rows].copy_(src)

    def fuses(self, n: int, is_decode: bool) -> Callable[[torch.Tensor, int], bool]:
        """Which products of a forward of n rows run fused (`TritonOps.products`), as a
        test of (weight, mode): every product of a prefill batch of up to
        `fused_prefill_rows` tokens (float32 activations, on the tensor cores as bf16
        pairs: float32-grade states, at up to twice a bf16 product's work, which a short
        window does not notice: it reads the weights either way); in decode batches of up
        to `fused_rows`, the matrices the fused matrix-vector kernel streams faster than
        cuBLAS plus the norm and SiLU kernels it saves (`FusedProducts.outruns_cublas`).
        Everything else multiplies on cuBLAS, activations in bf16 (a long prefill is
        compute-bound, and there bf16 products run at the tensor cores' full rate)."""
        products = self.products
        limit = self.fused_rows if is_decode else self.fused_prefill_rows
        if products is None or n > limit:
            return lambda w, mode: False
        if not is_decode:
            return lambda w, mode: True
        return products.outruns_cublas

    def layers(self, n: int, positions: torch.Tensor, slots: torch.Tensor | None,
               attend: Attend, capture: bool, fused: Callable[[torch.Tensor, int], bool],
               lora: TorchGroups = (), lora_slots: torch.Tensor | None = None,
               short: ShortProducts | None = None) -> None:
        """Every decoder layer over residual rows 0..n-1 at `positions` [n] whose k and v
        go to pool rows `slots` [n] int64; None: `attend` rotates q and k and stores k and
        v itself. A fused product takes and leaves float32 activations. LoRA products: by
        `lora`, the rows of each adapter (`TorchLora.groups`), or by `lora_slots`, each
        row's adapter slot [n] int32 on the device (`TorchLora.add_rows`, graph-safe).
        A decode step by `lora_slots` of up to `TorchLora.fuses_rows` rows keeps its fused
        products, each row's LoRA term inside them: its rows shrunk first (for q/k/v and
        gate/up from the residual stream, normed by the shrink as the product norms it),
        the product adding the term before its epilogue (before the SiLU for gate/up).
        Otherwise every product runs unfused, the LoRA terms added to its output. `short`
        (rows without LoRA): an unfused product takes the short products' kernel where
        they hold a measured tiling for it (norm, SiLU gate or residual sum inside), else
        cuBLAS with those steps as kernels of their own."""
        s, ops, products = self.s, self.ops, self.products
        adapters = self.lora if (lora or lora_slots is not None) else None

        def add_lora(li: int, matrix: str, inp: torch.Tensor, out: torch.Tensor,
                     is_shrunk: bool = False) -> None:
            assert adapters is not None
            if lora_slots is not None:
                adapters.add_rows(li, matrix, inp, out, lora_slots, is_shrunk)
            else:
                adapters.add(li, matrix, inp, out, lora)

        def term(li: int, matrix: str, inp: torch.Tensor, norm: torch.Tensor | None = None,
                 is_shrunk: bool = False) -> LoraTerm | None:
            """The LoRA term a fused product adds (None without adapters)."""
            if adapters is None:
                return None
            assert lora_slots is not None
            return adapters.shrink_rows(li, matrix, inp, lora_slots, norm, is_shrunk)

        beside = False  # grouped LoRA shrinks on a side stream, beside the base products
        if adapters is not None:
            if lora_slots is None or not adapters.fuses_rows(n):
                fused = _unfused
            if lora_slots is not None:
                adapters.begin_rows(lora_slots)
                beside = adapters.overlaps(n)

        def shrink_beside(li: int, matrix: str, inp: torch.Tensor) -> None:
            if beside:
                assert adapters is not None and lora_slots is not None
                adapters.shrink_beside(li, matrix, inp, lora_slots)

        x, h = s.x[:n], s.h[:n]
        for li, lw in enumerate(self.weights.layers):
            if fused(lw.qkv, STORE):
                assert products is not None
                qkv = s.qkv_f[:n]
                products.norm_product(x, lw.attn_norm, lw.qkv, lw.qkv_bias, qkv,
                                      term(li, "qkv", x, lw.attn_norm))
            else:
                qkv = s.qkv[:n]
                if not (short and short.norm_product(x, lw.attn_norm, lw.qkv, lw.qkv_bias,
                                                     qkv)):
                    ops.rms_norm(x, lw.attn_norm, h)
                    shrink_beside(li, "qkv", h)
                    if short and short.product(h, lw.qkv, lw.qkv_bias, qkv):
                        pass
                    elif lw.qkv_bias is not None:
                        torch.addmm(lw.qkv_bias, h, lw.qkv.t(), out=qkv)
                    else:
                        torch.mm(h, lw.qkv.t(), out=qkv)
                if adapters is not None:
                    add_lora(li, "qkv", h, qkv, beside)
            if slots is not None:
                ops.rope_store(qkv, positions, slots, s.cos, s.sin, s.k_pool[li],
                               s.v_pool[li], lw.q_norm, lw.k_norm)
            o_fused = fused(lw.wo, ACCUMULATE)
            attn = s.attn_f[:n] if o_fused else s.attn[:n]
            attend(li, qkv, attn)
            if o_fused:
                assert products is not None
                products.accumulate(attn, lw.wo, x, term(li, "o", attn))
            elif not (short and short.accumulate(attn, lw.wo, x)):
                shrink_beside(li, "o", attn)
                self._accumulate(x, attn, lw.wo)
                if adapters is not None:
                    add_lora(li, "o", attn, x, beside)
            down_fused = fused(lw.down, ACCUMULATE)
            act = s.act_f[:n] if down_fused else s.act[:n]
            is_shrunk = False
            if fused(lw.gate_up, SILU_GATE):
                assert products is not None
                products.norm_gate(x, lw.ffn_norm, lw.gate_up, act,
                                   term(li, "gate_up", x, lw.ffn_norm))
            elif not (short and short.norm_gate(x, lw.ffn_norm, lw.gate_up, act)):
                ops.rms_norm(x, lw.ffn_norm, h)
                shrink_beside(li, "gate_up", h)
                if short and short.gate(h, lw.gate_up, act):
                    pass
                elif adapters is not None and lora_slots is not None and adapters.fuses_gate:
                    torch.mm(h, lw.gate_up.t(), out=s.gate_up[:n])
                    adapters.gate_rows(li, h, s.gate_up[:n], act, lora_slots, beside)
                    is_shrunk = True  # down's shrink ran with the SiLU gate
                else:
                    torch.mm(h, lw.gate_up.t(), out=s.gate_up[:n])
                    if adapters is not None:
                        add_lora(li, "gate_up", h, s.gate_up[:n])
                    ops.silu_mul(s.gate_up[:n], act)
            if down_fused:
                assert products is not None
                products.accumulate(act, lw.down, x, term(li, "down", act,
                                                          is_shrunk=is_shrunk))
            elif not (short and short.accumulate(act, lw.down, x)):
                self._accumulate(x, act, lw.down)
                if adapters is not None:
                    add_lora(li, "down", act, x, is_shrunk)
            self._stage_state(li + 1, n, capture)
        self._stage_state(-1, n, capture)

    def _stage_state(self, layer: int, n: int, capture: bool) -> None:
        """Stage residual rows 0..n-1 as the hidden states when `layer` is the hidden layer
        (-1: after the final norm, once every layer ran)."""
        if not capture or self.hidden_layer != layer:
            return
        x = self.s.x[:n]
        if layer == -1:
            self.ops.rms_norm(x, self.weights.final_norm, self.s.cap_state[:n])
        else:
            self.s.cap_state[:n].copy_(x)

    def head(self, x: torch.Tensor, fused: Callable[[torch.Tensor, int], bool],
             first: int = 0, out: torch.Tensor | None = None) -> None:
        """Logits rows first .. first+n-1 from residual rows x [n, hidden] float32 (or into
        `out` [n, vocab] float32)."""
        n = x.shape[0]
        logits = self.s.logits[first:first + n] if out is None else out
        if fused(self.weights.lm_head, STORE):
            assert self.products is not None
            self.products.norm_product(x, self.weights.final_norm, self.weights.lm_head, None,
                                       logits)
            return
        h = self.s.h[:n]
        self.ops.rms_norm(x, self.weights.final_norm, h)
        self._to_float32(h, self.weights.lm_head, logits)

    def decode(self, batch: int, ids: torch.Tensor, positions: torch.Tensor,
               tables: torch.Tensor, capture: bool,
               lora: TorchGroups = (), lora_slots: torch.Tensor | None = None,
               stores_first: bool = False) -> None:
        """One decode step of `batch` rows, then their greedy picks (the graph body, with
        no `lora` groups; `lora_slots`: each row's adapter slot, see `layers`).
        `stores_first`: rows may be one sequence's consecutive positions (a verify row run
        as decode rows), each attending to the keys of the rows before it, so every row's
        k and v reach the pool before any row attends: with ops whose decode attention
        stores them (`ropes_in_decode_attention`) a launch of its own stores them first and
        the attention only reads (its programs run in no set order, so a row could read
        another's slot before that row's program wrote it); with the reference ops
        `rope_store` runs before the attention anyway."""
        s = self.s
        ropes_inside = self.ops.ropes_in_decode_attention
        early = stores_first and ropes_inside
        kv_slots = pool_slots(positions, tables, self.page_size) if early else None

        def attend(li: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
            if kv_slots is not None:
                self.ops.store_kv(qkv, positions, kv_slots, s.k_pool[li], s.v_pool[li],
                                  self._ropes[li])
            self.ops.decode_attention(qkv, s.k_pool[li], s.v_pool[li], positions, tables, out,
                                      self._ropes[li], stores_kv=not early)

        fused = self.fuses(batch, is_decode=True)
        slots = None if ropes_inside else pool_slots(positions, tables, self.page_size)
        self.embed(ids, batch, capture)
        self.layers(batch, positions, slots, attend, capture, fused, lora, lora_slots)
        self.head(s.x[:batch], fused)
        self.ops.argmax(s.logits[:batch], s.next_ids[:batch])

    def prefill(self, layout: PrefillLayout, capture: bool,
                lora: TorchGroups = (), overrides: Sequence[tuple[int, Any]] = ()) -> None:
        """Every chunk of a staged prefill batch: their k and v into the pool, causal
        attention over each chunk's pages, and each chunk's last residual row into
        `x_last` at its `dest` row (`head` turns those rows into logits). States of every
        token are staged when `capture`."""
        s, n = self.s, layout.num_tokens

        def attend(li: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
            self.ops.prefill_attention(qkv, s.k_pool[li], s.v_pool[li], layout, out)

        self.embed(layout.ids, n, capture)
        self.override(overrides, capture)
        short = self.short if not lora and n <= self.short_rows else None
        with _cublaslt(short is not None and s.x.is_cuda):
            self.layers(n, layout.positions, layout.slots, attend, capture,
                        self.fuses(n, is_decode=False), lora, short=short)
        s.x_last.index_copy_(0, layout.dest, s.x[:n].index_select(0, layout.last))
