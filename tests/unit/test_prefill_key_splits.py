"""Prefill attention with each query block's keys split over several programs, on Triton's
CPU interpreter (float32 operands, exact products): whether the last split of a block merges
the splits itself or a second launch does (1, 4 or 16 queries per program), the result is the
float64 reference's, for chunks after long prefixes, a chunk whose keys fit one split, and
padding blocks; the self-merging launch leaves its counts at zero for the next one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import rerun_interpreted  # noqa: E402


def _reference(qkv, k_pool, v_pool, tables, row, first, count, start, heads, kv_heads, hd,
               page):
    end = start + count
    rows = (tables[row, :(end - 1) // page + 1, None] * page
            + torch.arange(page)).reshape(-1)[:end]
    keys = k_pool[rows].double().view(-1, kv_heads, hd)
    vals = v_pool[rows].double().view(-1, kv_heads, hd)
    q = qkv[first:first + count, :heads * hd].double().view(count, heads, hd).transpose(0, 1)
    kh = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    vh = vals.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = q @ kh.transpose(1, 2) / hd ** 0.5
    hidden = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    want = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ vh
    return want.transpose(0, 1).reshape(count, heads * hd)


@pytest.mark.parametrize("self_combine, combine_tokens",
                         [(True, None), (False, 1), (False, 4), (False, 16)])
def test_split_keys_merge_to_the_reference(self_combine, combine_tokens, request):
    if rerun_interpreted(request):
        return
    from llm_runner_svc.engines.torch_prefill import PrefillChunk, PrefillStager
    from llm_runner_svc.engines.torch_triton_prefill import (
        PrefillPartials,
        launch_prefill_attention,
    )

    heads, kv_heads, hd, page, pages = 4, 2, 16, 16, 40
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    k_pool = torch.randn(pages * page + page, kv_heads * hd, generator=gen)
    v_pool = torch.randn(pages * page + page, kv_heads * hd, generator=gen)
    order = torch.randperm(pages - 1, generator=gen).tolist()
    chunks = [PrefillChunk([0] * 20, 300, order[:20], 0),  # 20 queries after 300 keys
              PrefillChunk([0] * 5, 3, order[20:21], 1),  # keys that fit one split
              PrefillChunk([0] * 3, 200, order[21:35], 2)]
    stager = PrefillStager(max_tokens=64, max_chunks=4, pages=24, page_size=page,
                           scratch_page=pages, device=cpu)
    partials = PrefillPartials(heads, hd, 8, cpu, rows=8 * 64)
    for pad in (0, 48):
        layout = stager.stage(chunks, 16, pad_tokens=pad)
        n = layout.num_tokens
        qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, generator=gen)
        for splits in (4, 8):
            out = torch.zeros(n, heads * hd)
            launch_prefill_attention(qkv, k_pool, v_pool, layout.blocks, layout.tables, out,
                                     heads, kv_heads, hd, page, layout.block, (16, 4, 1),
                                     partials, splits, self_combine=self_combine,
                                     combine_tokens=combine_tokens)
            for i, (first, count, start) in enumerate(layout.spans):
                want = _reference(qkv, k_pool, v_pool, layout.tables, i, first, count, start,
                                  heads, kv_heads, hd, page)
                err = (out[first:first + count].double() - want).abs().max().item()
                assert err < 1e-5, (pad, splits, i, err)
            assert int(partials.counts.abs().sum()) == 0
