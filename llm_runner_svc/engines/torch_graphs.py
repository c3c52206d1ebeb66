"""Decode-step inputs and CUDA graphs.

`InputStager` writes a batch's token ids, positions, LoRA adapter slots and page tables into
one packed int32 buffer (pinned host memory on CUDA, then a single asynchronous copy),
rewriting a row's page table only when that row's table changed (compared by content: a
request's page list is emptied and refilled in place when it is preempted). `DecodeGraphs`
captures one decode step per batch-size bucket, and on an engine whose LoRA adapters run per
row a second per bucket whose products add each row's adapter (its slot read from the packed
inputs; torch_lora.py), replayed when a row names one; a batch runs in the smallest bucket
that holds it, its padding rows aimed at the scratch page, on the base model. When the plan
holds verify rows (speculative decoding: `EnginePlan.max_decode_rows` above `max_batch`) it
also captures a *verify variant* per bucket of two rows and more, up to `max_decode_rows`
(`verify_buckets`):
the same step, but each layer stores every row's k and v before any row attends
(`Forward.decode(stores_first=True)`), so that rows of one sequence at consecutive positions
(a verify row's K + 1 tokens) each see the keys of the rows before it.
`PrefillGraphs` does the same for prefill forwards of up to a few hundred tokens, padded to a
bucket of token counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llm_runner_svc.engines.base import DecodeRow
from llm_runner_svc.engines.torch_forward import Forward
from llm_runner_svc.engines.torch_prefill import PrefillChunk, PrefillLayout, PrefillStager
from llm_runner_svc.engines.torch_state import RunState, decode_adapters, decode_views


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two below max_batch, and max_batch itself."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) < max_batch]
    return [*sizes, max_batch]


def verify_buckets(max_batch: int, verify_tokens: int) -> list[int]:
    """Row counts of the verify variants for verify rows of up to `verify_tokens` = K
    proposed tokens: the decode buckets of two rows and more, and each decode bucket's
    rows times K + 1 (a step where every row verifies K tokens fills one exactly), up to
    `max_batch * (K + 1)`; none when K is 0."""
    if verify_tokens <= 0:
        return []
    sizes = bucket_sizes(max_batch)
    return sorted({b for b in sizes if b >= 2} | {b * (verify_tokens + 1) for b in sizes})


class InputStager:
    def __init__(self, state: RunState, scratch_page: int) -> None:
        self.device_inputs = state.inputs
        self._is_cuda = state.inputs.is_cuda
        if self._is_cuda:
            self._host = torch.empty(state.inputs.shape, dtype=torch.int32, pin_memory=True)
            self._copied = torch.cuda.Event()
        else:
            self._host = state.inputs
        self._host_np: np.ndarray = self._host.numpy()
        self._host_np[:] = scratch_page
        self._pages = state.pages_per_seq
        self._scratch = scratch_page
        self._bucket = 0
        self._rows: list[list[int] | None] = []  # the page table staged per row

    def stage(self, rows: Sequence[DecodeRow], bucket: int) -> None:
        """Write `rows` (padded to `bucket`) and start their copy to the device."""
        self.stage_columns([r.token_id for r in rows], [r.position for r in rows],
                           [r.adapter for r in rows], [r.page_table for r in rows], bucket)

    def stage_columns(self, token_ids: Sequence[int], positions: Sequence[int],
                      adapters: Sequence[int], page_tables: Sequence[Sequence[int]],
                      bucket: int) -> None:
        """`stage` by column, one entry per row; rows that share a page table (the same
        object: a verify row's positions) read it once."""
        if self._is_cuda:
            self._copied.synchronize()  # the previous step's copy has left the buffer
        b, pages = len(token_ids), self._pages
        size = bucket * (3 + pages)
        flat = self._host_np[:size]
        if bucket != self._bucket:
            flat[:3 * bucket] = 0
            flat[3 * bucket:] = self._scratch
            self._bucket = bucket
            self._rows = [None] * bucket
        ids, pos, slots = flat[:bucket], flat[bucket:2 * bucket], flat[2 * bucket:3 * bucket]
        tables = flat[3 * bucket:].reshape(bucket, pages)
        ids[:b] = token_ids
        pos[:b] = positions
        slots[:b] = adapters
        src: Sequence[int] | None = None
        table: list[int] = []
        for i, row_table in enumerate(page_tables):
            if row_table is not src:
                src, table = row_table, list(row_table)
            if self._rows[i] != table:
                m = min(len(table), pages)
                tables[i, :m] = table[:m]
                self._rows[i] = table
        for i in range(b, bucket):
            if self._rows[i] is not None:
                ids[i] = pos[i] = slots[i] = 0
                tables[i] = self._scratch
                self._rows[i] = None
        if self._is_cuda:
            self.device_inputs[:size].copy_(self._host[:size], non_blocking=True)
            self._copied.record()


Variant = tuple[bool, bool]  # (with LoRA products, stores every k and v first)


class DecodeGraphs:
    """One captured decode step per bucket (and per bucket with LoRA products, when the
    forward's adapters run per row; and a verify variant per `verify_buckets` bucket, on
    the base model); `capture_hidden` fixes whether the graphs stage hidden states (they
    do whenever the plan has a hidden layer)."""

    def __init__(self, forward: Forward, state: RunState, max_batch: int,
                 capture_hidden: bool, verify_tokens: int = 0) -> None:
        self.buckets = bucket_sizes(max_batch)
        self.verify_buckets = verify_buckets(max_batch, verify_tokens)
        self._forward = forward
        self._state = state
        self._capture_hidden = capture_hidden
        lora = forward.lora
        self.has_lora = lora is not None and lora.is_per_row  # adapter rows may replay
        self._variants: list[tuple[int, Variant]] = [
            (b, (with_lora, False)) for b in self.buckets
            for with_lora in ((False, True) if self.has_lora else (False,))]
        self._variants += [(b, (False, True)) for b in self.verify_buckets]
        self._graphs: dict[tuple[int, Variant], torch.cuda.CUDAGraph] = {}

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def verify_bucket_for(self, rows: int) -> int | None:
        """The verify variant's bucket for a step of `rows` decode rows; None: too many."""
        return next((b for b in self.verify_buckets if b >= rows), None)

    def _body(self, bucket: int, variant: Variant) -> None:
        with_lora, stores_first = variant
        ids, positions, tables = decode_views(self._state, bucket)
        slots = decode_adapters(self._state, bucket) if with_lora else None
        self._forward.decode(bucket, ids, positions, tables, self._capture_hidden,
                             lora_slots=slots, stores_first=stores_first)

    def capture(self) -> None:
        """Warm every bucket up (kernel compilation, library handles) on a side stream, then
        capture them, largest first, into one shared memory pool."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket, variant in self._variants:
                self._body(bucket, variant)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for bucket, variant in sorted(self._variants, key=lambda v: -v[0]):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._body(bucket, variant)
            self._graphs[bucket, variant] = graph
        torch.cuda.synchronize()

    def replay(self, bucket: int, with_lora: bool = False, stores_first: bool = False
               ) -> None:
        self._graphs[bucket, (with_lora, stores_first)].replay()

    def close(self) -> None:
        self._graphs.clear()


def prefill_buckets(max_tokens: int, largest: int) -> list[int]:
    """Token counts of the captured prefill forwards: powers of two from 16 up to the
    smaller of a pass (`max_tokens`) and `largest` (0: none)."""
    top = min(max_tokens, largest)
    return [1 << i for i in range(4, top.bit_length()) if (1 << i) <= top]


class PrefillGraphs:
    """One captured prefill forward per token bucket. A pass of up to a bucket's tokens is
    staged padded to it (`PrefillStager.stage(pad_tokens=...)`: the bucket's tokens, every
    chunk row, a fixed count of attention blocks) and replays its graph: one launch instead
    of a few hundred, which is what a short prompt or a step's chunk is bound by (at 7B
    shapes, about 12 ms of host work for the eager forward against 9 ms on the GPU for 512
    tokens). Longer passes keep the GPU busier than their launches and run eagerly."""

    def __init__(self, forward: Forward, stager: PrefillStager, buckets: list[int],
                 capture_hidden: bool, pad_dest: int) -> None:
        self.buckets = buckets
        self._forward, self._stager = forward, stager
        self._capture_hidden, self._pad_dest = capture_hidden, pad_dest
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket_for(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    def stage(self, chunks: Sequence[PrefillChunk], bucket: int) -> PrefillLayout:
        return self._stager.stage(chunks, self._forward.ops.prefill_block(bucket),
                                  pad_tokens=bucket, pad_dest=self._pad_dest)

    def capture(self) -> None:
        """Warm every bucket up, then capture them, largest first, into one shared memory
        pool, over padding only (their writes land in the scratch page). Buckets share the
        staging buffer, so each is staged again right before it runs: another bucket's
        staging leaves other numbers where its views read."""
        for b in self.buckets:
            self._forward.prefill(self.stage([], b), self._capture_hidden)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            layout = self.stage([], b)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward.prefill(layout, self._capture_hidden)
            self._graphs[b] = graph
        torch.cuda.synchronize()

    def replay(self, bucket: int) -> None:
        self._graphs[bucket].replay()

    def close(self) -> None:
        self._graphs.clear()
