"""The numpy engine: float32 reference decoder on the CPU.

Vectorized over the batch and over heads (GQA as a [kv_heads, group] split, no per-head
loops). Every matrix is stored once, C-contiguous in [in, out] layout, with q/k/v and
gate/up fused so each layer issues four matmuls. [in, out] rather than a transposed view of
[out, in]: for the few-row products of a decode step OpenBLAS runs the contiguous layout up
to 1.7x faster (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from llm_runner_svc.engines.base import (
    DecodeRow,
    Engine,
    EnginePlan,
    HiddenStates,
    SampleSpec,
    check_hidden_layer,
    check_prefill_fits,
    check_token_ids,
    is_same_plan,
)
from llm_runner_svc.engines.numpy_kernels import (
    apply_rope,
    rms_norm,
    rope_tables,
    round_to_bf16,
    softmax_,
)
from llm_runner_svc.engines.numpy_sampling import apply_logit_bias, sample_rows
from llm_runner_svc.errors import FailedPrecondition, InvalidArgument
from llm_runner_svc.models.spec import ModelConfig, ModelWeights


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


class NumpyEngine(Engine):
    name = "numpy"

    def __init__(self, config: ModelConfig, weights: ModelWeights,
                 kv_dtype: str = "float32") -> None:
        """`kv_dtype` "bfloat16" rounds keys and values to bf16 as they enter the (float32)
        pool: the storage precision of an engine with a bf16 KV cache, everything else in
        float32, as a reference for such an engine."""
        weights.check(config)
        if kv_dtype not in ("float32", "bfloat16"):
            raise InvalidArgument(f"kv_dtype {kv_dtype!r}: 'float32' or 'bfloat16'")
        self._round_kv = kv_dtype == "bfloat16"
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

    # ---- lifecycle -------------------------------------------------------------------
    def preallocate(self, plan: EnginePlan) -> None:
        if is_same_plan(self._plan, plan):
            return
        c = self.config
        check_hidden_layer(c, plan)
        rows = max(plan.max_batch, plan.prefill_chunk)
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

    def memory_bytes(self) -> int:
        return self._buffers_bytes

    def _need_plan(self) -> EnginePlan:
        if self._plan is None:
            raise FailedPrecondition("engine used before preallocate()")
        return self._plan

    # ---- forward ---------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int], start_pos: int, page_table: Sequence[int],
                capture_hidden: bool = False) -> HiddenStates | None:
        plan = self._need_plan()
        n_total = len(token_ids)
        check_prefill_fits(plan, n_total, start_pos)
        hidden = self.config.hidden_size
        caps: list[tuple[np.ndarray, np.ndarray]] = []
        table = np.asarray(page_table, dtype=np.int64)
        for lo in range(0, n_total, plan.prefill_chunk):
            chunk = token_ids[lo:lo + plan.prefill_chunk]
            n = len(chunk)
            pos = np.arange(start_pos + lo, start_pos + lo + n)  # [n]
            self._embed(chunk, n)
            self._run_layers(n, pos, lambda layer, q, kv, p=pos: self._attend_prefill(
                layer, q, kv, table, p), capture_hidden)
            if capture_hidden:
                caps.append((self._cap_emb[:n].copy(), self._cap_state[:n].copy()))
        last = self._h[:1]
        rms_norm(self._x[n - 1:n], self._final_norm, self.config.rms_eps, out=last)
        np.matmul(last, self._lm_head_t, out=self._logits[:1])
        if not capture_hidden:
            return None
        emb = np.concatenate([e for e, _ in caps]).reshape(n_total, hidden)
        states = np.concatenate([s for _, s in caps]).reshape(n_total, hidden)
        return HiddenStates(embeddings=emb, states=states, start_position=start_pos)

    def decode(self, rows: Sequence[DecodeRow]) -> list[HiddenStates | None]:
        plan = self._need_plan()
        b = len(rows)
        if not 0 < b <= plan.max_batch:
            raise InvalidArgument(f"decode batch of {b} rows; maxBatch is {plan.max_batch}")
        pos = np.fromiter((r.position for r in rows), dtype=np.int64, count=b)  # [b]
        if int(pos.max()) >= plan.max_seq:
            raise InvalidArgument(f"decode position beyond maxSeq {plan.max_seq}")
        num_pages = int(pos.max()) // plan.page_size + 1
        tables = np.zeros((b, num_pages), np.int64)  # [b, pages]; short rows padded (masked)
        for i, r in enumerate(rows):
            m = min(num_pages, len(r.page_table))
            tables[i, :m] = r.page_table[:m]
        span = num_pages * plan.page_size
        # [b * span] pool rows of every row's visible window, page by page
        gather = (tables[:, :, None] * plan.page_size + np.arange(plan.page_size)).reshape(-1)
        slots = tables[np.arange(b), pos // plan.page_size] * plan.page_size + pos % plan.page_size
        # [b, 1, 1, span] additive mask: key s is visible to row i when s <= pos[i]
        mask = np.where(np.arange(span)[None, :] <= pos[:, None], 0.0, -np.inf)
        mask = mask.astype(np.float32)[:, None, None, :]
        capture = any(r.capture_hidden for r in rows)
        self._embed([r.token_id for r in rows], b)
        self._run_layers(b, pos, lambda layer, q, kv: self._attend_decode(
            layer, q, kv, gather, slots, mask), capture)
        rms_norm(self._x[:b], self._final_norm, self.config.rms_eps, out=self._h[:b])
        np.matmul(self._h[:b], self._lm_head_t, out=self._logits[:b])
        if not capture:
            return [None] * b
        return [HiddenStates(self._cap_emb[i:i + 1].copy(), self._cap_state[i:i + 1].copy(),
                             int(pos[i])) if r.capture_hidden else None
                for i, r in enumerate(rows)]

    def sample(self, specs: Sequence[SampleSpec]) -> list[int]:
        self._need_plan()
        logits = self._logits[:len(specs)]
        apply_logit_bias(logits, specs)
        return sample_rows(logits, specs)

    def logits(self, num_rows: int) -> np.ndarray:
        self._need_plan()
        return self._logits[:num_rows]

    # ---- internals -------------------------------------------------------------------
    def _embed(self, token_ids: Sequence[int], n: int) -> None:
        check_token_ids(self.config, token_ids)
        ids = np.fromiter(token_ids, dtype=np.int64, count=n)
        np.take(self._emb, ids, axis=0, out=self._x[:n])

    def _run_layers(self, n: int, pos: np.ndarray, attend: Callable[..., None],
                    capture: bool) -> None:
        """Every decoder layer over rows 0..n-1 of the residual buffer."""
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
            if lw.qkv_bias is not None:
                qkv += lw.qkv_bias
            qk = qkv[:, :c.q_dim + c.kv_dim].reshape(n, heads, c.head_dim)  # view
            if lw.qk_norm is not None:
                qk[:, :c.num_heads] = rms_norm(qk[:, :c.num_heads], lw.qk_norm[0], c.rms_eps)
                qk[:, c.num_heads:] = rms_norm(qk[:, c.num_heads:], lw.qk_norm[1], c.rms_eps)
            apply_rope(qk, cos, sin, c.rope_style)
            attend(li, qkv[:, :c.q_dim], qkv[:, c.q_dim:])
            np.matmul(attn, lw.wo_t, out=tmp)
            x += tmp
            rms_norm(x, lw.ffn_norm, c.rms_eps, out=h)
            np.matmul(h, lw.gate_up_t, out=gate_up)
            gate = gate_up[:, :c.intermediate_size]
            np.negative(gate, out=act)
            np.exp(act, out=act)
            act += 1.0
            np.divide(gate, act, out=act)  # silu(gate) = gate / (1 + exp(-gate))
            act *= gate_up[:, c.intermediate_size:]
            np.matmul(act, lw.down_t, out=tmp)
            x += tmp
            if capture and hl == li + 1:
                self._cap_state[:n] = x
        if capture and hl == -1:
            rms_norm(x, self._final_norm, c.rms_eps, out=self._cap_state[:n])

    def _store_kv(self, layer: int, slots: np.ndarray, kv: np.ndarray) -> None:
        """Keys and values [n, 2 kv_dim] into `layer`'s pool rows `slots` [n], the one place
        they enter the pool (rounded to bf16 under kv_dtype "bfloat16")."""
        self._kv_pool[layer][slots] = round_to_bf16(kv) if self._round_kv else kv

    def _attend_prefill(self, layer: int, q: np.ndarray, kv: np.ndarray, table: np.ndarray,
                        pos: np.ndarray) -> None:
        """q [n, q_dim], kv [n, 2 kv_dim] of one request at positions `pos` [n]."""
        c, ps = self.config, self._need_plan().page_size
        n = q.shape[0]
        self._store_kv(layer, table[pos // ps] * ps + pos % ps, kv)
        end = int(pos[-1]) + 1
        pages = table[:(end - 1) // ps + 1]
        span = pages.shape[0] * ps
        rows = (pages[:, None] * ps + np.arange(ps)).reshape(-1)  # [span] pool rows
        g = c.num_heads // c.num_kv_heads
        window = np.take(self._kv_pool[layer], rows, axis=0).reshape(
            span, 2, c.num_kv_heads, c.head_dim)
        keys_t = window[:, 0].transpose(1, 2, 0)[:, None]  # [kv, 1, hd, span]
        vals_t = window[:, 1].transpose(1, 0, 2)[:, None]  # [kv, 1, span, hd]
        qh = q.reshape(n, c.num_kv_heads, g, c.head_dim).transpose(1, 2, 0, 3)  # [kv, g, n, hd]
        scores = np.matmul(qh, keys_t)  # [kv, g, n, span]
        scores *= np.float32(1.0 / np.sqrt(c.head_dim))
        visible = np.arange(span)[None, :] <= pos[:, None]  # [n, span] causal
        scores[..., ~visible] = -np.inf
        softmax_(scores)
        out = np.matmul(scores, vals_t)  # [kv, g, n, hd]
        self._attn[:n] = out.transpose(2, 0, 1, 3).reshape(n, c.q_dim)

    def _attend_decode(self, layer: int, q: np.ndarray, kv: np.ndarray, gather: np.ndarray,
                       slots: np.ndarray, mask: np.ndarray) -> None:
        """q [b, q_dim], kv [b, 2 kv_dim], one position per row written at pool rows `slots`."""
        c = self.config
        b = q.shape[0]
        self._store_kv(layer, slots, kv)
        span = gather.shape[0] // b
        g = c.num_heads // c.num_kv_heads
        window = np.take(self._kv_pool[layer], gather, axis=0).reshape(
            b, span, 2, c.num_kv_heads, c.head_dim)
        qh = q.reshape(b, c.num_kv_heads, g, c.head_dim)
        scores = np.matmul(qh, window[:, :, 0].transpose(0, 2, 3, 1))  # [b, kv, g, span]
        scores *= np.float32(1.0 / np.sqrt(c.head_dim))
        scores += mask
        softmax_(scores)
        out = np.matmul(scores, window[:, :, 1].transpose(0, 2, 1, 3))  # [b, kv, g, hd]
        self._attn[:b] = out.reshape(b, c.q_dim)
