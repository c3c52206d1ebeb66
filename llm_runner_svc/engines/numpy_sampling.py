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
    """Temperature, then top-k, then top-p (nucleus) and min-p over the survivors, then one
    draw."""
    cand, cum = _nucleus(row, spec)
    keep = cand.shape[0]
    target = spec.uniform * cum[keep - 1]
    pick = int(np.searchsorted(cum, target, side="right"))
    return int(cand[min(pick, keep - 1)])


def _nucleus(row: np.ndarray, spec: SampleSpec) -> tuple[np.ndarray, np.ndarray]:
    """The tokens sampling may pick from `row` (temperature, top-k, then the smallest
    prefix whose mass reaches top-p, less those below min-p times the likeliest one's
    probability), most likely first, and the running sum of their probabilities
    (float64)."""
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
    if spec.min_p > 0.0:  # probs falls along cand: the survivors are a prefix
        keep = min(keep, int(np.count_nonzero(probs >= spec.min_p * probs[0])))
    return cand[:keep], cum[:keep]


def verify_picks(logits: np.ndarray, specs: Sequence[SampleSpec],
                 proposed: Sequence[int]) -> list[int]:
    """The target's pick at each position of a verify row, given the token proposed there:
    logits [K, vocab] float32, one spec and one proposed token per position. Greedy: the
    argmax. Sampled (speculative sampling with a proposer that proposes one token, q its
    point mass): the proposed token when the spec's `accept_uniform` < p(proposed), else a
    draw from p without it, renormalised (`rejection_pick`). Either way the accepted tokens
    are the longest prefix of picks equal to the proposal, then the first pick that is not."""
    if specs[0].is_greedy:
        return [int(t) for t in np.argmax(logits, axis=1)]
    out = []
    for row, spec, token in zip(logits, specs, proposed, strict=True):
        cand, cum = _nucleus(row, spec)
        p = np.diff(cum, prepend=0.0) / cum[-1]  # [keep] float64
        q = (cand == token).astype(np.float64)
        out.append(int(cand[rejection_pick(p, q, int(np.argmax(q)) if q.any() else -1,
                                           spec.accept_uniform, spec.uniform)]))
    return out


def rejection_pick(p: np.ndarray, q: np.ndarray, proposed: int, accept_uniform: float,
                   uniform: float) -> int:
    """Speculative sampling's rule at one position: p and q [n] float64 the target's and the
    proposer's distributions over the same n tokens, `proposed` the index the proposer drew
    (-1: a token outside the n, which p gives no mass). Accept it with probability
    min(1, p/q) (`accept_uniform` < p/q), else draw from max(0, p - q) renormalised with
    `uniform`. The pick is then distributed as p, whatever q is."""
    if proposed >= 0 and accept_uniform * q[proposed] < p[proposed]:
        return proposed
    residual = np.maximum(p - q, 0.0)
    cum = np.cumsum(residual)
    if cum[-1] <= 0.0:  # p == q: a rejection cannot happen; numerically, take p
        cum = np.cumsum(p)
    pick = int(np.searchsorted(cum, uniform * cum[-1], side="right"))
    return min(pick, p.shape[0] - 1)
