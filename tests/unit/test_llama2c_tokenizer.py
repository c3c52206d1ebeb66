"""The llama2.c tokenizer's heap merge gives the ids of llama2.c's own rescanning loop.

`reference_merge` is that loop (run.c's `encode`, quadratic: each merge rescans every pair),
kept here as the definition the fast merge must match: on the goldens' texts, on fuzzed text,
and on a synthetic vocabulary full of tied, NaN and very low scores.
"""

from __future__ import annotations

import itertools
import math
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_runner_svc.models import Model
from llm_runner_svc.models.llama2c import BOS_ID, Llama2cTokenizer


def reference_merge(tok: Llama2cTokenizer, toks: list[int]) -> list[int]:
    """llama2.c's loop: merge the best-scoring adjacent pair (leftmost on a tie) until none."""
    toks = list(toks)
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(toks) - 1):
            tid = tok.lookup.get(tok.pieces[toks[i]] + tok.pieces[toks[i + 1]])
            if tid is not None and tok.scores[tid] > best:
                best, best_i, best_id = tok.scores[tid], i, tid
        if best_i < 0:
            return toks
        toks[best_i:best_i + 2] = [best_id]


def reference_encode(tok: Llama2cTokenizer, text: str, add_bos: bool = True) -> list[int]:
    ids = [BOS_ID] if add_bos else []
    if not text:
        return ids
    toks = [tok.lookup[b" "]] if b" " in tok.lookup else []
    for ch in text:
        b = ch.encode("utf-8")
        toks.extend([tok.lookup[b]] if b in tok.lookup else [byte + 3 for byte in b])
    return ids + reference_merge(tok, toks)


STORY_ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDELOST.,!?'\"\n  eeaattoonnhhss"
story_text = st.text(alphabet=STORY_ALPHABET, max_size=300)
any_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=120)


def test_goldens_texts(stories: Model, goldens: dict) -> None:
    tok = stories.tokenizer
    assert isinstance(tok, Llama2cTokenizer)
    texts = [c.get("prompt", "") for c in goldens["cases"]] + [
        c["text"] for c in goldens["cases"] if "text" in c]
    for text in texts:
        assert tok.encode(text) == reference_encode(tok, text)
    assert tok.encode("Once upon a time, a dragon")[:1] == [BOS_ID]


@settings(max_examples=150, deadline=None)
@given(text=story_text, add_bos=st.booleans())
def test_fuzzed_story_text(stories: Model, text: str, add_bos: bool) -> None:
    tok = stories.tokenizer
    assert isinstance(tok, Llama2cTokenizer)
    assert tok.encode(text, add_bos) == reference_encode(tok, text, add_bos)


@settings(max_examples=150, deadline=None)
@given(text=any_text)
def test_fuzzed_unicode_text(stories: Model, text: str) -> None:
    tok = stories.tokenizer
    assert isinstance(tok, Llama2cTokenizer)
    assert tok.encode(text) == reference_encode(tok, text)


def _write_tokenizer(path: Path, entries: list[tuple[bytes, float]]) -> Llama2cTokenizer:
    """A llama2.c tokenizer file: max piece length, then (score, length, bytes) per piece."""
    body = b"".join(struct.pack("<fi", score, len(p)) + p for p, score in entries)
    path.write_bytes(struct.pack("<i", max(len(p) for p, _ in entries)) + body)
    return Llama2cTokenizer(path, len(entries))


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Llama2cTokenizer:
    """Bytes as <0xXX>, then letters and every 2- and 3-letter piece of "abc" with scores
    that tie often, one NaN, one at -1e10 (never merged) and one at -inf."""
    entries: list[tuple[bytes, float]] = [(b"<unk>", 0.0), (b"<s>", 0.0), (b"</s>", 0.0)]
    entries += [(f"<0x{b:02X}>".encode(), 0.0) for b in range(256)]
    entries += [(b" ", -1.0), (b"a", -1.0), (b"b", -1.0), (b"c", -1.0)]
    odd = {b"cc": math.nan, b"ca": -1e10, b"ba": -math.inf}
    for i, x in enumerate("abc"):
        for j, y in enumerate("abc"):
            pair = (x + y).encode()
            entries.append((pair, odd.get(pair, float((i + j) % 2))))
            for k, z in enumerate(" abc"):
                entries.append(((x + y + z).encode(), float((i * j + k) % 3) - 1.0))
    entries += [(b" a", 1.0), (b" b", 1.0), (b" ab", 2.0)]
    return _write_tokenizer(tmp_path_factory.mktemp("tok") / "tok.bin", entries)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc x", max_size=200))
def test_tied_nan_and_low_scores(tied: Llama2cTokenizer, text: str) -> None:
    assert tied.encode(text) == reference_encode(tied, text)


AB_PIECES = [("".join(p)).encode() for n in (2, 3, 4) for p in itertools.product("ab ", repeat=n)]


@settings(max_examples=200, deadline=None)
@given(scores=st.lists(st.sampled_from([-2.0, -1.0, 0.0, 1.0, 2.0, -1e10, math.nan]),
                       min_size=len(AB_PIECES), max_size=len(AB_PIECES)),
       text=st.text(alphabet="ab ", max_size=60))
def test_random_vocabularies(tmp_path_factory: pytest.TempPathFactory, scores: list[float],
                             text: str) -> None:
    """Every 2- to 4-piece of "ab " with random, mostly tied scores: merges that change a
    neighbour's pair often, so entries go stale in every order."""
    entries: list[tuple[bytes, float]] = [(b"<unk>", 0.0), (b"<s>", 0.0), (b"</s>", 0.0)]
    entries += [(f"<0x{b:02X}>".encode(), 0.0) for b in range(256)]
    entries += [(b"a", 0.0), (b"b", 0.0), (b" ", 0.0), *zip(AB_PIECES, scores, strict=True)]
    tok = _write_tokenizer(tmp_path_factory.mktemp("ab") / "tok.bin", entries)
    assert tok.encode(text) == reference_encode(tok, text)


def test_long_text_is_fast_enough_to_be_linear_ish(stories: Model) -> None:
    """200 KB would take minutes with the rescanning loop; the heap merge does it in a
    fraction of that on any machine (no timing asserted: only that it ends and agrees in
    length with the decoded text)."""
    tok = stories.tokenizer
    text = "Once upon a time there was a little girl named Lily. " * 4000
    ids = tok.encode(text)
    assert tok.decode(ids) == text
