"""The torch engine's elementwise and attention steps written with plain torch operations.

These run on the CPU (the float32 engine) and on any device as the reference the fused GPU
kernels (`torch_triton.py`) are checked against; `TritonOps` overrides them one for one.
Every step computes in float32 and rounds once into its output buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from llm_runner_svc.engines.torch_prefill import PrefillLayout
from llm_runner_svc.models.spec import ModelConfig, RopeStyle


def rope_tables(max_seq: int, head_dim: int, theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq, head_dim / 2] float32, angle = pos * theta^(-2i / head_dim);
    computed in float64 like the numpy engine's tables, then rounded."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (angles.cos().to(device, torch.float32).contiguous(),
            angles.sin().to(device, torch.float32).contiguous())


def pool_slots(positions: torch.Tensor, tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool row of each position: tables [n, pages] int32, positions [n] -> [n] int64."""
    pages = tables.gather(1, (positions // page_size)[:, None].to(torch.int64))[:, 0]
    return pages.to(torch.int64) * page_size + positions % page_size


@dataclass(frozen=True)
class Rope:
    """What rotating one layer's new q and k takes: the tables and the q/k norm weights."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class TorchOps:
    """Reference implementations; see the module docstring."""

    ropes_in_decode_attention = False  # rope_store runs before decode_attention
    products: Any = None  # the fused products (TritonOps with bf16 weights), else None

    def __init__(self, config: ModelConfig, page_size: int) -> None:
        self.config = config
        self.page_size = page_size

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        """out = x * weight / sqrt(mean(x^2) + eps) over the last axis; x [n, d] float32."""
        xf = x.float()
        inv = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.config.rms_eps)
        out.copy_(xf * inv * weight)

    def embed(self, table: torch.Tensor, ids: torch.Tensor, x: torch.Tensor,
              cap: torch.Tensor | None) -> None:
        """x [n, hidden] float32 = table rows of ids [n]; the same into cap when given."""
        if table.dtype == x.dtype:
            torch.index_select(table, 0, ids, out=x)
        else:  # the bf16 reference ops: a temporary, off the CUDA-graph path
            x.copy_(table.index_select(0, ids))
        if cap is not None:
            cap.copy_(x)

    def argmax(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """out [n] = the first index of each row's largest logit."""
        torch.argmax(logits, dim=-1, out=out)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """out = silu(gate) * up; gate_up [n, 2 ffn] holds gate then up."""
        ffn = out.shape[-1]
        gate, up = gate_up[:, :ffn].float(), gate_up[:, ffn:].float()
        out.copy_(gate / (1.0 + torch.exp(-gate)) * up)

    def rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None) -> None:
        """Normalize (q/k norm models) and rotate q of qkv [n, q + 2 kv] in place; write the
        rotated k and the v at pool rows slots [n] (int64). positions [n].
        (The k part of qkv is left undefined.)"""
        c = self.config
        n = qkv.shape[0]
        heads = c.num_heads + c.num_kv_heads
        qk = qkv[:, :c.q_dim + c.kv_dim].view(n, heads, c.head_dim)
        norm = (torch.cat([q_norm.expand(c.num_heads, -1), k_norm.expand(c.num_kv_heads, -1)])
                if q_norm is not None and k_norm is not None else None)
        qk.copy_(self._rotated(qk.float(), positions, cos, sin, norm))
        k_pool.index_copy_(0, slots, qkv[:, c.q_dim:c.q_dim + c.kv_dim])
        v_pool.index_copy_(0, slots, qkv[:, c.q_dim + c.kv_dim:])

    def store_kv(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, rope: Rope) -> None:
        """`rope_store`'s k and v only: the k of qkv [n, q + 2 kv] normalized (q/k norm
        models) and rotated into k_pool rows slots [n] (int64), the v into v_pool; qkv is
        left as it is (a decode attention that rotates q itself reads it)."""
        c = self.config
        n = qkv.shape[0]
        k = qkv[:, c.q_dim:c.q_dim + c.kv_dim].view(n, c.num_kv_heads, c.head_dim).float()
        norm = rope.k_norm.expand(c.num_kv_heads, -1) if rope.k_norm is not None else None
        rotated = self._rotated(k, positions, rope.cos, rope.sin, norm)
        k_pool.index_copy_(0, slots, rotated.reshape(n, c.kv_dim).to(k_pool.dtype))
        v_pool.index_copy_(0, slots, qkv[:, c.q_dim + c.kv_dim:])

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """Heads x [n, heads, head_dim] float32 at positions [n], RMS-normalized per head by
        `norm` [heads, head_dim] first when given, then rotated."""
        c = self.config
        if norm is not None:
            inv = torch.rsqrt(x.square().mean(-1, keepdim=True) + c.rms_eps)
            x = x * inv * norm
        cs, sn = cos[positions][:, None, :], sin[positions][:, None, :]  # [n, 1, hd/2]
        half = c.head_dim // 2
        if c.rope_style is RopeStyle.INTERLEAVED:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * cs - b * sn, b * cs + a * sn], dim=-1).flatten(-2)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cs - b * sn, b * cs + a * sn], dim=-1)

    def decode_attention(self, qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         positions: torch.Tensor, tables: torch.Tensor, out: torch.Tensor,
                         rope: Rope, stores_kv: bool = True) -> None:
        """One query per row over that row's positions 0..pos, read page by page.
        qkv [b, q + 2 kv], positions [b], tables [b, pages], out [b, q_dim]. `rope` and
        `stores_kv` serve implementations that rotate q and k and store the new k and v
        themselves (`ropes_in_decode_attention`; `stores_kv` False: `store_kv` has stored
        them); here `rope_store` has done both."""
        c, ps = self.config, self.page_size
        b = qkv.shape[0]
        num_pages = int(positions.max()) // ps + 1
        span = num_pages * ps
        rows = (tables[:, :num_pages, None].to(torch.int64) * ps
                + torch.arange(ps, device=tables.device)).reshape(-1)  # [b * span]
        g = c.num_heads // c.num_kv_heads
        keys = k_pool.index_select(0, rows).view(b, span, c.num_kv_heads, c.head_dim).float()
        vals = v_pool.index_select(0, rows).view(b, span, c.num_kv_heads, c.head_dim).float()
        q = qkv[:, :c.q_dim].float().view(b, c.num_kv_heads, g, c.head_dim)
        scores = q @ keys.permute(0, 2, 3, 1) / math.sqrt(c.head_dim)  # [b, kv, g, span]
        hidden = torch.arange(span, device=qkv.device)[None, :] > positions[:, None]
        scores.masked_fill_(hidden[:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out.copy_((probs @ vals.permute(0, 2, 1, 3)).reshape(b, c.q_dim))

    def prefill_attention(self, qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          layout: PrefillLayout, out: torch.Tensor) -> None:
        """Causal attention of every chunk of a staged prefill batch: the q of qkv
        [T, q + 2 kv] (rotated, its k and v already in the pool) over each chunk's pool rows
        0 .. its last position; out [T, q_dim]. One chunk at a time, in float32."""
        c = self.config
        for i, (first, n, start) in enumerate(layout.spans):
            q = qkv[first:first + n, :c.q_dim]
            end = start + n
            pages = layout.tables[i, :(end - 1) // self.page_size + 1]
            rows = (pages[:, None] * self.page_size
                    + torch.arange(self.page_size, device=q.device)).reshape(-1)
            span = rows.shape[0]
            keys = k_pool.index_select(0, rows).view(span, c.num_kv_heads, c.head_dim).float()
            vals = v_pool.index_select(0, rows).view(span, c.num_kv_heads, c.head_dim).float()
            positions = layout.positions[first:first + n]
            visible = torch.arange(span, device=q.device)[None, :] <= positions[:, None]
            qh = q.float().view(n, c.num_heads, c.head_dim).transpose(0, 1)  # [heads, n, hd]
            res = F.scaled_dot_product_attention(
                qh[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
                attn_mask=visible[None, None], scale=1.0 / math.sqrt(c.head_dim),
                enable_gqa=True)
            out[first:first + n].copy_(res[0].transpose(0, 1).reshape(n, c.q_dim))

    def prefill_block(self, num_tokens: int) -> int:
        """Queries per attention block of a prefill batch of `num_tokens` (a layout's
        blocks; the reference ops attend a chunk at a time and ignore them)."""
        return 64


