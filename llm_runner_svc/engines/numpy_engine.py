"""The numpy engine: float32 reference decoder on the CPU.

Vectorized over the batch and over heads (GQA as a [kv_heads, group] split, no per-head
loops). Every matrix is stored once, C-contiguous in [in, out] layout, with q/k/v and
gate/up fused so each layer issues four matmuls. [in, out] rather than a transposed view of
[out, in]: for the few-row products of a decode step OpenBLAS runs the contiguous layout up
to 1.7x faster (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from llm_runner_svc.engines.base import (
    EnginePlan,
    check_hidden_layer,
    check_reserve,
    check_token_ids,
    is_same_plan,
)
from llm_runner_svc.engines.batch import Pass, Segment, aligned_pieces, split_prompt
from llm_runner_svc.engines.batched import BatchedEngine
from llm_runner_svc.engines.numpy_attention import Singles, attend_prefill, attend_singles
from llm_runner_svc.engines.numpy_kernels import (
    apply_rope,
    rms_norm,
    rope_tables,
    round_to_bf16,
)
from llm_runner_svc.engines.numpy_lora import Groups, LoraProducts, group_rows
from llm_runner_svc.errors import InvalidArgument
from llm_runner_svc.models.lora import LoraAdapter
from llm_runner_svc.models.spec import ModelConfig, ModelWeights

PROMPT_BLOCK = 16  # rows of a prompt block with a hidden port (at most the page size)


def _in_out(w: np.ndarray) -> np.ndarray:
    """[out, in] weights as a C-contiguous float32 [in, out] copy."""
    return np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)


@dataclass(frozen=True)
class _Layer:
    """One layer's weights as the forward uses them ([in, out] copies, fused matrices)."""

    attn_norm: np.ndarray  # [hidden]
    qkv_t: np.ndarray  # [hidden, q_dim + 2 kv_dim]
    qkv_bias: np.ndarray | None  # [q_dim + 2 kv_dim]
    wo_t: np.ndarray  # [q_dim, hidden]
    ffn_norm: np.ndarray  # [hidden]
    gate_up_t: np.ndarray  # [hidden, 2 ffn]
    down_t: np.ndarray  # [ffn, hidden]
    qk_norm: tuple[np.ndarray, np.ndarray] | None  # ([head_dim], [head_dim])


