"""Token selection on host logits with numpy.

Each row's result depends only on that row's logits and spec (never on batch mates or the
row's position in the batch), which is what makes a seeded request reproducible inside any
cohort.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llm_runner_svc.engines.base import SampleSpec


def apply_logit_bias(logits: np.ndarray, specs: Sequence[SampleSpec]) -> None:
    """Add each row's bias in place. logits: [rows, vocab] float32."""
    for i, spec in enumerate(specs):
        if spec.logit_bias:
            ids = np.fromiter(spec.logit_bias.keys(), dtype=np.int64)
            vals = np.fromiter(spec.logit_bias.values(), dtype=np.float32)
            np.add.at(logits[i], ids, vals)


def sample_rows(logits: np.ndarray, specs: Sequence[SampleSpec]) -> list[int]:
    """logits: [rows >= len(specs), vocab] float32 (bias already applied)."""
    out = [0] * len(specs)
    greedy = [i for i, s in enumerate(specs) if s.is_greedy]
    if greedy:
        if len(greedy) == len(specs):
            picks = np.argmax(logits[:len(specs)], axis=1)
        else:
            picks = np.argmax(logits[greedy], axis=1)
        for i, tok in zip(greedy, picks.tolist(), strict=True):
            out[i] = int(tok)
    for i, spec in enumerate(specs):
        if not spec.is_greedy:
            out[i] = _sample_one(logits[i], spec)
    return out


def _sample_one(row: np.ndarray, spec: SampleSpec) -> int:
    """Temperature, then top-k, then top-p (nucleus) over the survivors, then one draw."""
    vocab = row.shape[0]
    k = spec.top_k if 0 < spec.top_k < vocab else vocab
    # [k] ids of the k largest
    cand = np.argpartition(row, vocab - k)[vocab - k:] if k < vocab else np.arange(vocab)
    vals = row[cand]
    # descending by value; ties broken by the smaller id so the order is fully determined
    order = np.lexsort((cand, -vals))
    cand = cand[order]
    scaled = vals[order].astype(np.float64) / spec.temperature
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    cum = np.cumsum(probs)
    if spec.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p
        keep = int(np.searchsorted(cum, spec.top_p, side="left")) + 1
        keep = min(keep, cand.shape[0])
    else:
        keep = cand.shape[0]
    target = spec.uniform * cum[keep - 1]
    pick = int(np.searchsorted(cum[:keep], target, side="right"))
    return int(cand[min(pick, keep - 1)])
