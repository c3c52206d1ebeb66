"""Prefill batches of the torch engine: chunks of several requests in one forward.

A chunk is some new tokens of one request appended after the positions its KV pages already
hold: positions `start .. start + len - 1`, attending causally to positions 0 .. their own.
A forward packs every chunk's tokens one after another (T tokens in all). `PrefillStager`
writes what the forward needs to know about them (each token's id, position and pool row;
each chunk's page table, last token and the row its last token's residual goes to; the
attention's query blocks) into one int64 buffer and copies it to the device in one transfer;
`PrefillLayout` holds views of it. A negative token id -1-j stands for the pick of row j of
the previous forward, which the engine writes in on the device (`feed_picks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from llm_runner_svc.errors import InvalidArgument


@dataclass(frozen=True)
class PrefillChunk:
    """New tokens of one request: `token_ids` at positions start .. start + len - 1."""

    token_ids: Sequence[int]
    start: int
    page_table: Sequence[int]  # page ids holding positions 0 .. start + len - 1
    dest: int  # the row of `RunState.x_last` that takes the last token's residual


@dataclass(frozen=True)
class PrefillLayout:
    """One staged prefill forward. Tensors are on the engine's device."""

    num_tokens: int  # T
    ids: torch.Tensor  # [T] int64 token ids, chunk after chunk
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64 pool row each token's k and v go to
    last: torch.Tensor  # [R] int64 packed index of each chunk's last token
    dest: torch.Tensor  # [R] int64 the x_last row each chunk's last token goes to
    tables: torch.Tensor  # [R, pages] int64 each chunk's page table, the scratch page past it
    blocks: torch.Tensor  # [B, 4] int64 attention query blocks: chunk, first token, its
    #                       position, tokens; the longest attention first
    spans: tuple[tuple[int, int, int], ...]  # per chunk: (first token, tokens, start)
    block: int  # queries per attention block


class PrefillStager:
    """Stages batches of at most `max_tokens` tokens in at most `max_chunks` chunks whose
    page tables have at most `pages` entries, for attention blocks of at least 16 queries."""

    MIN_BLOCK = 16

    def __init__(self, max_tokens: int, max_chunks: int, pages: int, page_size: int,
                 scratch_page: int, device: torch.device) -> None:
        self.max_tokens, self.max_chunks = max_tokens, max_chunks
        self.pages, self.page_size, self.scratch = pages, page_size, scratch_page
        max_blocks = max_tokens // self.MIN_BLOCK + max_chunks
        size = 3 * max_tokens + max_chunks * (2 + pages) + 4 * max_blocks
        self._device = torch.zeros(size, dtype=torch.int64, device=device)
        self._is_cuda = device.type == "cuda"
        if self._is_cuda:
            self._host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
            self._copied = torch.cuda.Event()
        else:
            self._host = self._device
        self._np: np.ndarray = self._host.numpy()
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    @property
    def nbytes(self) -> int:
        return int(self._device.nbytes)

    def check(self, chunks: Sequence[PrefillChunk], max_seq: int) -> int:
        """The batch's token count; InvalidArgument when it does not fit."""
        if not 0 < len(chunks) <= self.max_chunks:
            raise InvalidArgument(f"prefill of {len(chunks)} chunks; at most {self.max_chunks}")
        total = 0
        for ch in chunks:
            n, end = len(ch.token_ids), ch.start + len(ch.token_ids)
            if n == 0 or ch.start < 0 or end > max_seq:
                raise InvalidArgument(f"prefill of {n} tokens at {ch.start} does not fit "
                                      f"maxSeq {max_seq}")
            if len(ch.page_table) * self.page_size < end:
                raise InvalidArgument(f"page table of {len(ch.page_table)} pages does not "
                                      f"hold positions up to {end - 1}")
            total += n
        if total > self.max_tokens:
            raise InvalidArgument(f"prefill of {total} tokens in one forward; at most "
                                  f"{self.max_tokens}")
        return total

    def stage(self, chunks: Sequence[PrefillChunk], block: int, pad_tokens: int = 0,
              pad_dest: int = 0) -> PrefillLayout:
        """Write `chunks` (checked by `check`) and start their copy; attention query blocks
        of `block` tokens (at least MIN_BLOCK). With `pad_tokens` (at least the chunks'
        tokens) the layout has that many tokens, `max_chunks` chunks and pad_tokens //
        block + max_chunks blocks whatever the batch holds, so its views are the ones a
        captured graph reads: padding tokens write the scratch page, padding chunks' last
        rows go to `x_last` row `pad_dest`, padding blocks are empty."""
        if self._is_cuda:
            self._copied.synchronize()  # the last batch's copy has left the host buffer
        real = sum(len(ch.token_ids) for ch in chunks)
        t = max(real, pad_tokens)
        r = self.max_chunks if pad_tokens else len(chunks)
        p, ps = self.pages, self.page_size
        buf = self._np
        ids, pos, slots = buf[:t], buf[t:2 * t], buf[2 * t:3 * t]
        last, dest = buf[3 * t:3 * t + r], buf[3 * t + r:3 * t + 2 * r]
        tables = buf[3 * t + 2 * r:3 * t + 2 * r + r * p].reshape(r, p)
        tables[:] = self.scratch
        ids[real:], pos[real:], slots[real:] = 0, 0, self.scratch * ps
        last[len(chunks):], dest[len(chunks):] = 0, pad_dest
        spans, blocks = [], []
        first = 0
        for i, ch in enumerate(chunks):
            n = len(ch.token_ids)
            m = min(len(ch.page_table), p)
            tables[i, :m] = ch.page_table[:m]
            ids[first:first + n] = ch.token_ids
            here = np.arange(ch.start, ch.start + n, dtype=np.int64)
            pos[first:first + n] = here
            slots[first:first + n] = tables[i, here // ps] * ps + here % ps
            last[i], dest[i] = first + n - 1, ch.dest
            spans.append((first, n, ch.start))
            blocks += [(i, first + q, ch.start + q, min(block, n - q)) for q in range(0, n, block)]
            first += n
        blocks.sort(key=lambda b: -(b[2] + b[3]))  # the most keys first: they finish last
        num_blocks = t // block + r if pad_tokens else len(blocks)
        lo = 3 * t + 2 * r + r * p
        used = lo + 4 * num_blocks
        buf[lo:used] = 0  # padding blocks hold no query
        buf[lo:lo + 4 * len(blocks)] = np.asarray(blocks, dtype=np.int64).reshape(-1)
        if self._is_cuda:
            self._device[:used].copy_(self._host[:used], non_blocking=True)
            self._copied.record()
        views = self._views.get((t, r, used))
        if views is None:
            d = self._device
            views = (d[:t], d[t:2 * t], d[2 * t:3 * t], d[3 * t:3 * t + r],
                     d[3 * t + r:3 * t + 2 * r], d[3 * t + 2 * r:lo].view(r, p),
                     d[lo:used].view(-1, 4))
            if pad_tokens:  # a captured pass's shape: staged again and again
                self._views[t, r, used] = views
        ids_d, pos_d, slots_d, last_d, dest_d, tables_d, blocks_d = views
        return PrefillLayout(
            num_tokens=t, ids=ids_d, positions=pos_d, slots=slots_d, last=last_d, dest=dest_d,
            tables=tables_d, blocks=blocks_d, spans=tuple(spans), block=block)