class NumpyEngine(BatchedEngine):
    name = "numpy"
    supports_embeds = True
    # A CPU step is bound by its products: each prompt token beside 4 decode rows costs
    # about a tenth of a SmolLM2 decode step, so 16 tokens a step keep a long prompt that
    # joins running decodes within 3x a decode step; a long prompt alone reaches its first
    # token about 1.5x later than at 512 (docs/benchmarks.md, bench_runtime.py --stall).
    default_step_tokens = 16

    def __init__(self, config: ModelConfig, weights: ModelWeights,
                 kv_dtype: str = "float32", adapters: Sequence[LoraAdapter] = ()) -> None:
        """`kv_dtype` "bfloat16" rounds keys and values to bf16 as they enter the (float32)
        pool: the storage precision of an engine with a bf16 KV cache, everything else in
        float32, as a reference for such an engine. A row with `adapter` k runs with
        `adapters[k - 1]` (loaded for this model's shape); `reserve_adapters` adds empty
        slots, `set_adapter` fills or empties one."""
        weights.check(config)
        if kv_dtype not in ("float32", "bfloat16"):
            raise InvalidArgument(f"kv_dtype {kv_dtype!r}: 'float32' or 'bfloat16'")
        self._round_kv = kv_dtype == "bfloat16"
        self.num_adapters = len(adapters)
        self._lora = LoraProducts(config, self.num_adapters) if adapters else None
        for k, adapter in enumerate(adapters, 1):
            self.set_adapter(k, adapter)
        self.config = config
        c = config
        self._emb = np.ascontiguousarray(weights.embedding, dtype=np.float32)  # [vocab, hidden]
        head = weights.lm_head if weights.lm_head is not None else weights.embedding
        self._lm_head_t = _in_out(head)  # [hidden, vocab]
        self._final_norm = weights.final_norm.astype(np.float32)
        self._layers: list[_Layer] = []
        for lw in weights.layers:
            qkv = np.concatenate([lw.wq, lw.wk, lw.wv], axis=0)
            gate_up = np.concatenate([lw.w_gate, lw.w_up], axis=0)
            bias = (np.concatenate([lw.bq, lw.bk, lw.bv]).astype(np.float32)
                    if c.has_qkv_bias and lw.bq is not None and lw.bk is not None
                    and lw.bv is not None else None)
            qk_norm = None
            if lw.q_norm is not None and lw.k_norm is not None:
                qk_norm = (lw.q_norm.astype(np.float32), lw.k_norm.astype(np.float32))
            self._layers.append(_Layer(
                attn_norm=lw.attn_norm.astype(np.float32),
                qkv_t=_in_out(qkv),
                qkv_bias=bias,
                wo_t=_in_out(lw.wo),
                ffn_norm=lw.ffn_norm.astype(np.float32),
                gate_up_t=_in_out(gate_up),
                down_t=_in_out(lw.w_down),
                qk_norm=qk_norm,
            ))
        self._plan: EnginePlan | None = None
        self._buffers_bytes = 0
        self.compute_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------
    def preallocate(self, plan: EnginePlan) -> None:
        if is_same_plan(self._plan, plan):
            return
        c = self.config
        check_hidden_layer(c, plan)
        # With a hidden port, published states must not depend on how a prompt was cut
        # into passes: prompt tokens then run by aligned blocks (`_run_block`).
        self._by_blocks = plan.hidden_layer is not None
        self._block = math.gcd(plan.page_size, PROMPT_BLOCK)
        rows = max(plan.max_tokens, self._block)
        qkv_dim = c.q_dim + 2 * c.kv_dim
        # Token-major pool, keys and values side by side as they leave the qkv matmul: page p
        # holds rows p*page_size .. (p+1)*page_size-1, so one row take gathers a request's
        # whole window (about 2x faster than a page-major gather of keys and values apart).
        self._kv_pool = np.zeros((c.num_layers, plan.num_pages * plan.page_size, 2 * c.kv_dim),
                                 np.float32)  # [L, pages * page, (k | v) kv_heads * hd]
        self._x = np.zeros((rows, c.hidden_size), np.float32)  # [rows, hidden] residual
        self._h = np.zeros((rows, c.hidden_size), np.float32)  # [rows, hidden] normed
        self._tmp = np.zeros((rows, c.hidden_size), np.float32)  # [rows, hidden] branch out
        self._qkv = np.zeros((rows, qkv_dim), np.float32)  # [rows, q + 2 kv]
        self._attn = np.zeros((rows, c.q_dim), np.float32)  # [rows, q_dim]
        self._gate_up = np.zeros((rows, 2 * c.intermediate_size), np.float32)
        self._act = np.zeros((rows, c.intermediate_size), np.float32)  # [rows, ffn]
        self._logits = np.zeros((plan.max_batch, c.vocab_size), np.float32)  # [batch, vocab]
        self._cap_emb = np.zeros((rows, c.hidden_size), np.float32)  # hidden-state staging
        self._cap_state = np.zeros((rows, c.hidden_size), np.float32)
        self._cos, self._sin = rope_tables(plan.max_seq, c.head_dim, c.rope_theta)
        self._plan = plan
        self._buffers_bytes = sum(a.nbytes for a in (
            self._kv_pool, self._x, self._h, self._tmp, self._qkv, self._attn,
            self._gate_up, self._act, self._logits, self._cap_emb, self._cap_state,
            self._cos, self._sin))

    def close(self) -> None:
        if self._plan is None:
            return
        for name in ("_kv_pool", "_x", "_h", "_tmp", "_qkv", "_attn", "_gate_up",
                     "_act", "_logits", "_cap_emb", "_cap_state", "_cos", "_sin"):
            delattr(self, name)
        self._plan = None
        self._buffers_bytes = 0
        super().close()

    def memory_bytes(self) -> int:
        return self._buffers_bytes

    # ---- forward ---------------------------------------------------------------------
    def _run(self, p: Pass) -> tuple[np.ndarray, np.ndarray] | None:
        """Without a hidden port, every segment's tokens go through the layers together, so
        the weights are read once per pass. With one, prompt tokens go by aligned blocks
        (`_run_block`) and generated ones as before, their one-token segments together."""
        caps = None
        if p.capture:
            hidden = self.config.hidden_size
            caps = (np.empty((p.num_tokens, hidden), np.float32),
                    np.empty((p.num_tokens, hidden), np.float32))
        if not self._by_blocks:
            self._run_group(p.segments, caps)
            return caps
        singles: list[Segment] = []
        for s in p.segments:
            prompt, generated = split_prompt(s)
            for piece in aligned_pieces(prompt, self._block):
                self._run_block(piece, caps)
            if generated is not None and len(generated.tokens) == 1:
                singles.append(generated)
            elif generated is not None:
                self._run_group([generated], caps)
        if singles:
            self._run_group(singles, caps)
        return caps

    def _run_block(self, piece: Segment, caps: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Prompt tokens of one request inside one aligned block of `_block` positions
        (within one page), run as that whole block: position q sits in row q % block of
        every product, the other rows padding whose KV is not stored, and attention spans
        the block's pages. A prompt token's states, KV and logits are then the same however
        the prompt was cut into chunks or which prefix came from the prefix cache (BLAS
        rounds a row by the row count and the row's place in the product, so those stay
        fixed), at the cost of padded rows for chunks smaller than a block."""
        plan = self._checked_plan()
        ps, b = plan.page_size, self._block
        lo = piece.start % b
        k = len(piece.tokens)
        pos = np.arange(piece.start - lo, piece.start - lo + b)  # [b]
        table = np.asarray(piece.pages, dtype=np.int64)
        real = slice(lo, lo + k)
        slots = table[pos[real] // ps] * ps + pos[real] % ps  # [k] pool rows
        ids = [piece.tokens[0]] * b
        ids[real] = piece.tokens
        self._embed(ids, b)
        self._override(piece, lo)
        groups = self._lora_groups([piece.row], [b])

        def attend(layer: int, q: np.ndarray, kv: np.ndarray) -> None:
            self._store_kv(layer, slots, kv[real])
            self._attn[:b] = attend_prefill(self.config, self._kv_pool[layer], ps, q, table, pos)

        self._run_layers(b, pos, attend, caps is not None, groups)
        if piece.wants_logits:  # one row, as every prompt's last token
            last = lo + k - 1
            h = rms_norm(self._x[last:last + 1], self._final_norm, self.config.rms_eps)
            np.matmul(h, self._lm_head_t, out=self._logits[piece.row:piece.row + 1])
        if caps is not None:
            caps[0][piece.offset:piece.offset + k] = self._cap_emb[real]
            caps[1][piece.offset:piece.offset + k] = self._cap_state[real]

    def _run_group(self, segs: list[Segment],
                   caps: tuple[np.ndarray, np.ndarray] | None) -> None:
        """Segments through every layer: their one-token rows attend together over
        gathered windows, each longer one over its own pages."""
        plan = self._checked_plan()
        ps = plan.page_size
        spans = [np.arange(s.start, s.start + len(s.tokens)) for s in segs]
        tables = [np.asarray(s.pages, dtype=np.int64) for s in segs]
        pos = np.concatenate(spans)  # [n]
        n = pos.shape[0]
        slots = np.concatenate([t[q // ps] * ps + q % ps
                                for t, q in zip(tables, spans, strict=True)])  # [n] pool rows
        at = np.cumsum([0] + [len(s.tokens) for s in segs])  # each segment's first row
        ones = [i for i, s in enumerate(segs) if len(s.tokens) == 1]
        many = [i for i, s in enumerate(segs) if len(s.tokens) > 1]
        single = Singles.build([segs[i] for i in ones], ps) if ones else None
        rows: slice | np.ndarray = slice(0, len(ones)) if not many else at[ones]
        self._embed([t for s in segs for t in s.tokens], n)
        for s, first in zip(segs, at, strict=False):
            self._override(s, int(first))
        groups = self._lora_groups([s.row for s in segs], [len(s.tokens) for s in segs])

        def attend(layer: int, q: np.ndarray, kv: np.ndarray) -> None:
            self._store_kv(layer, slots, kv)
            pool = self._kv_pool[layer]
            if single is not None:
                self._attn[rows] = attend_singles(self.config, pool, q[rows], single)
            for i in many:
                span = slice(int(at[i]), int(at[i + 1]))
                self._attn[span] = attend_prefill(self.config, pool, ps, q[span], tables[i],
                                                  spans[i])

        self._run_layers(n, pos, attend, caps is not None, groups)
        self._verify_heads(segs, at)
        last = [int(at[i + 1]) - 1 for i, s in enumerate(segs) if s.wants_logits and not s.verify]
        out = [s.row for s in segs if s.wants_logits and not s.verify]
        k = len(last)
        if last == out == list(range(k)):  # a plain decode: rows in place, no copies
            rms_norm(self._x[:k], self._final_norm, self.config.rms_eps, out=self._h[:k])
            np.matmul(self._h[:k], self._lm_head_t, out=self._logits[:k])
        elif last:
            h = rms_norm(self._x[last], self._final_norm, self.config.rms_eps)
            self._logits[out] = h @ self._lm_head_t
        if caps is not None:
            dest = np.concatenate([np.arange(s.offset, s.offset + len(s.tokens)) for s in segs])
            caps[0][dest], caps[1][dest] = self._cap_emb[:n], self._cap_state[:n]

    def _verify_heads(self, segs: list[Segment], at: np.ndarray) -> None:
        """Verify rows: the head over their last K + 1 positions in one product (the head
        is read once); the logits of the first K kept for their picks, the last one's as
        usual."""
        for i, s in enumerate(segs):
            if s.verify and s.wants_logits:  # a verify row is never cut across passes
                end = int(at[i + 1])
                h = rms_norm(self._x[end - 1 - s.verify:end], self._final_norm,
                             self.config.rms_eps)
                logits = h @ self._lm_head_t  # [K + 1, vocab]
                self._verified[s.row] = logits[:-1]
                self._logits[s.row] = logits[-1]

    def reserve_adapters(self, num_slots: int, max_rank: int | None = None) -> None:
        check_reserve(self, num_slots, self._plan is not None)
        if self._lora is None:
            self._lora = LoraProducts(self.config, num_slots)
        self._lora.grow(num_slots)
        self.num_adapters = num_slots

    def set_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        self.check_adapter(slot, adapter)
        assert self._lora is not None
        self._lora.set(slot, adapter)

    # ---- internals -------------------------------------------------------------------
    def _lora_groups(self, rows: Sequence[int], lengths: Sequence[int]) -> Groups:
        """The pass rows of each adapter, for consecutive stretches of `lengths` rows from
        batch rows `rows`."""
        if self._lora is None:
            return []
        return group_rows([self._row_adapters[r] for r in rows], lengths)

    def _embed(self, token_ids: Sequence[int], n: int) -> None:
        check_token_ids(self.config, token_ids)
        ids = np.fromiter(token_ids, dtype=np.int64, count=n)
        np.take(self._emb, ids, axis=0, out=self._x[:n])

    def _override(self, seg: Segment, first: int) -> None:
        """Residual rows of `seg` (from row `first`) that an embed span covers take its
        embeddings instead of their tokens'."""
        for offset, values in seg.overrides():
            self._x[first + offset:first + offset + len(values)] = values

    def _run_layers(self, n: int, pos: np.ndarray, attend: Callable[..., None],
                    capture: bool, groups: Groups) -> None:
        """Every decoder layer over rows 0..n-1 of the residual buffer; `groups` the rows
        of each LoRA adapter."""
        lora = self._lora if groups else None
        c = self.config
        x, h, tmp = self._x[:n], self._h[:n], self._tmp[:n]
        qkv, attn = self._qkv[:n], self._attn[:n]
        gate_up, act = self._gate_up[:n], self._act[:n]
        hl = self._plan.hidden_layer if self._plan else None
        if capture:
            self._cap_emb[:n] = x
        cos, sin = self._cos[pos][:, None, :], self._sin[pos][:, None, :]  # [n, 1, hd/2]
        heads = c.num_heads + c.num_kv_heads
        for li, lw in enumerate(self._layers):
            rms_norm(x, lw.attn_norm, c.rms_eps, out=h)
            np.matmul(h, lw.qkv_t, out=qkv)
            if lora is not None:
                lora.add(li, "qkv", h, qkv, groups)
            if lw.qkv_bias is not None:
                qkv += lw.qkv_bias
            qk = qkv[:, :c.q_dim + c.kv_dim].reshape(n, heads, c.head_dim)  # view
            if lw.qk_norm is not None:
                qk[:, :c.num_heads] = rms_norm(qk[:, :c.num_heads], lw.qk_norm[0], c.rms_eps)
                qk[:, c.num_heads:] = rms_norm(qk[:, c.num_heads:], lw.qk_norm[1], c.rms_eps)
            apply_rope(qk, cos, sin, c.rope_style)
            attend(li, qkv[:, :c.q_dim], qkv[:, c.q_dim:])
            np.matmul(attn, lw.wo_t, out=tmp)
            if lora is not None:
                lora.add(li, "o", attn, tmp, groups)
            x += tmp
            rms_norm(x, lw.ffn_norm, c.rms_eps, out=h)
            np.matmul(h, lw.gate_up_t, out=gate_up)
            if lora is not None:
                lora.add(li, "gate_up", h, gate_up, groups)
            gate = gate_up[:, :c.intermediate_size]
            np.negative(gate, out=act)
            np.exp(act, out=act)
            act += 1.0
            np.divide(gate, act, out=act)  # silu(gate) = gate / (1 + exp(-gate))
            act *= gate_up[:, c.intermediate_size:]
            np.matmul(act, lw.down_t, out=tmp)
            if lora is not None:
                lora.add(li, "down", act, tmp, groups)
            x += tmp
            if capture and hl == li + 1:
                self._cap_state[:n] = x
        if capture and hl == -1:
            rms_norm(x, self._final_norm, c.rms_eps, out=self._cap_state[:n])

    def _store_kv(self, layer: int, slots: np.ndarray, kv: np.ndarray) -> None:
        """Keys and values [n, 2 kv_dim] into `layer`'s pool rows `slots` [n], the one place
        they enter the pool (rounded to bf16 under kv_dtype "bfloat16")."""
        self._kv_pool[layer][slots] = round_to_bf16(kv) if self._round_kv else kv
