"""Token selection on the device, by the rules of `numpy_sampling` and `numpy_processors`
(float32 instead of float64): logit bias, penalties, the token mask, then greedy rows take
the first largest logit and the others sample by temperature, top-k, then top-p and min-p
over the survivors with the row's own uniform draw; the raw log-probabilities of picks and of
the likeliest tokens. Ties in value are ordered by token id, as on the host (among the
tokens `torch.topk` returns: at a tie on the k-th value it may keep a larger id). Nothing
waits on the device here (the rows' parameters reach it through `on_device`); the caller
copies the results out once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_runner_svc.engines.base import SampleSpec
from llm_runner_svc.engines.numpy_processors import penalty_terms


def on_device(values: Sequence[float] | Sequence[int] | Sequence[bool], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the device: on CUDA staged in
    pinned memory and copied in stream order (the caching host allocator keeps the staging
    block until its copy has run; a blocking copy would wait for every queued kernel)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def apply_logit_bias(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> None:
    """Add each row's bias in place; logits [rows, vocab] float32."""
    for i, spec in enumerate(specs):
        if spec.logit_bias:
            ids = on_device(list(spec.logit_bias.keys()), torch.int64, logits.device)
            vals = on_device(list(spec.logit_bias.values()), torch.float32, logits.device)
            logits[i].index_add_(0, ids, vals)


def sample_on_device(logits: torch.Tensor, specs: Sequence[SampleSpec],
                     out: torch.Tensor) -> None:
    """out [n] int64 = each row's pick from logits [n, vocab] (bias already applied)."""
    n, vocab = logits.shape
    torch.argmax(logits, dim=-1, out=out)
    if all(s.is_greedy for s in specs):
        return
    dev = logits.device
    k_max = max(s.top_k if 0 < s.top_k < vocab else vocab for s in specs if not s.is_greedy)
    f32 = torch.float32
    ks = on_device([s.top_k if 0 < s.top_k < vocab else vocab for s in specs], torch.int64,
                   dev)
    temps = on_device([1.0 if s.is_greedy else s.temperature for s in specs], f32, dev)
    top_ps = on_device([s.top_p for s in specs], f32, dev)
    uniforms = on_device([s.uniform for s in specs], f32, dev)
    sampled_rows = on_device([not s.is_greedy for s in specs], torch.bool, dev)
    min_ps = on_device([s.min_p for s in specs], f32, dev)
    vals, ids = top_sorted(logits, k_max)
    rank = torch.arange(k_max, device=dev)[None, :]
    in_k = rank < ks[:, None]
    probs = torch.exp((vals - vals[:, :1]) / temps[:, None]) * in_k  # relative to the first
    cum = probs.cumsum(-1)
    cum = cum / cum[:, -1:]
    # keep the smallest prefix whose mass reaches top_p (all k when top_p is 1)
    keep = torch.where(top_ps < 1.0, (cum < top_ps[:, None]).sum(-1) + 1, ks)
    keep = torch.minimum(keep, ks)
    # then those at least min_p times the likeliest one (a prefix: probs falls along a row)
    keep = torch.minimum(keep, (probs >= min_ps[:, None]).sum(-1).clamp(min=1))
    target = uniforms * cum.gather(-1, (keep - 1)[:, None])[:, 0]
    pick = ((cum <= target[:, None]) & (rank < keep[:, None])).sum(-1)
    pick = torch.minimum(pick, keep - 1)
    picked = ids.gather(-1, pick[:, None])[:, 0]
    out.copy_(torch.where(sampled_rows, picked, out))


def top_sorted(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of logits [n, vocab] and their ids, [n, k] each,
    descending by value, ties by the smaller id."""
    n, vocab = logits.shape
    if k < vocab:
        vals, ids = torch.topk(logits, k, dim=-1)
    else:
        vals, ids = logits, torch.arange(vocab, device=logits.device).expand(n, vocab)
    # order by id, then a stable sort by value
    ids, by_id = ids.sort(dim=-1)
    vals, order = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(-1, order)


def apply_penalties(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> None:
    """Each row's penalties in place (`numpy_processors.apply_penalties`'s rule, the same
    float32 operations); logits [rows >= len(specs), vocab] float32, contiguous. Entries
    are addressed in the flattened logits (index_select / index_copy_ / index_add_, which
    never wait for the device)."""
    rep_rows, rep_ids, rep_by, sub_rows, sub_ids, sub_by = penalty_terms(specs)
    dev, vocab = logits.device, logits.shape[1]
    flat = logits.view(-1)
    if rep_ids:
        at = on_device([r * vocab + t for r, t in zip(rep_rows, rep_ids, strict=True)],
                       torch.int64, dev)
        vals = flat.index_select(0, at)  # [m] float32
        by = on_device(rep_by, torch.float32, dev)
        flat.index_copy_(0, at, torch.where(vals > 0, vals / by, vals * by))
    if sub_ids:
        at = on_device([r * vocab + t for r, t in zip(sub_rows, sub_ids, strict=True)],
                       torch.int64, dev)
        flat.index_add_(0, at, -on_device(sub_by, torch.float32, dev))


def apply_mask_words(logits: torch.Tensor, words: torch.Tensor) -> None:
    """-inf where the mask bits words [n, ceil(vocab / 32)] int32 (bit j of word w: token
    32 w + j allowed; a row of -1 allows every token) allow nothing, in logits [n, vocab]
    float32, in place; a row whose bits allow no token is left as it is."""
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).view(n, -1)[:, :vocab].bool()  # [n, vocab]
    logits.masked_fill_(~allowed & allowed.any(-1, keepdim=True), float("-inf"))


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int,
                 values: torch.Tensor, ids: torch.Tensor) -> None:
    """Log-softmax of logits [m, vocab] float32 at tokens [m] int64 into values[:, 0], and
    the `top` likeliest tokens' (largest first, ties by the smaller id) into values[:, 1:]
    and their ids into ids [m, >= top] int64; values [m, 1 + >= top] float32."""
    lse = torch.logsumexp(logits, dim=-1)  # [m]
    values[:, 0].copy_(logits.gather(-1, tokens[:, None])[:, 0] - lse)
    if top > 0:
        vals, top_ids = top_sorted(logits, top)
        values[:, 1:1 + top].copy_(vals - lse[:, None])
        ids[:, :top].copy_(top_ids)
