"""llama2.c legacy checkpoints (`.bin`) and llama2.c tokenizers (`tokenizer.bin`).

Checkpoint: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
a negative vocab_size means a separate classifier), then float32 weights grouped by kind
across layers. RoPE rotates adjacent pairs.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llm_runner_svc.errors import ModelFormatError
from llm_runner_svc.models.spec import LayerWeights, ModelConfig, ModelWeights, RopeStyle
from llm_runner_svc.models.tokenizer import Tokenizer

_HEADER = struct.Struct("<7i")
BOS_ID = 1
EOS_ID = 2


def load_checkpoint(path: Path) -> tuple[ModelConfig, ModelWeights]:
    """Read a llama2.c checkpoint; raise ModelFormatError on a bad header or a short file."""
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise ModelFormatError(f"{path}: {len(data)} bytes is too short for a llama2.c header")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = _HEADER.unpack_from(data)
    shared = vocab > 0
    vocab = abs(vocab)
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads:
        raise ModelFormatError(f"{path}: implausible llama2.c header {_HEADER.unpack_from(data)}")
    head_dim = dim // n_heads
    cfg = ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
        num_layers=n_layers, num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim,
        max_position=seq_len, rope_theta=10000.0, rope_style=RopeStyle.INTERLEAVED,
        rms_eps=1e-5, tie_embeddings=shared, bos_id=BOS_ID, eos_ids=(EOS_ID, BOS_ID),
    )
    kv_dim = cfg.kv_dim
    L = n_layers
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("emb", (vocab, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)),
        ("wk", (L, kv_dim, dim)), ("wv", (L, kv_dim, dim)), ("wo", (L, dim, dim)),
        ("rms_ffn", (L, dim)), ("w1", (L, hidden, dim)), ("w2", (L, dim, hidden)),
        ("w3", (L, hidden, dim)), ("rms_final", (dim,)),
        ("freq_cis", (seq_len, head_dim)),  # legacy real+imag tables, skipped
    ]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    need = _HEADER.size + 4 * sum(int(np.prod(s)) for _, s in shapes)
    if len(data) < need:
        raise ModelFormatError(
            f"{path}: truncated checkpoint ({len(data)} bytes, the header implies {need})")
    flat = np.frombuffer(data, dtype="<f4", offset=_HEADER.size)
    arrays: dict[str, np.ndarray] = {}
    off = 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        arrays[name] = flat[off:off + n].reshape(shape).astype(np.float32)
        off += n
    layers = [
        LayerWeights(
            attn_norm=arrays["rms_att"][i], wq=arrays["wq"][i], wk=arrays["wk"][i],
            wv=arrays["wv"][i], wo=arrays["wo"][i], ffn_norm=arrays["rms_ffn"][i],
            w_gate=arrays["w1"][i], w_up=arrays["w3"][i], w_down=arrays["w2"][i],
        )
        for i in range(L)
    ]
    weights = ModelWeights(embedding=arrays["emb"], layers=layers,
                           final_norm=arrays["rms_final"], lm_head=arrays.get("wcls"))
    weights.check(cfg)
    return cfg, weights


class Llama2cTokenizer(Tokenizer):
    """llama2.c's BPE: a dummy-prefix space, code points looked up (bytes as `<0xXX>` + 3
    fallback), then repeated merges of the adjacent pair with the best score. Encoding is
    O(n log n) in the text's length and gives the ids of llama2.c's rescanning loop."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        data = path.read_bytes()
        if len(data) < 4:
            raise ModelFormatError(f"{path}: too short for a llama2.c tokenizer")
        pieces: list[bytes] = []
        scores: list[float] = []
        off = 4
        try:
            for _ in range(vocab_size):
                score, n = struct.unpack_from("<fi", data, off)
                off += 8
                if n < 0 or off + n > len(data):
                    raise struct.error("piece runs past the end")
                pieces.append(data[off:off + n])
                scores.append(score)
                off += n
        except struct.error as exc:
            raise ModelFormatError(
                f"{path}: truncated tokenizer after {len(pieces)} of {vocab_size} pieces") from exc
        self.pieces = pieces
        self._bytes = [self._piece_bytes(p) for p in pieces]
        self.scores = scores
        self.lookup = {p: i for i, p in enumerate(pieces)}
        # Each piece's score as a rank, best first, equal scores sharing one; None for the
        # pieces never merged into (score -1e10 or less, or NaN).
        ranks = {v: r for r, v in enumerate(sorted({v for v in scores if v > -1e10},
                                                   reverse=True))}
        self._rank: list[int | None] = [ranks[v] if v > -1e10 else None for v in scores]
        self.vocab_size = vocab_size
        self.bos_id = BOS_ID
        # llama2.c trains stories separated by BOS, so a generated BOS ends the text too
        self.eos_ids = (EOS_ID, BOS_ID)

    def token_bytes(self) -> list[bytes] | None:
        return list(self._bytes)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = [BOS_ID] if add_bos else []
        if not text:
            return ids
        return ids + self._encode(text, dummy_prefix=True)

    def encode_fragment(self, text: str) -> list[int]:
        return self._encode(text, dummy_prefix=False) if text else []

    def _encode(self, text: str, dummy_prefix: bool) -> list[int]:
        toks: list[int] = []
        space = self.lookup.get(b" ")
        if space is not None and dummy_prefix:
            toks.append(space)
        for ch in text:
            b = ch.encode("utf-8")
            tid = self.lookup.get(b)
            if tid is not None:
                toks.append(tid)
            else:
                toks.extend(byte + 3 for byte in b)
        return self._merge(toks)

    def _merge(self, toks: list[int]) -> list[int]:
        """llama2.c's merge order in O(n log n): repeatedly merge the adjacent pair whose
        merged piece has the highest score, the leftmost on a tie; pairs scoring -1e10 or
        less (or NaN) never merge. The tokens form a linked list over their first positions
        (which keeps their order); a heap of plain ints (score rank x n + position: no
        tuples for the garbage collector to walk) holds every candidate pair, and an entry
        whose pair no longer merges at that rank is skipped when it comes out."""
        n = len(toks)
        if n < 2:
            return list(toks)
        tok = list(toks)  # [n] the token that starts at each position; -1 once merged away
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[int] = []
        pieces, lookup, rank = self.pieces, self.lookup, self._rank

        def push(i: int, j: int) -> None:
            tid = lookup.get(pieces[tok[i]] + pieces[tok[j]])
            r = None if tid is None else rank[tid]
            if r is not None:
                heapq.heappush(heap, r * n + i)

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            r, i = divmod(heapq.heappop(heap), n)
            j = nxt[i]
            if tok[i] < 0 or j < 0:
                continue
            tid = lookup.get(pieces[tok[i]] + pieces[tok[j]])
            if tid is None or rank[tid] != r:
                continue  # stale: this pair changed since the entry was pushed
            tok[i], tok[j] = tid, -1
            k = nxt[j]
            nxt[i] = k
            if k >= 0:
                prv[k] = i
                push(i, k)
            if prv[i] >= 0:
                push(prv[i], i)
        out: list[int] = []
        i = 0  # the first node is never merged away
        while i >= 0:
            out.append(tok[i])
            i = nxt[i]
        return out

    @staticmethod
    def _piece_bytes(piece: bytes) -> bytes:
        """The bytes a piece stands for (`<0xXX>` is one byte)."""
        if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return piece
        return piece

    def decode(self, ids: Sequence[int], after_bos: bool = False) -> str:
        out = bytearray()
        prev_bos = after_bos
        table = self._bytes  # streaming decodes a token or two per call: lookups only
        for tid in ids:
            if tid == BOS_ID:
                prev_bos = True
                continue
            if not 0 <= tid < self.vocab_size:
                raise ModelFormatError(f"token id {tid} is outside the vocabulary")
            piece = table[tid]
            if prev_bos:
                if piece.startswith(b" "):
                    piece = piece[1:]
                prev_bos = False
            out += piece
        return out.decode("utf-8", errors="replace")
