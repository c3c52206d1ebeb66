"""Token selection on the device, by the rules of `numpy_sampling` (float32 instead of
float64): logit bias, then greedy rows take the first largest logit and the others sample by
temperature, top-k, then top-p over the survivors with the row's own uniform draw. Ties in
value are ordered by token id, as on the host. Nothing waits on the device here; the caller
copies the picks out once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_runner_svc.engines.base import SampleSpec


def apply_logit_bias(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> None:
    """Add each row's bias in place; logits [rows, vocab] float32."""
    for i, spec in enumerate(specs):
        if spec.logit_bias:
            ids = torch.tensor(list(spec.logit_bias.keys()), dtype=torch.int64)
            vals = torch.tensor(list(spec.logit_bias.values()), dtype=torch.float32)
            logits[i].index_add_(0, ids.to(logits.device), vals.to(logits.device))


def sample_on_device(logits: torch.Tensor, specs: Sequence[SampleSpec],
                     out: torch.Tensor) -> None:
    """out [n] int64 = each row's pick from logits [n, vocab] (bias already applied)."""
    n, vocab = logits.shape
    torch.argmax(logits, dim=-1, out=out)
    if all(s.is_greedy for s in specs):
        return
    dev = logits.device
    k_max = max(s.top_k if 0 < s.top_k < vocab else vocab for s in specs if not s.is_greedy)
    ks = torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in specs], device=dev)
    temps = torch.tensor([1.0 if s.is_greedy else s.temperature for s in specs], device=dev)
    top_ps = torch.tensor([s.top_p for s in specs], device=dev)
    uniforms = torch.tensor([s.uniform for s in specs], device=dev)
    sampled_rows = torch.tensor([not s.is_greedy for s in specs], device=dev)
    if k_max < vocab:
        vals, ids = torch.topk(logits, k_max, dim=-1)
    else:
        vals, ids = logits, torch.arange(vocab, device=dev).expand(n, vocab)
    # descending by value, ties by the smaller id: order by id, then a stable value sort
    ids, by_id = ids.sort(dim=-1)
    vals, order = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    rank = torch.arange(k_max, device=dev)[None, :]
    in_k = rank < ks[:, None]
    probs = torch.exp((vals - vals[:, :1]) / temps[:, None]) * in_k
    cum = probs.cumsum(-1)
    cum = cum / cum[:, -1:]
    # keep the smallest prefix whose mass reaches top_p (all k when top_p is 1)
    keep = torch.where(top_ps < 1.0, (cum < top_ps[:, None]).sum(-1) + 1, ks)
    keep = torch.minimum(keep, ks)
    target = uniforms * cum.gather(-1, (keep - 1)[:, None])[:, 0]
    pick = ((cum <= target[:, None]) & (rank < keep[:, None])).sum(-1)
    pick = torch.minimum(pick, keep - 1)
    picked = ids.gather(-1, pick[:, None])[:, 0]
    out.copy_(torch.where(sampled_rows, picked, out))
