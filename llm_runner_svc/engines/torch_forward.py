"""The decoder forward of the torch engine over its run state: one code path for CPU and GPU,
for prefill windows and decode batches. Nothing here allocates on the device: every result
lands in a `RunState` buffer, so a decode step can be captured as a CUDA graph.

The residual stream stays float32 whatever the compute dtype: each branch's product is
accumulated into it in float32 (`addmm` with a float32 output where the device has it), so
bf16 rounding enters once per product instead of compounding across layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm_runner_svc.engines.torch_ops import TorchOps, prefill_attention
from llm_runner_svc.engines.torch_state import RunState
from llm_runner_svc.engines.torch_weights import TorchWeights
from llm_runner_svc.models.spec import ModelConfig

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


class Forward:
    def __init__(self, config: ModelConfig, weights: TorchWeights, ops: TorchOps,
                 state: RunState, hidden_layer: int | None, page_size: int,
                 has_f32_products: bool) -> None:
        self.config = config
        self.weights = weights
        self.ops = ops
        self.s = state
        self.hidden_layer = hidden_layer
        self.page_size = page_size
        self.has_f32_products = has_f32_products

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
        torch.index_select(self.weights.embedding, 0, ids, out=self.s.h[:n])
        self.s.x[:n].copy_(self.s.h[:n])
        if capture:
            self.s.cap_emb[:n].copy_(self.s.x[:n])

    def layers(self, n: int, positions: torch.Tensor, tables: torch.Tensor, attend: Attend,
               capture: bool) -> None:
        """Every decoder layer over residual rows 0..n-1 at `positions` [n] whose pool pages
        are tables [n, pages]."""
        s, ops = self.s, self.ops
        x, h, qkv, attn = s.x[:n], s.h[:n], s.qkv[:n], s.attn[:n]
        gate_up, act = s.gate_up[:n], s.act[:n]
        for li, lw in enumerate(self.weights.layers):
            ops.rms_norm(x, lw.attn_norm, h)
            if lw.qkv_bias is not None:
                torch.addmm(lw.qkv_bias, h, lw.qkv.t(), out=qkv)
            else:
                torch.mm(h, lw.qkv.t(), out=qkv)
            ops.rope_store(qkv, positions, tables, s.cos, s.sin, s.k_pool[li], s.v_pool[li],
                           lw.q_norm, lw.k_norm)
            attend(li, qkv, attn)
            self._accumulate(x, attn, lw.wo)
            ops.rms_norm(x, lw.ffn_norm, h)
            torch.mm(h, lw.gate_up.t(), out=gate_up)
            ops.silu_mul(gate_up, act)
            self._accumulate(x, act, lw.down)
            if capture and self.hidden_layer == li + 1:
                s.cap_state[:n].copy_(x)
        if capture and self.hidden_layer == -1:
            ops.rms_norm(x, self.weights.final_norm, s.cap_state[:n])

    def head(self, first: int, n: int) -> None:
        """Logits rows 0..n-1 from residual rows first..first+n-1."""
        h = self.s.h[first:first + n]
        self.ops.rms_norm(self.s.x[first:first + n], self.weights.final_norm, h)
        self._to_float32(h, self.weights.lm_head, self.s.logits[:n])

    def decode(self, batch: int, ids: torch.Tensor, positions: torch.Tensor,
               tables: torch.Tensor, capture: bool) -> None:
        """One decode step of `batch` rows, then their greedy picks (the graph body)."""
        s = self.s

        def attend(li: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
            self.ops.decode_attention(qkv, s.k_pool[li], s.v_pool[li], positions, tables, out)

        self.embed(ids, batch, capture)
        self.layers(batch, positions, tables, attend, capture)
        self.head(0, batch)
        torch.argmax(s.logits[:batch], dim=-1, out=s.next_ids[:batch])

    def prefill_chunk(self, n: int, start: int, capture: bool) -> None:
        """Positions start..start+n-1 of the request whose ids and page table are staged in
        `prefill_ids` and `prefill_table`."""
        s, c = self.s, self.config
        positions = s.arange[start:start + n]
        table = s.prefill_table.expand(n, -1)

        def attend(li: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
            prefill_attention(c, qkv[:, :c.q_dim], s.k_pool[li], s.v_pool[li], positions,
                              start + n, s.prefill_table[0], self.page_size, out)

        self.embed(s.prefill_ids[:n], n, capture)
        self.layers(n, positions, table, attend, capture)
