"""Host KV pages for a graph engine, and the step feeds built from the runtime's page tables.

The exported step graph takes each row's cached keys and values as dense inputs
[batch, kv_heads, past, head_dim] and returns only the new positions' keys and values. The
runtime, though, hands out KV *pages*: a request's positions live in whichever pages its page
table names. This adapter keeps the paged pool on the host, laid out like the numpy engine's
([layers, pages * page_size, k | v] token-major), and translates at the graph boundary:

- before a step, it gathers each row's window (positions 0 .. past-1, page by page) into the
  dense past inputs; rows shorter than the longest are padded and masked out by the additive
  attention bias, so one graph call serves a batch of requests at different positions;
- after a step, it scatters the new keys and values into the pool rows of their positions.

The pool is the single source of truth, so pages freed by the runtime are free at once, a
cancelled request leaves nothing behind in the graph's executor, and the same graph serves
any mix of requests. The cost is one gather and one scatter per layer per step on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llm_runner_svc.engines.base import EnginePlan
from llm_runner_svc.export import signature as sig
from llm_runner_svc.models.spec import ModelConfig

MASKED = np.float32(-1e9)  # additive bias of a hidden key (finite: no NaN from -inf - -inf)


class HostKvPool:
    """The paged KV pool on the host and the dense views the graph reads."""

    def __init__(self, config: ModelConfig, plan: EnginePlan, kv_dtype: type) -> None:
        self.c, self.plan = config, plan
        self.pool: np.ndarray = np.zeros(  # [L, pages * page, (k | v) kv_heads * hd]
            (config.num_layers, plan.num_pages * plan.page_size, 2 * config.kv_dim), kv_dtype)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def pool_rows(self, page_table: Sequence[int], num_positions: int) -> np.ndarray:
        """[num_positions] pool rows of positions 0..num_positions-1 (short tables: page 0)."""
        ps = self.plan.page_size
        num_pages = -(-num_positions // ps)
        table = np.zeros(num_pages, np.int64)
        m = min(num_pages, len(page_table))
        table[:m] = page_table[:m]
        return (table[:, None] * ps + np.arange(ps)).reshape(-1)[:num_positions]

    def past_feeds(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """rows [batch, past] pool rows -> past_key.i / past_value.i [batch, kv, past, hd]."""
        c = self.c
        b, past = rows.shape
        feeds: dict[str, np.ndarray] = {}
        for layer in range(c.num_layers):
            window = np.take(self.pool[layer], rows.reshape(-1), axis=0).reshape(
                b, past, 2, c.num_kv_heads, c.head_dim)
            feeds[sig.past_key(layer)] = np.ascontiguousarray(
                window[:, :, 0].transpose(0, 2, 1, 3))
            feeds[sig.past_value(layer)] = np.ascontiguousarray(
                window[:, :, 1].transpose(0, 2, 1, 3))
        return feeds

    def write_new(self, outputs: dict[str, np.ndarray], rows: np.ndarray) -> None:
        """Scatter new_key.i / new_value.i [batch, kv, seq, hd] into pool rows [batch, seq]."""
        c = self.c
        flat = rows.reshape(-1)
        for layer in range(c.num_layers):
            for name, lo in ((sig.new_key(layer), 0), (sig.new_value(layer), c.kv_dim)):
                new = outputs[name].transpose(0, 2, 1, 3).reshape(flat.shape[0], c.kv_dim)
                self.pool[layer][flat, lo:lo + c.kv_dim] = new


def prefill_inputs(token_ids: Sequence[int], start_pos: int) -> dict[str, np.ndarray]:
    """ids, positions and causal bias of one request's chunk after `start_pos` cached ones."""
    n = len(token_ids)
    pos = np.arange(start_pos, start_pos + n, dtype=np.int64)  # [n]
    keys = np.arange(start_pos + n)  # [total]
    bias = np.where(keys[None, :] <= pos[:, None], np.float32(0), MASKED)  # [n, total]
    return {sig.INPUT_IDS: np.asarray(token_ids, np.int64)[None],
            sig.POSITION_IDS: pos[None],
            sig.ATTENTION_BIAS: bias.astype(np.float32)[None, None, None]}


def decode_inputs(token_ids: Sequence[int], positions: np.ndarray) -> dict[str, np.ndarray]:
    """One new position per row; row i sees cached keys 0..pos[i]-1 of the padded window
    (past = max(pos)) and its own new key, which sits last."""
    b = positions.shape[0]
    past = int(positions.max())
    keys = np.arange(past + 1)
    visible = (keys[None, :] < positions[:, None]) | (keys[None, :] == past)  # [b, total]
    bias = np.where(visible, np.float32(0), MASKED).astype(np.float32)
    return {sig.INPUT_IDS: np.asarray(token_ids, np.int64).reshape(b, 1),
            sig.POSITION_IDS: positions.astype(np.int64).reshape(b, 1),
            sig.ATTENTION_BIAS: bias[:, None, None, None, :]}
