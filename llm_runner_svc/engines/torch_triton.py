"""`TritonOps`: the fused GPU kernels behind the same calls as `TorchOps`.

Launch parameters that depend on the batch (how many programs split a row's positions) are
fixed per batch size, so a captured graph replays them unchanged. Partial-result buffers for
split rows are claimed in `reserve()`, before any capture.
"""

from __future__ import annotations

import math

import torch

from llm_runner_svc.engines.torch_ops import Rope, TorchOps
from llm_runner_svc.engines.torch_prefill import PrefillLayout
from llm_runner_svc.engines.torch_triton_kernels import (
    argmax_kernel,
    decode_attention_kernel,
    embed_kernel,
    rms_norm_kernel,
    rope_store_kernel,
    silu_mul_kernel,
)
from llm_runner_svc.engines.torch_triton_prefill import (
    PrefillPartials,
    launch_prefill_attention,
    prefill_block,
)
from llm_runner_svc.engines.torch_triton_products import FusedProducts
from llm_runner_svc.models.spec import ModelConfig, RopeStyle

BLOCK_N = 32  # positions per attention tile
SILU_BLOCK = 1024
ARGMAX_BLOCK = 2048  # logits per argmax program
EMBED_BLOCK = 1024


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (n - 1).bit_length())


class TritonOps(TorchOps):
    def __init__(self, config: ModelConfig, page_size: int, num_sms: int,
                 has_fused_products: bool, split_prefill_keys: bool = True) -> None:
        """`has_fused_products`: the weights are bf16 and the forward may use
        `products` (see torch_triton_products.py). `split_prefill_keys`: short prefill
        passes share each query block's keys among several programs
        (`prefill_splits`)."""
        super().__init__(config, page_size)
        self.num_sms = num_sms
        self.split_prefill_keys = split_prefill_keys
        self._partials: PrefillPartials | None = None
        self.products = FusedProducts(config.rms_eps) if has_fused_products else None
        self._part: torch.Tensor | None = None  # [rows, heads, splits, hd_p] float32
        self._lse: torch.Tensor | None = None  # [rows, heads, splits] float32
        self._counts: torch.Tensor | None = None  # [rows, kv_heads] int32 splits finished
        self._best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # argmax
        self._max_splits = 1
        self._hd_p = _pow2(config.head_dim, 16)

    def split_size(self, num_rows: int, max_seq: int) -> int:
        """Positions per attention program for a batch of `num_rows`: enough programs to
        give every multiprocessor two, never fewer positions than one tile."""
        programs = num_rows * self.config.num_kv_heads
        want_splits = max(1, -(-2 * self.num_sms // programs))
        split = max(BLOCK_N, _pow2(-(-max_seq // want_splits)))
        return -(-split // BLOCK_N) * BLOCK_N

    def reserve(self, max_rows: int, max_seq: int, device: torch.device) -> int:
        """Claim the split partials for batches up to `max_rows`; returns their bytes."""
        c = self.config
        self._max_seq = max_seq
        splits = max(-(-max_seq // self.split_size(b, max_seq)) for b in range(1, max_rows + 1))
        self._max_splits = splits
        self._part = torch.empty((max_rows, c.num_heads, splits, self._hd_p), device=device)
        self._lse = torch.empty((max_rows, c.num_heads, splits), device=device)
        self._counts = torch.zeros((max_rows, c.num_kv_heads), dtype=torch.int32,
                                   device=device)
        chunks = -(-c.vocab_size // ARGMAX_BLOCK)
        self._best = (torch.empty((max_rows, chunks), device=device),
                      torch.empty((max_rows, chunks), dtype=torch.int32, device=device),
                      torch.zeros(max_rows, dtype=torch.int32, device=device))
        if self.split_prefill_keys:
            self._partials = PrefillPartials(c.num_heads, c.head_dim, self.num_sms, device)
        return sum(t.nbytes for t in (self._part, self._lse, self._counts, *self._best)) + (
            self._partials.nbytes if self._partials is not None else 0)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        n, d = x.shape
        block = _pow2(d)
        rms_norm_kernel[(n,)](x, x.stride(0), weight, out, out.stride(0), d,
                              self.config.rms_eps, BLOCK=block,
                              num_warps=8 if block > 2048 else 4)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        n, ffn = out.shape
        silu_mul_kernel[(n, -(-ffn // SILU_BLOCK))](
            gate_up, gate_up.stride(0), out, out.stride(0), ffn, BLOCK=SILU_BLOCK, num_warps=4)

    def rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None) -> None:
        self._rope_store(qkv, positions, slots, k_pool, v_pool, Rope(cos, sin, q_norm, k_norm),
                         first_head=0)

    def store_kv(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, rope: Rope) -> None:
        self._rope_store(qkv, positions, slots, k_pool, v_pool, rope,
                         first_head=self.config.num_heads)

    def _rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, rope: Rope,
                    first_head: int) -> None:
        """The heads from `first_head` on (0: q, k and v; num_heads: k and v only)."""
        c = self.config
        n = qkv.shape[0]
        has_norm = rope.q_norm is not None and rope.k_norm is not None
        rope_store_kernel[(n, c.num_heads + c.num_kv_heads - first_head)](
            qkv, qkv.stride(0), positions, slots, rope.cos, rope.sin, k_pool, v_pool,
            rope.q_norm if has_norm else rope.cos, rope.k_norm if has_norm else rope.cos,
            c.rms_eps, NUM_HEADS=c.num_heads, NUM_KV=c.num_kv_heads, HD=c.head_dim,
            HD_P=self._hd_p, HALF=c.head_dim // 2,
            INTERLEAVED=c.rope_style is RopeStyle.INTERLEAVED, HAS_QK_NORM=has_norm,
            FIRST_HEAD=first_head, num_warps=1)

    def prefill_attention(self, qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          layout: PrefillLayout, out: torch.Tensor) -> None:
        c = self.config
        launch_prefill_attention(qkv, k_pool, v_pool, layout.blocks, layout.tables, out,
                                 c.num_heads, c.num_kv_heads, c.head_dim, self.page_size,
                                 layout.block, partials=self._partials)

    def prefill_block(self, num_tokens: int) -> int:
        return prefill_block(num_tokens)

    ropes_in_decode_attention = True

    def decode_attention(self, qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         positions: torch.Tensor, tables: torch.Tensor, out: torch.Tensor,
                         rope: Rope, stores_kv: bool = True) -> None:
        assert self._part is not None and self._lse is not None, "reserve() first"
        assert self._counts is not None
        c = self.config
        b = qkv.shape[0]
        split = self.split_size(b, self._max_seq)
        num_splits = -(-self._max_seq // split)
        group = c.num_heads // c.num_kv_heads
        has_norm = rope.q_norm is not None and rope.k_norm is not None
        decode_attention_kernel[(b, c.num_kv_heads, num_splits)](
            qkv, qkv.stride(0), k_pool, v_pool, positions, tables, tables.stride(0), out,
            out.stride(0), self._part, self._lse, self._counts, 1.0 / math.sqrt(c.head_dim),
            rope.cos,
            rope.sin, rope.q_norm if has_norm else rope.cos,
            rope.k_norm if has_norm else rope.cos, c.rms_eps, NUM_HEADS=c.num_heads,
            NUM_KV=c.num_kv_heads, GROUP=group, HD=c.head_dim, HD_P=self._hd_p,
            HALF=c.head_dim // 2, PAGE=self.page_size, SPLIT=split,
            NUM_SPLITS=self._max_splits, BLOCK_H=_pow2(group, 16), BLOCK_N=BLOCK_N,
            KV_FP32=k_pool.dtype == torch.float32,
            INTERLEAVED=c.rope_style is RopeStyle.INTERLEAVED, HAS_QK_NORM=has_norm,
            STORE_KV=stores_kv, num_warps=4)

    def argmax(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        assert self._best is not None, "reserve() first"
        n, vocab = logits.shape
        chunks = -(-vocab // ARGMAX_BLOCK)
        argmax_kernel[(n, chunks)](logits, logits.stride(0), vocab, *self._best, out,
                                   NUM_CHUNKS=chunks, CHUNKS_P=_pow2(chunks),
                                   BLOCK=ARGMAX_BLOCK, num_warps=4)

    def embed(self, table: torch.Tensor, ids: torch.Tensor, x: torch.Tensor,
              cap: torch.Tensor | None) -> None:
        n, hidden = x.shape
        embed_kernel[(n, -(-hidden // EMBED_BLOCK))](
            ids, table, x, cap if cap is not None else x, hidden, BLOCK=EMBED_BLOCK,
            CAPTURE=cap is not None, num_warps=4)
