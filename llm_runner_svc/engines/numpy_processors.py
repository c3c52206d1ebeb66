"""What happens to a row's logits on the host before its pick, and the log-probabilities a
request asks for (numpy).

A row's logits go through its logit bias, then its penalties (`Penalties`: repetition on
every token of the output or the prompt, then frequency and presence on the output's), then
its token mask (tokens it does not allow get -inf; a mask that allows nothing is ignored
rather than leave nothing to pick), then the pick (numpy_sampling: greedy, or temperature,
top-k, top-p and min_p). Log-probabilities are those of the raw logits, before any of this
(vLLM's "raw" log-probabilities): log-softmax of the model's logits at that position. The
torch engine's device path mirrors these rules (torch_sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llm_runner_svc.engines.batch import SampleSpec, TokenLogprob, TokenMask
from llm_runner_svc.engines.numpy_sampling import apply_logit_bias, sample_rows, verify_picks

LOGPROB_ROWS = 64  # rows whose log-softmax is taken at once (float64 copies of the logits)


def penalty_terms(specs: Sequence[SampleSpec]
                  ) -> tuple[list[int], list[int], list[float], list[int], list[int],
                             list[float]]:
    """The penalties of `specs` as flat lists: (rows, tokens, divisors) of the repetition
    penalty, one entry per distinct token of a row's output and prompt, and (rows, tokens,
    amounts) taken off the logits for frequency and presence, one per token of the output.
    Amounts are Python floats, so that every engine subtracts the same float32 value."""
    rep_rows: list[int] = []
    rep_ids: list[int] = []
    rep_by: list[float] = []
    sub_rows: list[int] = []
    sub_ids: list[int] = []
    sub_by: list[float] = []
    for i, spec in enumerate(specs):
        pen = spec.penalties
        if pen is None:
            continue
        if pen.repetition != 1.0:
            ids = set(pen.counts).union(pen.seen)
            rep_rows += [i] * len(ids)
            rep_ids += ids
            rep_by += [pen.repetition] * len(ids)
        if pen.frequency or pen.presence:
            for tok, count in pen.counts.items():
                sub_rows.append(i)
                sub_ids.append(tok)
                sub_by.append(pen.frequency * count + pen.presence)
    return rep_rows, rep_ids, rep_by, sub_rows, sub_ids, sub_by


def apply_penalties(logits: np.ndarray, specs: Sequence[SampleSpec]) -> None:
    """Each row's penalties in place; logits [rows >= len(specs), vocab] float32. A
    repeated token's positive logit is divided by `repetition`, a negative one multiplied
    by it; then `frequency` times its count and `presence` are taken off."""
    rep_rows, rep_ids, rep_by, sub_rows, sub_ids, sub_by = penalty_terms(specs)
    if rep_ids:
        at = (np.asarray(rep_rows), np.asarray(rep_ids))
        vals = logits[at]  # [m] float32
        by = np.asarray(rep_by, dtype=np.float32)
        logits[at] = np.where(vals > 0, vals / by, vals * by)
    if sub_ids:
        at = (np.asarray(sub_rows), np.asarray(sub_ids))
        logits[at] -= np.asarray(sub_by, dtype=np.float32)


def fill_masks(masks: Sequence[TokenMask], out: np.ndarray) -> None:
    """out [len(masks), words] int32 = each mask's allowed-token bits (`TokenMask.fill`),
    one `fill` per mask class."""
    out[:] = 0
    kinds: dict[type[TokenMask], list[int]] = {}
    for i, mask in enumerate(masks):
        kinds.setdefault(type(mask), []).append(i)
    if len(kinds) == 1:
        type(masks[0]).fill(masks, out)
        return
    for kind, rows in kinds.items():
        part = np.zeros((len(rows), out.shape[1]), np.int32)  # [rows of kind, words]
        kind.fill([masks[i] for i in rows], part)
        out[rows] = part


def mask_words(vocab: int) -> int:
    """int32 words of one mask over `vocab` tokens."""
    return -(-vocab // 32)


def allowed_tokens(words: np.ndarray, vocab: int) -> np.ndarray:
    """[rows, vocab] bool from mask bits words [rows, mask_words(vocab)] int32: bit j of
    word w allows token 32 w + j."""
    as_bytes = np.ascontiguousarray(words, dtype="<i4").view(np.uint8)  # [rows, 4 words]
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab].astype(bool)


def apply_masks(logits: np.ndarray, specs: Sequence[SampleSpec]) -> None:
    """-inf at the tokens each row's mask does not allow, in place (rows without a mask,
    and rows whose mask allows nothing, untouched); logits [rows >= len(specs), vocab]."""
    rows = [i for i, s in enumerate(specs) if s.mask is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = np.empty((len(rows), mask_words(vocab)), np.int32)
    fill_masks([specs[i].mask for i in rows], words)  # type: ignore[misc]
    allowed = allowed_tokens(words, vocab)  # [masked rows, vocab]
    for i, ok in zip(rows, allowed, strict=True):
        if ok.any():
            logits[i][~ok] = -np.inf


def process_rows(logits: np.ndarray, specs: Sequence[SampleSpec]) -> None:
    """Bias, penalties, then masks, in place: all that comes before the pick."""
    apply_logit_bias(logits, specs)
    apply_penalties(logits, specs)
    apply_masks(logits, specs)


def verify_row_picks(logits: np.ndarray, specs: Sequence[SampleSpec],
                     proposed: Sequence[int]) -> list[int]:
    """`verify_picks` over logits [K, vocab] processed first by each position's spec (bias,
    penalties, its mask: a constrained request's position past proposed tokens) when any
    asks; the raw logits are left as they are."""
    if not all(s.is_plain for s in specs):
        logits = np.array(logits, dtype=np.float32)  # [K, vocab] (a copy)
        process_rows(logits, specs)
    return verify_picks(logits, specs, proposed)


def top_tokens(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest entries of `row` [vocab], largest first, ties by the smaller
    id (every tie at the k-th value is weighed, not an arbitrary one)."""
    vocab = row.shape[0]
    if k < vocab:
        kth = np.partition(row, vocab - k)[vocab - k]
        cand = np.flatnonzero(row >= kth)  # ascending ids
    else:
        cand = np.arange(vocab)
    return cand[np.lexsort((cand, -row[cand]))[:k]]


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], tops: Sequence[int]
                   ) -> list[TokenLogprob]:
    """For each row of logits [m, vocab] float32: the log-probability of tokens[i] and of
    the tops[i] likeliest tokens (log-softmax in float64)."""
    out = []
    for lo in range(0, len(tokens), LOGPROB_ROWS):
        x = logits[lo:lo + LOGPROB_ROWS].astype(np.float64)  # [r, vocab]
        peak = x.max(axis=1, keepdims=True)
        lse = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=1))  # [r]
        for i, (tok, k) in enumerate(zip(tokens[lo:lo + LOGPROB_ROWS],
                                         tops[lo:lo + LOGPROB_ROWS], strict=True)):
            top: tuple[tuple[int, float], ...] = ()
            if k > 0:
                top = tuple((int(t), float(x[i, t] - lse[i])) for t in top_tokens(x[i], k))
            out.append(TokenLogprob(int(tok), float(x[i, tok] - lse[i]), top))
    return out


def pick_rows(logits: np.ndarray, specs: Sequence[SampleSpec]
              ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Each row's pick from logits [rows >= len(specs), vocab] float32, processed in place
    (`process_rows`), and the raw log-probabilities of the picks whose spec asks (None for
    the others)."""
    n = len(specs)
    asked = [i for i, s in enumerate(specs) if s.logprobs >= 0]
    if all(s.is_plain for s in specs):
        return sample_rows(logits, specs), [None] * n
    raw = logits[asked] if asked else None  # [asked, vocab] (a copy)
    process_rows(logits, specs)
    picks = sample_rows(logits, specs)
    logprobs: list[TokenLogprob | None] = [None] * n
    if raw is not None:
        found = token_logprobs(raw, [picks[i] for i in asked], [specs[i].logprobs for i in asked])
        for i, lp in zip(asked, found, strict=True):
            logprobs[i] = lp
    return picks, logprobs
